"""Test helpers, shipped for users: an in-memory sink and a simulated asynchronous device.

::

    from steptrace.testing import SimulatedDevice, capture

    device = SimulatedDevice()
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                s.wait_for(device.run(0.02))     # 20 ms of "device" work, dispatched asynchronously
    assert sink.steps()[1]["compute_seconds"] == pytest.approx(0.02, rel=0.2)

:class:`SimulatedDevice` is a real background worker executing queued work of
given durations in order, like one accelerator stream. It implements the same
device protocol the resolver uses for JAX and CUDA: pass its work handles to
``wait_for`` (value-style, like JAX), or pass the device itself as
``init(backend=device)`` to time steps with stream markers (like CUDA events).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Iterator

import steptrace

_perf = time.perf_counter


class MemorySink:
    """Keeps every exported record in memory (``records``), with filters by type."""

    name = "memory"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.shut_down = False

    def export(self, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)

    def force_flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        self.shut_down = True

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("type") == kind]

    def steps(self) -> list[dict[str, Any]]:
        return self.of_type("step")

    def checkpoints(self) -> list[dict[str, Any]]:
        return self.of_type("checkpoint")

    def spans(self) -> list[dict[str, Any]]:
        return self.of_type("span")

    def microbatches(self) -> list[dict[str, Any]]:
        return self.of_type("microbatch")


@contextlib.contextmanager
def capture(**settings: Any) -> Iterator[MemorySink]:
    """``init()`` with a :class:`MemorySink` (and no JSONL unless asked), then ``shutdown()`` on exit.

    Records are complete when the block ends. ``strict`` defaults to True so misuse raises.
    """
    sink = MemorySink()
    settings.setdefault("jsonl", False)
    settings.setdefault("strict", True)
    settings.setdefault("run_id", "test")
    steptrace.init(sinks=[sink], **settings)
    try:
        yield sink
    finally:
        steptrace.shutdown()


class SimulatedWork:
    """A unit of queued simulated device work; ready when the worker has executed it."""

    __slots__ = ("seconds", "label", "enqueued", "start_time", "end_time", "_done", "_steptrace_device")

    def __init__(self, device: "SimulatedDevice", seconds: float, label: str | None):
        self._steptrace_device = device
        self.seconds = seconds
        self.label = label
        self.enqueued = _perf()
        self.start_time: float | None = None
        self.end_time: float | None = None
        self._done = threading.Event()

    def is_ready(self) -> bool:
        return self._done.is_set()

    def block_until_ready(self) -> "SimulatedWork":
        """Synchronise the calling thread with this work (what sync-every-step loops do)."""
        self._done.wait()
        return self


class SimulatedDevice:
    """One in-order device stream executed by a background thread (``time.sleep`` per work item).

    ``run(seconds)`` enqueues work and returns at once, like an asynchronous
    kernel launch. ``event()`` enqueues a zero-length marker, like
    ``torch.cuda.Event.record()``: it completes when the stream reaches it.
    """

    name = "simulated"

    def __init__(self, *, uses_events: bool = True):
        #: When passed as ``init(backend=device)``: True times steps by stream markers.
        self.uses_events = uses_events
        self._queue: queue.SimpleQueue[SimulatedWork | None] = queue.SimpleQueue()
        self.executed: list[SimulatedWork] = []
        self._thread = threading.Thread(target=self._run, name="steptrace-simulated-device", daemon=True)
        self._thread.start()

    def run(self, seconds: float, label: str | None = None) -> SimulatedWork:
        """Dispatch ``seconds`` of device work asynchronously; returns its handle."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        work = SimulatedWork(self, seconds, label)
        self._queue.put(work)
        return work

    def synchronize(self) -> None:
        """Block until everything dispatched so far has executed."""
        self.run(0.0).block_until_ready()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work.start_time = _perf()
            if work.seconds:
                time.sleep(work.seconds)
            work.end_time = _perf()
            self.executed.append(work)
            work._done.set()

    # -- the device protocol the resolver uses (see steptrace._devices.Device) ----------
    def event(self) -> SimulatedWork:
        return self.run(0.0, "marker")

    def wait_event(self, event: SimulatedWork) -> float:
        event._done.wait()
        return event.end_time  # type: ignore[return-value]

    def elapsed(self, start_event: SimulatedWork, end_event: SimulatedWork) -> float:
        return end_event.end_time - start_event.end_time  # type: ignore[operator]

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        latest = None
        for work in _leaves(values):
            if isinstance(work, SimulatedWork):
                work._done.wait()
                latest = work.end_time if latest is None else max(latest, work.end_time)
        return latest


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value
