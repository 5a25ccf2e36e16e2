"""Test helpers, shipped for users: an in-memory sink and a simulated asynchronous device.

::

    from steptrace.testing import SimulatedDevice, capture

    device = SimulatedDevice()
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                s.wait_for(device.run(0.02))     # 20 ms of "device" work, dispatched asynchronously
    assert sink.steps()[1]["compute_seconds"] == pytest.approx(0.02, rel=0.2)

:class:`SimulatedDevice` executes queued work of given durations in order,
like one accelerator stream, asynchronously to the host. It implements the
same device protocols the resolver uses for JAX and CUDA: pass its work
handles to ``wait_for`` (value-style, like JAX), or pass the device itself as
``init(backend=device)`` to time steps with stream markers and a drifting
device clock (like CUDA events). :func:`hold_gil` stalls the calling thread
without releasing the GIL, like ``torch.save``'s pickling.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import struct
import sys
import threading
import time
from typing import Any, Iterator

import steptrace

_perf = time.perf_counter


class MemorySink:
    """Keeps every exported record in memory (``records``), with filters by type."""

    name = "memory"
    instant_flush = True  # force_flush only says so: called on the caller's thread (steptrace._sinks)

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
    """A unit of queued simulated device work; ready once the stream has executed it."""

    __slots__ = ("seconds", "label", "enqueued", "start_time", "end_time", "_steptrace_device")

    def __init__(self, device: "SimulatedDevice", seconds: float, label: str | None, start: float):
        # What steptrace's backend choice reads: handles given to wait_for are timed by value.
        self._steptrace_device = device.values
        self.seconds = seconds
        self.label = label
        self.enqueued = start
        #: Host ``perf_counter`` times the stream runs it (known at dispatch: the stream is in order).
        self.start_time = start
        self.end_time = start + seconds

    def is_ready(self) -> bool:
        return _perf() >= self.end_time

    def block_until_ready(self) -> "SimulatedWork":
        """Synchronise the calling thread with this work (what sync-every-step loops do)."""
        _sleep_until(self.end_time)
        return self


class SimulatedMarker:
    """A stream marker (like a CUDA event): reached when the stream has executed what was queued before it."""

    __slots__ = ("recorded_at", "done_at", "pooled")

    def __init__(self) -> None:
        self.recorded_at = 0.0
        self.done_at = 0.0
        self.pooled = False


class _SimulatedValues:
    """A :class:`SimulatedDevice` seen as a value device (its ``run()`` handles given to ``wait_for``)."""

    uses_events = False

    def __init__(self, device: "SimulatedDevice"):
        self.name = device.name
        self.wait_values = device.wait_values
        self.memory_stats = device.memory_stats


class SimulatedDevice:
    """One in-order device stream, with a device clock of its own.

    ``run(seconds)`` enqueues work and returns at once, like an asynchronous
    kernel launch. The stream's timeline is computed at dispatch (each item
    starts when both it was queued and the previous item ended), so the
    simulated device keeps executing while the training thread is stuck in a
    GIL-holding call (:func:`hold_gil`), as a real GPU does.

    As a **value device** (pass ``run()`` handles to ``wait_for``) it returns
    the exact end time when ``report_end_times`` (``end_source: "device"``), or
    makes the resolver observe completion like JAX (``"observed"``).

    As a **stream device** (``init(backend=device)`` with ``uses_events=True``,
    the default) it behaves like CUDA events: markers are pooled, ``query``
    never blocks, and ``elapsed`` is the difference of two markers on the
    device's clock, which runs ``clock_drift_ppm`` fast against the host and
    is returned as float32 milliseconds (as ``cudaEventElapsedTime``), so the
    resolver has to calibrate it exactly as it does a GPU.

    Streams: ``run(seconds, stream=key)`` and ``stamp(marker, stream=key)`` queue on a named
    stream (``None`` is the main stream); each stream executes in order, independently of the
    others, and ``"side"`` (what ``clock_marker`` uses) has no work of its own. ``one_queue``
    (alias ``side_stream_blocked``) is ``CUDA_DEVICE_MAX_CONNECTIONS=1``: every stream feeds one
    hardware queue, so everything runs in submission order, whatever stream it was queued on
    (CUDA C Programming Guide, "Implicit Synchronization" / the ``CUDA_DEVICE_MAX_CONNECTIONS``
    environment variable: with one connection all streams share one hardware work queue).
    """

    name = "simulated"

    def __init__(self, *, uses_events: bool = True, report_end_times: bool = True,
                 clock_drift_ppm: float = 0.0, clock_offset_s: float = 1000.0,
                 record_latency_s: float = 5e-6, side_stream_blocked: bool = False,
                 one_queue: bool = False, memory_limit_bytes: int | None = None):
        #: When passed as ``init(backend=device)``: True times steps by stream markers.
        self.uses_events = uses_events
        self.report_end_times = report_end_times
        self.clock_drift_ppm = clock_drift_ppm
        self.clock_offset_s = clock_offset_s
        self.record_latency_s = record_latency_s
        #: One hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``): all streams in submission order.
        self.one_queue = one_queue or side_stream_blocked
        self.side_stream_blocked = self.one_queue
        self._origin = _perf()
        self._busy_until = self._origin  # the main stream's
        self._streams: dict[Any, float] = {}  # other streams: key -> busy until
        self._queue_until = self._origin  # everything submitted, any stream
        self._lock = threading.Lock()
        #: Every work item dispatched, in stream order.
        self.dispatched: list[SimulatedWork] = []
        self._free: list[SimulatedMarker] = []
        #: Markers created (pool high-water mark) and currently handed out (not released).
        self.markers_created = 0
        self.markers_outstanding = 0
        #: Device memory, reported per step when ``memory_limit_bytes`` is given: set
        #: ``memory_in_use_bytes`` as the "program" allocates; the peak is tracked since the last report.
        self.memory_limit_bytes = memory_limit_bytes
        self._in_use = 0
        self._peak = 0
        #: This device as a value device: what ``wait_for(device.run(...))`` is timed by.
        self.values = _SimulatedValues(self)

    @property
    def memory_in_use_bytes(self) -> int:
        return self._in_use

    @memory_in_use_bytes.setter
    def memory_in_use_bytes(self, value: int) -> None:
        self._in_use = value
        self._peak = max(self._peak, value)

    def memory_stats(self) -> dict[str, int] | None:
        """In use now, peak since the previous call, and the limit; None without a limit (like a CPU)."""
        if self.memory_limit_bytes is None:
            return None
        stats = {"in_use_bytes": self._in_use, "peak_bytes": max(self._peak, self._in_use),
                 "limit_bytes": self.memory_limit_bytes}
        self._peak = self._in_use
        return stats

    @property
    def executed(self) -> list[SimulatedWork]:
        """The work items the stream has finished by now."""
        now = _perf()
        return [w for w in self.dispatched if w.end_time <= now]

    def run(self, seconds: float, label: str | None = None, stream: Any = None) -> SimulatedWork:
        """Dispatch ``seconds`` of device work asynchronously on ``stream`` (None: the main one)."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        with self._lock:
            start = max(_perf(), self._floor(stream))
            work = SimulatedWork(self, seconds, label, start)
            self._occupy(stream, work.end_time)
            self.dispatched.append(work)
        return work

    def _floor(self, stream: Any) -> float:
        # When work queued on ``stream`` now can start: after its stream's earlier work, or after
        # everything submitted on any stream when there is one hardware queue.
        if self.one_queue:
            return self._queue_until
        if stream is None:
            return self._busy_until
        return self._streams.get(stream, self._origin)

    def _occupy(self, stream: Any, until: float) -> None:
        if stream is None:
            self._busy_until = until
        else:
            self._streams[stream] = until
        self._queue_until = max(self._queue_until, until)

    def drained(self) -> bool:
        """True once everything queued on any stream has executed (the device is idle)."""
        return _perf() >= self._queue_until

    def synchronize(self) -> None:
        """Block until everything dispatched so far, on every stream, has executed."""
        _sleep_until(self._queue_until)

    def close(self) -> None:
        """Nothing to stop (the stream is a computed timeline); kept for symmetry with real devices."""

    def device_clock(self, host_time: float) -> float:
        """The device clock's reading (seconds) at a host ``perf_counter`` time."""
        return (host_time - self._origin) * (1.0 + self.clock_drift_ppm * 1e-6) + self.clock_offset_s

    # -- the value-device protocol (steptrace._devices.ValueDevice) -----------------------
    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        latest = None
        for work in _leaves(values):
            if isinstance(work, SimulatedWork):
                latest = work.end_time if latest is None else max(latest, work.end_time)
        if latest is None:
            return None
        _sleep_until(latest)
        return latest if self.report_end_times else None

    # -- the stream-device protocol (steptrace._devices.StreamDevice) ---------------------
    def current_stream(self) -> str:
        return "stream0"

    def record(self, stream: Any, marker: SimulatedMarker | None = None) -> SimulatedMarker:
        if marker is None:
            marker = self._take_marker()
        self.stamp(marker, side=stream == "side")
        return marker

    def query(self, marker: SimulatedMarker) -> bool:
        return _perf() >= marker.done_at

    def elapsed(self, start: SimulatedMarker, end: SimulatedMarker) -> float:
        if not (self.query(start) and self.query(end)):
            raise RuntimeError("both markers must be complete before reading elapsed time (as CUDA)")
        seconds = self.device_clock(end.done_at) - self.device_clock(start.done_at)
        # cudaEventElapsedTime returns float32 milliseconds.
        return struct.unpack("f", struct.pack("f", seconds * 1000.0))[0] / 1000.0

    def release(self, marker: SimulatedMarker) -> None:
        with self._lock:
            if marker.pooled:
                raise RuntimeError("marker released twice")
            marker.pooled = True
            self.markers_outstanding -= 1
            self._free.append(marker)

    def clock_marker(self) -> SimulatedMarker:
        return self.record("side")

    def stamp(self, marker: SimulatedMarker, *, side: bool = False, stream: Any = None) -> None:
        """Record ``marker`` now on ``stream`` (None: the main one; ``side=True``: the idle side
        stream): reached once the work queued before it on that stream has executed (with one
        hardware queue, once everything submitted before it has)."""
        with self._lock:
            now = _perf()
            marker.recorded_at = now
            key = "side" if side else stream
            marker.done_at = max(now + self.record_latency_s, self._floor(key))
            self._occupy(key, marker.done_at)

    def _take_marker(self) -> SimulatedMarker:
        with self._lock:
            if self._free:
                marker = self._free.pop()
            else:
                marker = SimulatedMarker()
                self.markers_created += 1
            marker.pooled = False
            self.markers_outstanding += 1
        return marker


def hold_gil(seconds: float) -> None:
    """Block the calling thread for ``seconds`` *without releasing the GIL*.

    What ``torch.save``'s pickling, a large ``sorted()`` or a GC pass do to every
    other Python thread: none of them runs, so none can read a clock. Used to
    check that steptrace's times do not depend on when its threads get to run.
    Calls the C library's ``usleep`` through ``ctypes.PyDLL`` (which keeps the GIL).
    """
    if seconds <= 0:
        return
    libc = _libc()
    libc.usleep(ctypes.c_uint(int(seconds * 1e6)))


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        if name is None and sys.platform.startswith("linux"):
            name = "libc.so.6"
        if name is None:
            raise OSError("hold_gil needs the C library's usleep (Linux or macOS)")
        _LIBC = ctypes.PyDLL(name)
        _LIBC.usleep.argtypes = [ctypes.c_uint]
    return _LIBC


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - _perf()
        if left <= 0:
            return
        time.sleep(left)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value
