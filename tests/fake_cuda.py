"""A CUDA stand-in for tests on machines without a GPU: ``torch.cuda`` patched onto SimulatedDevices.

It keeps the CUDA and PyTorch rules steptrace depends on, so the real
``steptrace.adapters.torch`` code runs unchanged. Each rule names its source:

* an event is stamped when its stream reaches it (after the work queued before
  it on that stream), on its GPU's own clock, which drifts against the host's;
  ``query`` never blocks;
* ``elapsed_time`` returns float32 milliseconds and raises unless both events
  were recorded and have completed (c10 ``CUDAEvent::elapsed_time``: "Both
  events must be completed before calculating elapsed time"), and fails for
  events of two devices (``cudaEventElapsedTime``: cudaErrorInvalidResourceHandle);
* the current device is per host thread (``cudaSetDevice`` is thread state; a
  new thread starts on device 0), and an event records only on a stream of the
  device it was created on (c10 ``CUDAEvent::record``: "Event device ... does
  not match recording stream's device");
* ``torch.cuda.Stream()`` hands out the device's pool streams round robin, 32
  per priority (c10 ``CUDAStream.cpp``: ``kStreamsPerPool = 32``), the same pool
  NCCL process groups and graph capture draw from; a stream steptrace creates
  itself (``cuStreamCreateWithPriority`` through the adapter's driver) is its own;
* with ``one_queue`` (``CUDA_DEVICE_MAX_CONNECTIONS=1``) every stream of a GPU
  runs in submission order (see ``steptrace.testing.SimulatedDevice``);
* during a ``"global"``-mode capture (the default of ``torch.cuda.graph`` and
  ``make_graphed_callables``), a potentially unsafe call (``query``, ``record``,
  ``elapsed_time``, ``synchronize``) from *another* thread fails and invalidates
  the capture, unless that thread exchanged its capture mode to thread-local or
  relaxed (CUDA runtime API, ``cudaStreamBeginCapture`` and
  ``cudaThreadExchangeStreamCaptureMode``; pytorch#104487, the NCCL watchdog's
  ``event.query()`` killing captures, fixed in pytorch#148594 the same way);
* the caching allocator books memory when work is dispatched (the host runs
  ahead of the device), and ``max_memory_allocated`` is one counter per device
  that ``reset_peak_memory_stats`` resets for everyone who reads it;
* ``torch.cuda.synchronize`` and ``Event.synchronize`` work, and the threads
  that call them are recorded: steptrace's threads must never appear.

Kernel launches are ``fake.run(seconds)``; the device keeps executing while
the training thread holds the GIL (``steptrace.testing.hold_gil``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

import pytest

from steptrace.testing import SimulatedDevice, SimulatedMarker, SimulatedWork

POOL_STREAMS = 32  # c10/cuda/CUDAStream.cpp kStreamsPerPool


class FakeCudaTensor:
    """Looks like a CUDA ``torch.Tensor`` to steptrace's backend choice (module ``torch``, ``is_cuda``)."""

    is_cuda = True

    def __init__(self, device: int = 0):
        self.device_index = device

    def get_device(self) -> int:
        return self.device_index


FakeCudaTensor.__module__ = "torch"


class CaptureInvalidated(RuntimeError):
    pass


