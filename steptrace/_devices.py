"""Device backends, and the one place that decides which one times a unit of work.

Two kinds of device, one small protocol each:

* **value devices** (JAX, :class:`steptrace.testing.SimulatedDevice` values): the
  training thread hands over the step's outputs (``wait_for``); the resolver
  blocks on them (``wait_values``). A device that knows when they became ready
  returns that host time (``end_source: "device"``); JAX cannot, so the resolver
  reads the clock when the wait returns (``end_source: "observed"``), which a
  GIL-holding call on the training thread can delay.
* **stream devices** (CUDA through torch, a ``SimulatedDevice`` passed as the
  backend): markers are recorded on the device stream at the step's dispatch
  point and at its exit (``record``, training thread, from a pool); the
  resolver polls them (``query``, never blocks or spins) and places their
  device-clock timestamps on the host clock (``steptrace._clock``), so a late
  observation never changes a time (``end_source: "device_clock"``).

Which device times a step follows the work, not the imports (DESIGN §2); see
:class:`Backends`. Everything that blocks or polls runs on the resolver thread.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol


class Device(Protocol):
    """What every backend has."""

    #: Short name written into records (``backend`` field).
    name: str
    #: True for stream devices (markers and a device clock), False for value devices.
    uses_events: bool


class ValueDevice(Device, Protocol):
    """May also have ``prepare_end(values)`` (resolver thread, as soon as the step is handed over): a
    pending device-clock end, with ``complete()`` (never waits), ``end_time()`` (the host
    ``perf_counter`` time the values became ready) and ``release()``, or None (JAX on a CUDA GPU:
    ``steptrace.adapters.jax.DeviceEnds``)."""

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        """Block until every value is computed (resolver thread). Returns the host
        ``perf_counter`` time they became ready when the device knows it, else None."""


class StreamDevice(Device, Protocol):
    def current_stream(self) -> Any:
        """The stream work is being queued on now (training thread, cheap), or None when
        no marker may be recorded on it (a CUDA graph capture is in progress)."""

    def record(self, stream: Any, marker: Any = None) -> Any:
        """Record ``marker`` (or a pooled new one) on ``stream`` now and return it.
        Training thread; must not block and should not allocate in steady state."""

    def query(self, marker: Any) -> bool:
        """True once the stream has reached the marker (resolver thread; never blocks)."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Device-clock seconds from ``start`` to ``end``, both complete, ``end`` not earlier."""

    def release(self, marker: Any) -> None:
        """Give a marker back to the pool once its time has been read (resolver thread)."""

    def clock_marker(self) -> Any:
        """Record a marker on a stream of steptrace's own on the same device now (resolver thread):
        the calibration anchor of ``steptrace._clock``.

        Optional: ``drained()`` (resolver thread, never blocks) says whether the newest marker the
        training thread recorded has completed, when an anchor is tight even with one hardware
        queue; a stream object with a ``steptrace_device`` attribute times the unit on that device
        (a backend of several GPUs); ``start_unit(unit, rt)``, ``end_unit(unit, rt)`` and
        ``span_marker(step, rt)`` (training thread) record a unit's start or end marker, or a span's
        inside ``step``, in one call, doing exactly what ``Runtime.start_markers``, ``end_marker`` and
        ``span_marker`` do through ``current_stream`` and ``record`` (the compiled hot path calls them
        where the device's class has them: a marker then costs one Python frame, not two or three)."""


class HostDevice:
    """Synchronous execution (PyTorch on CPU, plain Python): ``end(n) = host_end(n)``."""

    name = "host"
    uses_events = False

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        return None


HOST = HostDevice()


class _TorchTensors:
    """Marker for torch tensors in the type cache: CUDA or CPU is a property of the value."""


TORCH_TENSORS = _TorchTensors()


