"""Device backends: how the resolver learns when the device finished a unit of work.

Two kinds, one protocol (:class:`Device`):

* **value devices** (JAX, :class:`steptrace.testing.SimulatedDevice` values): the
  training thread hands over the step's outputs (``wait_for``); the resolver
  blocks on them (``wait_values``) and the moment they are ready is ``end(n)``.
* **stream devices** (CUDA through torch, a ``SimulatedDevice`` passed as the
  backend): markers (``event()``) are recorded on the device stream at the
  step's dispatch point and at its exit; the resolver waits on the exit marker
  and reads the device-measured time between the two (``elapsed``).

The training thread only calls the cheap methods (``event``); everything that
blocks (``wait_*``) runs on the resolver thread.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Device(Protocol):
    """What the resolver needs from a backend (also implemented by ``SimulatedDevice``)."""

    #: Short name written into records (``backend`` field).
    name: str
    #: True for stream devices: markers are recorded at dispatch and exit.
    uses_events: bool

    def event(self) -> Any:
        """Record a marker on the device stream now (training thread; must not block)."""

    def wait_event(self, event: Any) -> float | None:
        """Block until the marker completed; its host completion time if known, else None."""

    def elapsed(self, start_event: Any, end_event: Any) -> float:
        """Device seconds between two completed markers."""

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        """Block until every value is computed; completion host time if known, else None."""


class HostDevice:
    """Synchronous execution (PyTorch on CPU, plain Python): ``end(n) = host_end(n)``."""

    name = "host"
    uses_events = False

    def event(self) -> None:
        return None

    def wait_event(self, event: Any) -> float | None:
        return None

    def elapsed(self, start_event: Any, end_event: Any) -> float:
        raise NotImplementedError("the host device records no markers")

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        return None


HOST = HostDevice()


class DeviceChooser:
    """Picks the device for the values given to ``wait_for``, caching by type.

    Runs on the training thread, so it looks only at type names (never imports
    a framework, never touches array contents) and remembers each answer.
    """

    def __init__(self) -> None:
        #: type -> device, for leaf types only (read directly by the training-thread fast path)
        self.by_type: dict[type, Device] = {}
        self._jax: Device | None = None

    def for_values(self, values: tuple[Any, ...]) -> Device:
        for value in values:
            device = self._for_value(value, 0)
            if device is not HOST:
                return device
        return HOST

    def _for_value(self, value: Any, depth: int) -> Device:
        kind = type(value)
        found = self.by_type.get(kind)
        if found is not None:
            return found
        if kind in (list, tuple) or kind is dict:
            # A pytree: the first leaf decides (a step's outputs share one device).
            if depth > 8:
                return HOST
            items = value.values() if kind is dict else value
            for item in items:
                device = self._for_value(item, depth + 1)
                if device is not HOST:
                    return device
            return HOST
        # Values that carry their own device (SimulatedWork) are not cached by type:
        # several simulated devices may coexist.
        own = getattr(value, "_steptrace_device", None)
        if own is not None:
            return own
        device = self._classify(kind)
        self.by_type[kind] = device
        return device

    def _classify(self, kind: type) -> Device:
        module = kind.__module__ or ""
        if module.startswith(("jax", "jaxlib")):
            return self.jax_device()
        # torch tensors: CUDA steps are timed by stream markers chosen at step entry;
        # a CPU tensor was computed synchronously, so host timing is exact.
        return HOST

    def jax_device(self) -> Device:
        if self._jax is None:
            from steptrace.adapters.jax import JaxDevice

            self._jax = JaxDevice()
        return self._jax


def torch_cuda_in_use() -> bool:
    """True when the user's program imported torch and CUDA is available (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def perf_now() -> float:
    return time.perf_counter()