class FakeCuda:
    def __init__(self, monkeypatch: Any, device: SimulatedDevice | None = None, *, initialized: bool = True,
                 gpus: int = 1, one_queue: bool = False, drift_ppm: float = 80.0, driver: bool = True,
                 total_memory: int = 80 * 2**30):
        torch = pytest.importorskip("torch", reason="the fake CUDA patches torch.cuda")
        first = device if device is not None else SimulatedDevice(clock_drift_ppm=drift_ppm, one_queue=one_queue)
        self.gpus = [first] + [SimulatedDevice(clock_drift_ppm=drift_ppm * (i + 2), clock_offset_s=500.0 * (i + 2),
                                               one_queue=one_queue) for i in range(1, gpus)]
        self.device = first
        self.events_created = 0
        self.event_synchronize_calls = 0
        self.query_calls = 0
        self.synchronize_threads: list[str] = []
        self.capturing = False  # legacy switch: the training thread's current stream is capturing
        self.initialized = initialized
        self.capture: dict[str, Any] | None = None  # an ongoing stream capture
        self.captures_invalidated = 0
        self.unsafe_calls_during_capture: list[str] = []
        self.records_on_capturing_stream = 0
        self.thread_capture_mode: dict[int, str] = {}
        self.streams_created = 0
        self._local = threading.local()
        self._pool_next: dict[tuple[int, int], int] = {}
        self._pools: dict[tuple[int, int, int], Any] = {}
        self.allocated = [0] * gpus
        self.peak = [0] * gpus
        self.total_memory = total_memory
        fake = self

        class Stream:
            def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
                # A pool stream, round robin (c10 getStreamFromPool); the same object for the same slot.
                index = fake._index(device)
                bucket = 0 if priority >= 0 else 1
                slot = fake._pool_next.get((index, bucket), 0)
                fake._pool_next[index, bucket] = (slot + 1) % POOL_STREAMS
                key = (index, bucket, slot)
                stream = fake._pools.get(key)
                if stream is None:
                    stream = object.__new__(cls)
                    stream.device_index, stream.key, stream.priority = index, ("pool", bucket, slot), priority
                    fake._pools[key] = stream
                return stream

            def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
                pass

        class ExternalStream:
            def __init__(self, stream_ptr: int, device: Any = None):
                self.device_index = fake._index(device)
                self.key = ("external", stream_ptr)
                self.priority = -1

        self.Stream, self.ExternalStream = Stream, ExternalStream
        self.default_streams = []
        for i in range(gpus):
            default = object.__new__(Stream)
            default.device_index, default.key, default.priority = i, None, 0
            self.default_streams.append(default)
        self.main_stream = self.default_streams[0]

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                         external: bool = False):
                assert enable_timing, "steptrace must ask for timing events"
                self._marker: SimulatedMarker | None = None
                self._device: int | None = None  # bound at the first record (c10 createEvent)
                fake.events_created += 1

            def record(self, stream: Any = None) -> None:
                capture = fake.capture
                if capture is not None:
                    fake._unsafe("Event.record")
                    if stream is capture["stream"] or stream is None and fake.is_current_stream_capturing():
                        fake.records_on_capturing_stream += 1
                if stream is None:
                    stream = fake.current_stream()
                if self._device is not None and stream.device_index != self._device:
                    raise RuntimeError(f"Event device {self._device} does not match recording stream's device "
                                       f"{stream.device_index}.")
                self._device = stream.device_index
                if self._marker is None:
                    self._marker = SimulatedMarker()
                fake.gpus[self._device].stamp(self._marker, stream=stream.key)

            def query(self) -> bool:
                if fake.capture is not None:
                    fake._unsafe("Event.query")
                fake.query_calls += 1
                return self._marker is None or fake.gpus[self._device].query(self._marker)

            def elapsed_time(self, end: "Event") -> float:
                fake._unsafe("Event.elapsed_time")
                if self._marker is None or end._marker is None:
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                if self._device != end._device:
                    raise RuntimeError("CUDA error: invalid resource handle (events of two devices)")
                gpu = fake.gpus[self._device]
                if not (gpu.query(self._marker) and gpu.query(end._marker)):
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")
                return gpu.elapsed(self._marker, end._marker) * 1000.0

            def synchronize(self) -> None:
                fake._unsafe("Event.synchronize")
                fake.event_synchronize_calls += 1
                fake.synchronize_threads.append(threading.current_thread().name)
                if self._marker is not None:
                    SimulatedWork(fake.gpus[self._device], 0.0, None, self._marker.done_at).block_until_ready()

        def synchronize(device: Any = None) -> None:
            fake._unsafe("synchronize")
            fake.synchronize_threads.append(threading.current_thread().name)
            fake.gpus[fake._index(device)].synchronize()

        class device_guard:
            def __init__(self, device: Any):
                self.index = fake._index(device)

            def __enter__(self) -> None:
                self.previous = fake.current_device()
                fake.set_device(self.index)

            def __exit__(self, *exc: Any) -> None:
                fake.set_device(self.previous)

        class Properties:
            name = "FakeCuda"

            def __init__(self, index: int):
                self.total_memory = fake.total_memory

        nvtx = type("nvtx", (), {"range_push": staticmethod(lambda msg: 0), "range_pop": staticmethod(lambda: 0)})
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: fake.initialized)
        monkeypatch.setattr(cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(cuda, "Event", Event)
        monkeypatch.setattr(cuda, "Stream", Stream)
        monkeypatch.setattr(cuda, "ExternalStream", ExternalStream)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "current_device", self.current_device)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "device", device_guard)
        monkeypatch.setattr(cuda, "is_current_stream_capturing", self.is_current_stream_capturing)
        monkeypatch.setattr(cuda, "synchronize", synchronize)
        monkeypatch.setattr(cuda, "nvtx", nvtx)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: fake.allocated[fake._index(device)])
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: fake.peak[fake._index(device)])
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
        monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: Properties(fake._index(device)))
        # The cheap per-unit path torch has in C (no Python Stream object per call).
        monkeypatch.setattr(torch._C, "_cuda_getDevice", self.current_device, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                            lambda index: id(self.current_stream(index)), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", self.is_current_stream_capturing,
                            raising=False)
        self.driver = _FakeDriver(self) if driver else None
        from steptrace.adapters import torch as torch_adapter

        # raising=False: the adapter before issue 18 had no driver (the tests then show its failures).
        monkeypatch.setattr(torch_adapter, "_DRIVER", self.driver if driver else _NoDriver(), raising=False)

    # -- threads, devices, streams ------------------------------------------------------------
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # a new thread starts on device 0

    def set_device(self, device: Any) -> None:
        self._local.device = self._index(device)

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        index = getattr(device, "index", None)
        if index is None and isinstance(device, str) and ":" in device:
            index = int(device.rsplit(":", 1)[1])
        return self.current_device() if index is None else index

    def current_stream(self, device: Any = None) -> Any:
        index = self._index(device)
        streams = getattr(self._local, "streams", None)
        if streams and index in streams:
            return streams[index]
        return self.default_streams[index]

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        """``torch.cuda.stream(s)``: make ``stream`` current on this thread for its device."""
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        previous = streams.get(stream.device_index)
        streams[stream.device_index] = stream
        try:
            yield stream
        finally:
            if previous is None:
                del streams[stream.device_index]
            else:
                streams[stream.device_index] = previous

    def run(self, seconds: float, label: str | None = None, *, stream: Any = None,
            device: Any = None) -> SimulatedWork:
        """A kernel launch on ``stream`` (default: this thread's current stream of ``device``, itself by
        default the current device): ``seconds`` of device work, queued."""
        stream = self.current_stream(device) if stream is None else stream
        return self.gpus[stream.device_index].run(seconds, label, stream=stream.key)

    # -- graph capture --------------------------------------------------------------------------
    def is_current_stream_capturing(self) -> bool:
        capture = self.capture
        if capture is None:
            return self.capturing
        return capture["thread"] == threading.get_ident() and self.current_stream() is capture["stream"]

    @contextlib.contextmanager
    def graph_capture(self, mode: str = "global") -> Iterator[dict[str, Any]]:
        """``with torch.cuda.graph(g, capture_error_mode=mode)``: capture on a side stream of this thread."""
        stream = self.Stream()
        capture = {"thread": threading.get_ident(), "mode": mode, "stream": stream, "invalidated": False}
        with self.stream(stream):
            self.capture = capture
            try:
                yield capture
            finally:
                self.capture = None
        if capture["invalidated"]:
            raise CaptureInvalidated("cudaStreamEndCapture: operation failed due to a previous error "
                                     "during capture (cudaErrorStreamCaptureInvalidated)")

    def _unsafe(self, what: str) -> None:
        """A potentially unsafe call during a capture (cudaStreamBeginCapture's rules)."""
        capture = self.capture
        if capture is None:
            return
        me = threading.get_ident()
        mode = self.thread_capture_mode.get(me, "global")
        if me == capture["thread"]:
            if mode == "relaxed":
                return
        elif capture["mode"] != "global" or mode != "global":
            return  # another thread: only a global-mode capture is at risk, and only from a global thread
        self.unsafe_calls_during_capture.append(f"{what} on {threading.current_thread().name}")
        if not capture["invalidated"]:
            capture["invalidated"] = True
            self.captures_invalidated += 1
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                           "(cudaErrorStreamCaptureImplicit)")

    # -- memory ---------------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: Any = None) -> None:
        """The caching allocator books ``nbytes`` now, when the work is dispatched."""
        index = self._index(device)
        self.allocated[index] += nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])

    def free(self, nbytes: int, device: Any = None) -> None:
        self.allocated[self._index(device)] -= nbytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        index = self._index(device)
        self.peak[index] = self.allocated[index]