class Backends:
    """Decides which device times each step and microbatch. The rule (DESIGN §2):

    * ``backend`` forced by configuration: that device, always (a stream device
      times every step with markers, whatever ``wait_for`` is given).
    * ``auto``: the values given to ``wait_for`` decide. JAX arrays are timed by
      JAX even when torch is imported; CPU torch tensors (and numpy arrays) were
      computed synchronously, so the step is host-timed; CUDA torch tensors are
      timed by CUDA events. Without a deciding value, a step is event-timed when
      torch's CUDA has been initialised in this process (work is being queued on
      a GPU), else host-timed. While steps are being timed by their values,
      later steps do not record speculative CUDA markers.

    Runs on the training thread: it looks at type names and ``is_cuda``, never
    imports a framework the program has not imported, never touches contents.
    """

    def __init__(self, backend: Any):
        self.auto = False
        #: Stream device forced for every step (None: decided per step).
        self.forced_stream: Any = None
        #: Value device forced for ``wait_for`` values (None: decided by the values).
        self.forced_values: Any = None
        self._cuda: Any = None
        self._jax: Any = None
        #: True while the last decided step was timed by its values (JAX): skip speculative markers.
        #: Set through set_timed_by_values(), which keeps may_stream in step with it.
        self.timed_by_values = False
        #: Whether a unit starting now may be timed by stream markers (stream_for_unit may say a
        #: device): read on the training thread at every step's entry, so a JAX or host loop pays
        #: one attribute read for the stream decision, not two calls.
        self.may_stream = False
        #: type -> device (or TORCH_TENSORS, or None for "no opinion"), for leaf types.
        self.by_type: dict[type, Any] = {}
        if not isinstance(backend, str):
            if getattr(backend, "uses_events", False):
                self.forced_stream = backend
            else:
                self.forced_values = backend
        elif backend == "auto":
            self.auto = True
        elif backend == "host":
            self.forced_values = HOST
        elif backend == "jax":
            from steptrace.adapters.jax import JaxDevice

            self.forced_values = JaxDevice()
        elif backend == "torch":
            # CUDA events when CUDA is there; CPU torch runs synchronously (host timing is exact).
            from steptrace.adapters.torch import TorchCudaDevice, require_torch

            if require_torch().cuda.is_available():
                self.forced_stream = self._cuda = TorchCudaDevice()
            else:
                self.forced_values = HOST
        else:
            raise ValueError(f"backend: unknown backend {backend!r}")
        self.set_timed_by_values(False)

    def set_timed_by_values(self, timed_by_values: bool) -> None:
        self.timed_by_values = timed_by_values
        self.may_stream = self.forced_stream is not None or (self.auto and not timed_by_values)

    # -- at init() -----------------------------------------------------------------------
    def init_hooks(self, runtime: Any, backend: Any) -> None:
        """Set up, at ``init()``, what must see the time before the first step: JAX's compile
        listener, when the program has imported jax, so compilation before step 0 (state
        initialisation, a first eval) is ``compile`` in the first step's time before it, not
        ``startup`` or the span it fell in. A program that imports jax after ``init()`` gets the
        listener at its first step (:meth:`framework_hooks`)."""
        if "jax" in sys.modules and backend in ("auto", "jax"):
            try:
                from steptrace.adapters import jax as jax_adapter

                jax_adapter.install_compile_listener(runtime)
            except Exception:  # a jax without monitoring: the first step tries again, and says nothing
                pass

    # -- at the first step --------------------------------------------------------------
    def framework_hooks(self, runtime: Any, backend: Any, annotate: bool) -> Callable[[int], Any] | None:
        """Set up, once at the first step, what depends on the frameworks the program imported: JAX's
        compile listener, the per-step profiler annotation (JAX, torch, or both), and the timing of
        torch.distributed collectives (each rank's wait in them). Returns the
        annotator (``annotate(n)`` → an open range with ``__exit__``) or None.

        With ``_devices`` choosing backends, this is the only place the core imports an adapter.
        """
        annotators = []
        if "jax" in sys.modules and backend in ("auto", "jax"):
            from steptrace.adapters import jax as jax_adapter

            jax_adapter.install_compile_listener(runtime)
            if annotate:
                annotators.append(jax_adapter.step_annotator())
        if "torch" in sys.modules and annotate and backend in ("auto", "torch"):
            from steptrace.adapters import torch as torch_adapter

            annotators.append(torch_adapter.step_annotator())
        if "torch.distributed" in sys.modules and backend in ("auto", "torch", "host"):
            # Each rank's wait in collectives (gloo; DDP through its comm hook), so the cross-rank
            # view can tell the rank that is slow from the ranks that wait for it.
            from steptrace.adapters import torch_distributed

            torch_distributed.mark_runtime(runtime)
        if len(annotators) == 1:
            return annotators[0]
        return _AllAnnotations(annotators) if annotators else None

    def framework_teardown(self, runtime: Any) -> None:
        """Undo, at shutdown, what :meth:`framework_hooks` installed for ``runtime`` (the collective wrappers)."""
        module = sys.modules.get("steptrace.adapters.torch_distributed")
        if module is not None:
            try:
                module.release_runtime(runtime)
            except Exception:
                pass

    def flop_counters(self, runtime: Any) -> list[Any]:
        """What counts a flops="auto" step's hardware FLOPs, set up at the first such step: JAX's
        compiled programs (XLA cost analysis, read as they compile), then torch's FLOP counter (over
        one steady step). Each has ``source``, ``enter(step)`` and ``exit(step)``, which returns the
        step's hardware FLOPs or None. Frameworks not imported are not asked."""
        counters: list[Any] = []
        forced = self.forced_values if self.forced_values is not None else self.forced_stream
        if "jax" in sys.modules and (self.auto or getattr(forced, "name", None) == "jax"):
            from steptrace.adapters import jax as jax_adapter

            counters.append(jax_adapter.ProgramFlops(runtime))
        if "torch" in sys.modules and (self.auto or getattr(forced, "name", None) in ("torch-cuda", "host")):
            from steptrace.adapters import torch as torch_adapter

            counters.append(torch_adapter.StepFlopCounter())
        return counters

    # -- at step / microbatch entry ------------------------------------------------------
    def stream_for_unit(self) -> Any:
        """The stream device to record markers on for a unit starting now, or None. (The compiled step
        entry, steptrace/_hotpath.c, answers None itself, without this call, when no stream device is
        forced or known and torch is not imported: keep the two in step.)"""
        if self.forced_stream is not None:
            return self.forced_stream
        if not self.auto or self.timed_by_values:
            return None
        cuda = self._cuda
        if cuda is not None:
            return cuda  # CUDA in use (every step of a CUDA loop), without a call
        if "torch" not in sys.modules:
            return None  # the common CPU case, without a call
        return self.cuda_if_initialised()

    def cuda_index(self) -> int | None:
        """The GPU a step starting now would be timed on (training thread, at the first step), or None
        when steps are not CUDA-timed here (no torch CUDA in use, or another backend forced)."""
        if self.forced_values is not None or (not self.auto and self.forced_stream is None):
            return None
        device = self.forced_stream if self.forced_stream is not None else self.cuda_if_initialised()
        timed_index = getattr(device, "timed_index", None)
        if timed_index is None:
            return None
        try:
            return timed_index()
        except Exception:
            return None

    def cuda_if_initialised(self) -> Any:
        cuda = self._cuda
        if cuda is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return None
            try:
                # Not is_available(): a CPU program on a GPU machine never initialises CUDA.
                if not torch.cuda.is_initialized():
                    return None
            except Exception:
                return None
            from steptrace.adapters.torch import TorchCudaDevice

            cuda = self._cuda = TorchCudaDevice()
        return cuda

    # -- at wait_for -------------------------------------------------------------------
    def for_values(self, values: tuple[Any, ...]) -> Any:
        """The device the values say computed them: a value device, HOST (computed
        synchronously), a stream device (CUDA tensors), or None (the values do not say)."""
        if self.forced_values is not None:
            return self.forced_values
        if len(values) == 1:
            # One value of a type seen before (the loss, every step): its device without a call.
            found = self.by_type.get(type(values[0]), _MISSING)
            if found is not _MISSING and found is not TORCH_TENSORS:
                return found
        for value in values:
            device = self._for_value(value, 0)
            if device is not None:
                return device
        return None

    def _for_value(self, value: Any, depth: int) -> Any:
        kind = type(value)
        found = self.by_type.get(kind, _MISSING)
        if found is _MISSING:
            if kind in (list, tuple) or kind is dict:
                # A pytree: the first deciding leaf decides (a step's outputs share one device).
                if depth > 8:
                    return None
                for item in (value.values() if kind is dict else value):
                    device = self._for_value(item, depth + 1)
                    if device is not None:
                        return device
                return None
            # Values that carry their own device (SimulatedWork) are not cached by type:
            # several simulated devices may coexist.
            own = getattr(value, "_steptrace_device", None)
            if own is not None:
                return own
            found = self.by_type[kind] = self._classify(kind)
        if found is TORCH_TENSORS:
            try:
                if value.is_cuda:
                    self.set_timed_by_values(False)
                    cuda = self.cuda_if_initialised()
                    # The GPU the tensor lives on (a rank that never called set_device).
                    for_value = getattr(cuda, "for_value", None)
                    return cuda if for_value is None else for_value(value)
            except Exception:
                return None
            return HOST
        return found

    def _classify(self, kind: type) -> Any:
        module = kind.__module__ or ""
        if module.startswith(("jax", "jaxlib")):
            if self._jax is None:
                from steptrace.adapters.jax import JaxDevice

                self._jax = JaxDevice()
            return self._jax
        if module.startswith("torch") and hasattr(kind, "is_cuda"):
            return TORCH_TENSORS
        if module == "numpy":
            return HOST  # a numpy array is already on the host: it was computed synchronously
        return None


_MISSING = object()


def scalar_reader(value: Any) -> Any:
    """How the resolver reads a step scalar logged with ``s.log(name=value)`` without the training
    thread waiting: a float now (host numbers, CPU tensors, numpy scalars), a callable to call once
    the step has ended on the device (device scalars, whose copy to the host starts here), or None
    when ``value`` is not a scalar."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    module = type(value).__module__ or ""
    if module.startswith(("jax", "jaxlib")):
        from steptrace.adapters.jax import scalar_reader as jax_reader

        return jax_reader(value)
    if module.startswith("torch"):
        from steptrace.adapters.torch import scalar_reader as torch_reader

        return torch_reader(value)
    if module.startswith("numpy"):
        try:
            return float(value.item()) if value.size == 1 else None
        except (AttributeError, TypeError, ValueError):
            return None
    return None


class _AllAnnotations:
    """Both frameworks imported: open each one's step annotation, close them in reverse."""

    __slots__ = ("_annotators", "_opened")

    def __init__(self, annotators: list[Callable[[int], Any]]):
        self._annotators = annotators
        self._opened: list[Any] = []

    def __call__(self, n: int) -> Any:
        opened = [a for a in (annotate(n) for annotate in self._annotators) if a is not None]
        if not opened:
            return None
        combined = _AllAnnotations(self._annotators)
        combined._opened = opened
        return combined

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for annotation in reversed(self._opened):
            annotation.__exit__(exc_type, exc, tb)