class _FakeDriver:
    """The adapter's ``_DRIVER``: capture mode exchange and stream creation, per host thread."""

    MODES = {0: "global", 1: "thread_local", 2: "relaxed"}

    def __init__(self, fake: FakeCuda):
        self.fake = fake
        self._ptrs = itertools.count(0x7F0000)
        self.exchanges: list[tuple[str, str]] = []

    def exchange_capture_mode(self, mode: int) -> int:
        me = threading.get_ident()
        old = self.fake.thread_capture_mode.get(me, "global")
        self.fake.thread_capture_mode[me] = self.MODES[mode]
        self.exchanges.append((threading.current_thread().name, self.MODES[mode]))
        return {v: k for k, v in self.MODES.items()}[old]

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        return 0, -5

    def create_stream(self, priority: int, device: int) -> int:
        """A new non-blocking stream on ``device``, never a pool stream."""
        assert device == self.fake.current_device(), "the adapter sets the device before creating a stream"
        self.fake.streams_created += 1
        return next(self._ptrs)


class _NoDriver:
    """No libcuda: what the adapter sees on a machine where ctypes cannot load the driver."""

    def exchange_capture_mode(self, mode: int) -> int:
        raise OSError("libcuda.so.1: cannot open shared object file")

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        raise OSError("libcuda.so.1: cannot open shared object file")

    def create_stream(self, priority: int, device: int) -> int:
        raise OSError("libcuda.so.1: cannot open shared object file")
