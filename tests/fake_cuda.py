"""A CUDA stand-in for tests on machines without a GPU: ``torch.cuda`` patched onto SimulatedDevices.

It keeps the CUDA and PyTorch rules steptrace depends on, so the real
``steptrace.adapters.torch`` code runs unchanged. Each rule names its source:

* an event is stamped when its stream reaches it (after the work queued before
  it on that stream), on its GPU's own clock, which drifts against the host's;
  ``query`` never blocks;
* ``elapsed_time`` returns float32 milliseconds (``cudaEventElapsedTime`` takes a
  ``float*``: at 10 minutes one step of float32 is 62.5 µs) and raises unless both
  events were recorded and have completed (c10 ``CUDAEvent::elapsed_time``: "Both
  events must be completed before calculating elapsed time"), and fails for
  events of two devices or without timing (``cuEventElapsedTime``:
  CUDA_ERROR_INVALID_HANDLE);
* the current device is per host thread (``cudaSetDevice`` is thread state; a
  new thread starts on device 0), and work follows the tensors' device, not the
  current one (PyTorch "CUDA semantics": operations run on, and allocate their
  results on, the device of their operands; a kernel here is ``run(device=k)``);
* an event is created at its first record, on the device of the stream it is
  recorded on, and records only on that device's streams (c10 ``CUDAEvent::record``
  and ``createEvent``: "Event device ... does not match recording stream's device");
* a device's CUDA context is made by the first thing that needs one there: an
  allocation, a kernel, creating or recording an event, creating a stream, a
  synchronize, ``cudaSetDevice`` (CUDA 12: "cudaSetDevice ... initializes the
  primary context"; c10 ``SetDevice`` skips the call when the device is already
  current) or retaining the primary context through the driver. Asking for the
  current stream, the capture status (c10 ``currentStreamCaptureStatus`` checks
  ``hasPrimaryContext`` first), device properties, the allocator's statistics or
  ``torch._C._cuda_hasPrimaryContext`` makes none. ``contexts`` counts them per
  device: each costs hundreds of MB of that GPU's memory;
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
* an event recorded into a stream being captured becomes a node of the graph, not
  a timestamp: it never completes, and querying it or timing it fails (CUDA
  Programming Guide, "Stream Capture / Prohibited and Unhandled Operations": "It
  is invalid to ... query the execution status of ... a captured event";
  cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is
  capturing");
* the caching allocator books memory when work is dispatched (the host runs
  ahead of the device), and ``max_memory_allocated`` is one counter per device
  that ``reset_peak_memory_stats`` resets for everyone who reads it;
  ``memory_stats_as_nested_dict`` also counts allocation requests
  (``allocation.all.allocated``) and reserved memory, per device; with ``async_allocator``
  (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``) they read zero (``torch.cuda.memory_stats``:
  "some stats are not meaningful, and are always reported as zero");
* who gives the GIL away on a call that does not block (measured by the lead on an H200, torch
  2.11: a sleeping thread woke hundreds of times during 0.2 s of back-to-back ``Event.record`` or
  ``t.add_(1)`` calls, never during ``Event.query``, ``elapsed_time`` or ``memory_stats``; torch's
  op bindings release it with ``gil_scoped_release`` around the dispatch, and ``THCPEvent_record``
  around ``cudaEventRecord``): ``Event.record`` and, with ``launches_release_gil``, a kernel launch
  (``run``) release it after their effect (``time.sleep(0)``), so a thread waiting for the GIL runs there; the driver's
  ``cuEventRecord`` and ``cuEventQuery`` through ``ctypes.PyDLL`` (the adapter's
  ``record_keeping_gil``/``query_keeping_gil``) keep it;
* who holds the GIL while a call blocks (measured by the lead on an H200, torch
  2.11+cu130, driver 580, issue 32; and PyTorch's ``torch/csrc/cuda/Event.cpp``):
  ``torch.cuda.synchronize``, ``Event.synchronize`` and ``empty_cache`` release
  it while they wait; the allocator's statistics (``memory_stats*``,
  ``memory_allocated``) wait for its mutex *holding* the GIL while another thread
  is inside ``empty_cache`` (759 ms measured, every Python thread frozen);
  ``Event.query``, ``elapsed_time`` and ``record`` are bound without releasing
  it. A function called through ``ctypes.CDLL`` (the adapter's driver calls)
  releases it (ctypes documentation; measured: ``cuEventSynchronize`` through
  ctypes, a 1.35 ms heartbeat gap over an 808 ms wait). With ``driver_lock``, an
  event call from another thread also waits while a thread is inside a
  synchronizing call (a model of the driver's context lock, not measured: it
  lets a test show what each binding does to the other threads when a call
  blocks). ``gil_held_blocks`` and ``gil_released_blocks`` record each wait;
  ``binding_calls`` records the torch-binding calls made off the training thread;
* a synchronous copy (``Tensor.item()``, ``.cpu()``, a pageable ``.to("cuda")``: ``fake.sync_copy()``)
  waits for the work queued before it with the GIL released, and meanwhile ``cuEventRecord`` from
  any other thread waits for it to finish, while ``cuEventQuery``, ``cuStreamQuery`` and
  ``cuEventElapsedTime`` do not (measured by the lead on an H200, driver 580.159.04, 2026-11-27:
  ``cuEventRecord`` from a second thread waited 769-820 ms while the training thread was in each of
  those three calls behind a 1 s kernel; the other three calls at most 1.7 ms; nothing waited during
  ``torch.cuda.synchronize``). Through ``ctypes.PyDLL`` that wait holds the GIL (the resolver's anchor
  froze every Python thread for 1.6 s of a ``.item()`` behind a 3 s kernel, seen with faulthandler);
* ``torch.cuda.synchronize`` and ``Event.synchronize`` work, and the threads
  that call them are recorded: steptrace's threads must never appear.

Kernel launches are ``fake.run(seconds)``; the device keeps executing while
the training thread holds the GIL (``steptrace.testing.hold_gil``).
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
from typing import Any, Iterator

import pytest

from steptrace.testing import SimulatedDevice, SimulatedMarker, SimulatedWork, hold_gil

POOL_STREAMS = 32  # c10/cuda/CUDAStream.cpp kStreamsPerPool
SEGMENT_BYTES = 2 * 2**20  # the caching allocator's smallest segment (c10 kSmallBuffer)
# CUresult codes (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
_CAPTURED = "CUDA error: operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported)"


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as ``cudaEventElapsedTime`` returns it."""
    return struct.unpack("f", struct.pack("f", value))[0]


class FakeCudaTensor:
    """Looks like a CUDA ``torch.Tensor`` to steptrace (module ``torch``, ``is_cuda``, ``get_device``).

    A one-element tensor has a ``value`` that exists on the device once the kernel that computes it
    (``ready``, a :class:`SimulatedWork`) has run; copying it to the host (``to("cpu",
    non_blocking=True)``, ``host.copy_(tensor, non_blocking=True)``) queues the copy on the current
    stream of the tensor's device (c10 ``copy_``: a guard on the CUDA tensor's device, then its
    current stream), and the host buffer holds the value only once that copy has run."""

    is_cuda = True
    dtype = "float32"

    def __init__(self, device: int = 0, value: float = 0.0, ready: SimulatedWork | None = None,
                 fake: "FakeCuda | None" = None):
        self.device_index = device
        self.value = value
        self.ready = ready
        self.fake = fake

    def get_device(self) -> int:
        return self.device_index

    def numel(self) -> int:
        return 1

    def detach(self) -> "FakeCudaTensor":
        return self

    def reshape(self, shape: Any) -> "FakeCudaTensor":
        return self

    def to(self, device: Any, non_blocking: bool = False) -> "FakePinnedScalar":
        assert device == "cpu" and non_blocking, "steptrace copies device scalars asynchronously"
        assert self.fake is not None, "give the tensor its FakeCuda to copy it"
        host = FakePinnedScalar(self.fake, self.dtype)
        host.copy_(self, non_blocking=True)
        return host


FakeCudaTensor.__module__ = "torch"


class FakePinnedScalar:
    """A one-element tensor in pinned host memory (``non_blocking`` copies to it are asynchronous).
    Read before its copy has run, it holds whatever it held before (NaN when new)."""

    def __init__(self, fake: "FakeCuda", dtype: str):
        fake.pinned_created += 1
        self.fake = fake
        self.dtype = dtype
        self._old = float("nan")
        self._value = float("nan")
        self._copied_at = 0.0

    def copy_(self, source: FakeCudaTensor, non_blocking: bool = False) -> "FakePinnedScalar":
        assert non_blocking and source.dtype == self.dtype
        fake = self.fake
        fake.touch(source.device_index, "copy")
        stream = fake.current_stream(source.device_index)
        self._old = float(self)  # what a read before the copy lands sees
        copy = fake.gpus[source.device_index].run(0.0, "d2h copy", stream=stream.key)  # into pinned memory
        if source.ready is not None:
            assert copy.start_time >= source.ready.end_time, "a copy queued behind its producer"
        self._value, self._copied_at = source.value, copy.end_time
        return self

    def __float__(self) -> float:
        return self._value if time.perf_counter() >= self._copied_at else self._old

    def item(self) -> float:
        return float(self)


class CaptureInvalidated(RuntimeError):
    pass


class FakeCuda:
    def __init__(self, monkeypatch: Any, device: SimulatedDevice | None = None, *, initialized: bool = True,
                 gpus: int = 1, one_queue: bool = False, drift_ppm: float = 80.0, driver: bool = True,
                 total_memory: int = 80 * 2**30, names: list[str] | None = None, driver_lock: bool = False,
                 async_allocator: bool = False):
        torch = pytest.importorskip("torch", reason="the fake CUDA patches torch.cuda")
        first = device if device is not None else SimulatedDevice(clock_drift_ppm=drift_ppm, one_queue=one_queue)
        self.gpus = [first] + [SimulatedDevice(clock_drift_ppm=drift_ppm * (i + 2), clock_offset_s=500.0 * (i + 2),
                                               one_queue=one_queue) for i in range(1, gpus)]
        if first.one_queue:
            # One hardware queue is what CUDA_DEVICE_MAX_CONNECTIONS=1 gives a process (CUDA C Programming
            # Guide, "Implicit Synchronization"); the adapter reads the variable as it would on a GPU.
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        self.device = first
        self.names = names or ["FakeCuda"] * gpus
        #: Whether a kernel launch gives the GIL away as torch's ops do. Off by default: the tests of exact
        #: durations assume the end marker follows the last launch at once, which a background thread's
        #: turn at a launch breaks on a real GPU too (docs/devices.md says by how much).
        self.launches_release_gil = False
        self.events_created = 0
        self.events_created_on_training_thread = 0  # (steptrace's resolver refills its pool itself)
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
        #: CUDA contexts made per device (a primary context is made once), and what made each.
        self.contexts = [0] * gpus
        self.context_made_by: dict[int, str] = {}
        #: Pinned host buffers created for device-to-host copies.
        self.pinned_created = 0
        self.driver_lock = driver_lock
        #: (thread, call, seconds) of every call that waited, by whether it held the GIL meanwhile.
        self.gil_held_blocks: list[tuple[str, str, float]] = []
        self.gil_released_blocks: list[tuple[str, str, float]] = []
        #: (thread, call) of torch-binding event and allocator calls made off the thread that trains.
        self.binding_calls: list[tuple[str, str]] = []
        self.train_thread = threading.get_ident()
        self._in_empty_cache: dict[int, tuple[int, float]] = {}  # device -> (thread, until)
        self._in_copy: dict[int, tuple[int, float]] = {}  # device -> (thread, until): synchronous copies
        self._in_sync: dict[int, tuple[int, float]] = {}  # device -> (thread, until): synchronizing calls
        self._local = threading.local()
        self._pool_next: dict[tuple[int, int], int] = {}
        self._pools: dict[tuple[int, int, int], Any] = {}
        self._handles: dict[int, Any] = {}
        self._external_streams: dict[int, Any] = {}
        self.gil_keeping_records = 0
        #: Torch-binding calls made on the training thread that give the GIL away (``Event.record``): each
        #: lets any other Python thread run between two of the training thread's lines (issue 47 budget).
        self.gil_releases_on_training_thread = 0
        #: Every stream by its raw handle (``cuda_stream``), as the driver finds a ``CUstream``.
        self.streams_by_handle: dict[int, Any] = {}
        self._next_handle = itertools.count(0x1000)
        self.allocated = [0] * gpus
        self.peak = [0] * gpus
        self.reserved = [0] * gpus
        self.allocations = [0] * gpus
        self.total_memory = total_memory
        fake = self

        class Stream:
            def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
                # A pool stream, round robin (c10 getStreamFromPool); the same object for the same slot.
                index = fake._index(device)
                fake.touch(index, "torch.cuda.Stream()")  # the pool's streams are created on first use
                bucket = 0 if priority >= 0 else 1
                slot = fake._pool_next.get((index, bucket), 0)
                fake._pool_next[index, bucket] = (slot + 1) % POOL_STREAMS
                key = (index, bucket, slot)
                stream = fake._pools.get(key)
                if stream is None:
                    stream = object.__new__(cls)
                    stream.device_index, stream.key, stream.priority = index, ("pool", bucket, slot), priority
                    fake._pools[key] = stream
                    fake.streams_by_handle[id(stream)] = stream
                return stream

            def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
                pass

            @property
            def cuda_stream(self) -> int:
                return id(self)  # what torch._C._cuda_getCurrentRawStream gives for it here

        class ExternalStream:
            def __init__(self, stream_ptr: int, device: Any = None):
                self.device_index = fake._index(device)
                self.key = ("external", stream_ptr)
                self.priority = -1
                self.cuda_stream = stream_ptr
                fake._external_streams[stream_ptr] = self
                fake.streams_by_handle[stream_ptr] = self

        self.Stream, self.ExternalStream = Stream, ExternalStream
        self.default_streams = []
        for i in range(gpus):
            default = object.__new__(Stream)
            default.device_index, default.key, default.priority = i, None, 0
            self.default_streams.append(default)
            self.streams_by_handle[id(default)] = default
        self.main_stream = self.default_streams[0]

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                         external: bool = False):
                # Nothing is created on a device yet (c10 createEvent runs at the first record).
                self.enable_timing = enable_timing
                self._marker: SimulatedMarker | None = None
                self._device: int | None = None  # bound at the first record (c10 createEvent)
                self._handle = 0
                self.captured = False
                fake.events_created += 1
                if threading.get_ident() == fake.train_thread:
                    fake.events_created_on_training_thread += 1

            @property
            def cuda_event(self) -> int:
                """The raw cudaEvent_t (0 until the first record creates it), for the driver API."""
                return self._handle

            def record(self, stream: Any = None) -> None:
                capture = fake.capture
                if capture is not None and capture["thread"] != threading.get_ident():
                    fake._unsafe("Event.record")
                if stream is None:
                    stream = fake.current_stream()
                if self._device is not None and stream.device_index != self._device:
                    raise RuntimeError(f"Event device {self._device} does not match recording stream's device "
                                       f"{stream.device_index}.")
                if self._device is None:
                    fake.touch(stream.device_index, "creating an event")
                    self._device = stream.device_index
                    self._handle = next(fake._next_handle)
                    fake._handles[self._handle] = self
                if fake.stream_is_captured(stream):
                    # A node of the user's graph: it is never stamped by the stream (CUDA stream capture).
                    fake.records_on_capturing_stream += 1
                    self.captured = True
                    return
                self.captured = False
                if self._marker is None:
                    self._marker = SimulatedMarker()
                fake.gpus[self._device].stamp(self._marker, stream=stream.key)
                if threading.get_ident() == fake.train_thread:
                    fake.gil_releases_on_training_thread += 1
                time.sleep(0)  # THCPEvent_record releases the GIL around cudaEventRecord

            def done(self) -> bool:
                if self.captured:
                    raise RuntimeError(_CAPTURED)
                return self._marker is None or fake.gpus[self._device].query(self._marker)

            def query(self) -> bool:
                if fake.capture is not None:
                    fake._unsafe("Event.query")
                fake.query_calls += 1
                fake._binding_call("Event.query")
                if self._device is not None:
                    fake._wait_for_sync(self._device, "Event.query", holds_gil=True)
                return self.done()

            def elapsed_ms(self, end: "Event") -> float:
                if self._marker is None and not self.captured or end._marker is None and not end.captured:
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                if not (self.enable_timing and end.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self._device != end._device:
                    raise RuntimeError("CUDA error: invalid resource handle (events of two devices)")
                if not (self.done() and end.done()):
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")
                return self.elapsed_between(end)

            def elapsed_between(self, end: "Event") -> float:
                """The float32 milliseconds between two completed events of one device (checked by the caller)."""
                gpu = fake.gpus[self._device]
                seconds = gpu.device_clock(end._marker.done_at) - gpu.device_clock(self._marker.done_at)
                return float32(seconds * 1000.0)

            def elapsed_time(self, end: "Event") -> float:
                fake._unsafe("Event.elapsed_time")
                fake._binding_call("Event.elapsed_time")
                fake._wait_for_sync(self._device, "Event.elapsed_time", holds_gil=True)
                return self.elapsed_ms(end)

            def synchronize(self) -> None:
                fake._unsafe("Event.synchronize")
                fake.event_synchronize_calls += 1
                fake.synchronize_threads.append(threading.current_thread().name)
                if self.captured:
                    raise RuntimeError(_CAPTURED)
                if self._marker is not None:
                    SimulatedWork(fake.gpus[self._device], 0.0, None, self._marker.done_at).block_until_ready()

        self.Event = Event

        def synchronize(device: Any = None) -> None:
            fake._unsafe("synchronize")
            fake.synchronize_threads.append(threading.current_thread().name)
            index = fake._index(device)
            fake.touch(index, "synchronize")
            with fake._synchronizing(index, fake._in_sync):
                fake.gpus[index].synchronize()  # time.sleep: the GIL is released while it waits

        def empty_cache() -> None:
            # cudaFree of the cached blocks synchronizes the device, under the allocator's mutex; the
            # binding releases the GIL meanwhile (measured).
            index = fake.current_device()
            with fake._synchronizing(index, fake._in_empty_cache), fake._synchronizing(index, fake._in_sync):
                fake.gpus[index].synchronize()
            fake.reserved[index] = fake.allocated[index]

        class device_guard:
            def __init__(self, device: Any):
                self.index = fake._index(device)

            def __enter__(self) -> None:
                self.previous = fake.current_device()
                fake.set_device(self.index)

            def __exit__(self, *exc: Any) -> None:
                fake.set_device(self.previous)

        class Properties:
            def __init__(self, index: int):
                self.name = fake.names[index]
                self.total_memory = fake.total_memory

        def nested_stats(device: Any = None) -> dict[str, Any]:
            index = fake._allocator_read(device, "memory_stats_as_nested_dict")
            if async_allocator:
                return {"allocated_bytes": {"all": {"current": 0, "peak": 0}},
                        "reserved_bytes": {"all": {"current": 0}}, "allocation": {"all": {"allocated": 0}}}
            return {"allocated_bytes": {"all": {"current": fake.allocated[index], "peak": fake.peak[index]}},
                    "reserved_bytes": {"all": {"current": fake.reserved[index]}},
                    "allocation": {"all": {"allocated": fake.allocations[index]}}}

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
        monkeypatch.setattr(cuda, "empty_cache", empty_cache)
        monkeypatch.setattr(cuda, "nvtx", nvtx)
        monkeypatch.setattr(cuda, "memory_allocated",
                            lambda device=None: fake.allocated[fake._allocator_read(device, "memory_allocated")])
        monkeypatch.setattr(cuda, "max_memory_allocated",
                            lambda device=None: fake.peak[fake._allocator_read(device, "max_memory_allocated")])
        monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", nested_stats)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
        monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: Properties(fake._index(device)))
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: fake.names[fake._index(device)])
        # The cheap per-unit path torch has in C (no Python Stream object per call).
        monkeypatch.setattr(torch._C, "_cuda_getDevice", self.current_device, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                            lambda index: id(self.current_stream(index)), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", self.is_current_stream_capturing,
                            raising=False)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: bool(fake.contexts[index]),
                            raising=False)
        self.driver = _FakeDriver(self) if driver else None
        from steptrace.adapters import torch as torch_adapter

        # raising=False: the adapter before issue 18 had no driver (the tests then show its failures).
        monkeypatch.setattr(torch_adapter, "_DRIVER", self.driver if driver else _NoDriver(), raising=False)
        # The adapter keeps per-process state (its thread's device, pooled scalar buffers): a new fake starts clean.
        for name in ("_OFF_THREAD", "_SCALARS"):
            state = getattr(torch_adapter, name, None)
            if state is not None:
                monkeypatch.setattr(torch_adapter, name, type(state)(), raising=False)

    # -- threads, devices, streams, contexts ------------------------------------------------
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # a new thread starts on device 0

    def set_device(self, device: Any) -> None:
        index = self._index(device)
        if index != self.current_device():  # c10 SetDevice calls cudaSetDevice only for a change
            self.touch(index, "cudaSetDevice")
        self._local.device = index

    def touch(self, index: int, why: str) -> None:
        """Something that needs device ``index``'s context ran: make it if there is none."""
        if not self.contexts[index]:
            self.contexts[index] = 1
            self.context_made_by[index] = f"{why} on {threading.current_thread().name}"

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
        """``torch.cuda.stream(s)``: make ``stream`` current on this thread for its device, and its device
        the current one (torch's ``_cuda_setStream`` sets the device of the stream)."""
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        previous = streams.get(stream.device_index)
        previous_device = self.current_device()
        streams[stream.device_index] = stream
        self.set_device(stream.device_index)
        try:
            yield stream
        finally:
            self.set_device(previous_device)
            if previous is None:
                del streams[stream.device_index]
            else:
                streams[stream.device_index] = previous

    def run(self, seconds: float, label: str | None = None, *, stream: Any = None,
            device: Any = None) -> SimulatedWork:
        """A kernel launch on ``stream`` (default: this thread's current stream of ``device``, itself by
        default the current device): ``seconds`` of device work, queued. Its output is allocated on that
        device (one allocation request; a segment is reserved on first use)."""
        stream = self.current_stream(device) if stream is None else stream
        index = stream.device_index
        self.touch(index, "a kernel")
        if self.capture is not None and self.stream_is_captured(stream):
            return SimulatedWork(self.gpus[index], 0.0, label, time.perf_counter())  # captured, not run
        self.allocations[index] += 1
        self.reserved[index] = max(self.reserved[index], SEGMENT_BYTES)
        work = self.gpus[index].run(seconds, label, stream=stream.key)
        if self.launches_release_gil:
            time.sleep(0)  # an op's binding releases the GIL around its dispatch (gil_scoped_release)
        return work

    def sync_copy(self, device: Any = None) -> None:
        """A synchronous copy on this thread's current stream of ``device`` (``loss.item()``, ``.cpu()``, a
        pageable ``.to("cuda")``): waits, the GIL released, for the work queued on the device, holding the
        driver's lock that ``cuEventRecord`` from other threads waits on (measured, see the module doc)."""
        index = self._index(device)
        self.touch(index, "a synchronous copy")
        with self._synchronizing(index, self._in_copy):
            left = self.gpus[index]._queue_until - time.perf_counter()
            if left > 0:
                time.sleep(left)

    def scalar(self, value: float, seconds: float = 0.0, *, device: Any = None) -> FakeCudaTensor:
        """A one-element CUDA tensor computed by a ``seconds`` kernel on ``device`` (its current stream)."""
        work = self.run(seconds, "scalar", device=device)
        return FakeCudaTensor(self._index(device), value, work, self)

    # -- graph capture --------------------------------------------------------------------------
    def is_current_stream_capturing(self) -> bool:
        capture = self.capture
        if capture is None:
            return self.capturing
        return capture["thread"] == threading.get_ident() and self.current_stream() is capture["stream"]

    def stream_is_captured(self, stream: Any) -> bool:
        capture = self.capture
        if capture is None:
            return self.capturing and stream is self.current_stream()
        return stream is capture["stream"]

    @contextlib.contextmanager
    def graph_capture(self, mode: str = "global", stream: Any = None) -> Iterator[dict[str, Any]]:
        """``with torch.cuda.graph(g, stream=stream, capture_error_mode=mode)``: capture on ``stream`` (a
        side stream by default) made current on this thread."""
        stream = self.Stream() if stream is None else stream
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

    # -- who waits, and with or without the GIL ---------------------------------------------------
    @contextlib.contextmanager
    def _synchronizing(self, index: int, table: dict[int, tuple[int, float]]) -> Iterator[None]:
        table[index] = (threading.get_ident(), self.gpus[index]._queue_until)
        try:
            yield
        finally:
            table.pop(index, None)

    def _binding_call(self, what: str) -> None:
        if threading.get_ident() != self.train_thread:
            self.binding_calls.append((threading.current_thread().name, what))

    def _wait_for_sync(self, index: int, what: str, *, holds_gil: bool, table: dict | None = None) -> None:
        """A call from another thread that must wait while a thread is inside a synchronizing call on
        ``index`` (``table``: which calls; by default only with ``driver_lock``)."""
        if table is None:
            if not self.driver_lock:
                return
            table = self._in_sync
        inside = table.get(index)
        if inside is None or inside[0] == threading.get_ident():
            return
        left = inside[1] - time.perf_counter()
        if left <= 0:
            return
        entry = (threading.current_thread().name, what, left)
        if holds_gil:
            self.gil_held_blocks.append(entry)
            hold_gil(left)  # pybind without gil_scoped_release: every other Python thread waits too
        else:
            self.gil_released_blocks.append(entry)
            time.sleep(left)

    def _allocator_read(self, device: Any, what: str) -> int:
        """The caching allocator's statistics: they take its mutex, holding the GIL (measured)."""
        index = self._index(device)
        self._binding_call(what)
        self._wait_for_sync(index, what, holds_gil=True, table=self._in_empty_cache)
        return index

    # -- memory ---------------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: Any = None) -> None:
        """The caching allocator books ``nbytes`` now, when the work is dispatched."""
        index = self._index(device)
        self.touch(index, "an allocation")
        self.allocations[index] += 1
        self.allocated[index] += nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])
        self.reserved[index] = max(self.reserved[index], self.allocated[index], SEGMENT_BYTES)

    def free(self, nbytes: int, device: Any = None) -> None:
        self.allocated[self._index(device)] -= nbytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        index = self._index(device)
        self.peak[index] = self.allocated[index]


class _FakeDriver:
    """The adapter's ``_DRIVER``: the driver API through ctypes.CDLL (the GIL released in every call), per
    host thread: capture mode, the thread's current context, streams and events by raw handle."""

    MODES = {0: "global", 1: "thread_local", 2: "relaxed"}

    def __init__(self, fake: FakeCuda):
        self.fake = fake
        self._ptrs = itertools.count(0x7F0000)
        self.exchanges: list[tuple[str, str]] = []
        #: (thread, call) of every event call made through the driver.
        self.calls: list[tuple[str, str]] = []
        #: (thread, "PyDLL" or "CDLL", whether the device had no work left) of every cuEventRecord.
        self.record_routes: list[tuple[str, str, bool]] = []
        self._local = threading.local()

    def exchange_capture_mode(self, mode: int) -> int:
        me = threading.get_ident()
        old = self.fake.thread_capture_mode.get(me, "global")
        self.fake.thread_capture_mode[me] = self.MODES[mode]
        self.exchanges.append((threading.current_thread().name, self.MODES[mode]))
        return {v: k for k, v in self.MODES.items()}[old]

    def use_device(self, device: int) -> None:
        """cuDevicePrimaryCtxRetain + cuCtxSetCurrent: makes the device's primary context if it has none."""
        self.fake.touch(device, "cuDevicePrimaryCtxRetain")
        self._local.device = device

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        return 0, -5

    def create_stream(self, priority: int, device: int) -> int:
        """A new non-blocking stream on ``device``, never a pool stream."""
        assert device == self.fake.current_device(), "the adapter sets the device before creating a stream"
        self.fake.touch(device, "cuStreamCreateWithPriority")
        self.fake.streams_created += 1
        return next(self._ptrs)

    def _event(self, handle: int, what: str) -> Any:
        self.calls.append((threading.current_thread().name, what))
        event = self.fake._handles.get(handle) if handle else None
        if event is None:
            raise OSError(f"{what} failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        self.fake._wait_for_sync(event._device, what, holds_gil=False)
        return event

    def event_query(self, handle: int) -> bool:
        event = self._event(handle, "cuEventQuery")
        if self.fake.capture is not None:
            self.fake._unsafe("cuEventQuery")
        if event.captured:
            raise OSError(f"cuEventQuery failed (CUresult {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED})")
        return event.done()

    def event_elapsed_ms(self, start: int, end: int) -> float:
        first, second = self._event(start, "cuEventElapsedTime"), self._event(end, "cuEventElapsedTime")
        if self.fake.capture is not None:
            self.fake._unsafe("cuEventElapsedTime")
        if first.captured or second.captured:
            raise OSError(f"cuEventElapsedTime failed (CUresult {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED})")
        if first._device != second._device or not (first.enable_timing and second.enable_timing):
            raise OSError(f"cuEventElapsedTime failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        if not (first.done() and second.done()):
            raise OSError(f"cuEventElapsedTime failed (CUresult {CUDA_ERROR_NOT_READY})")
        return first.elapsed_between(second)  # both checked above, as the driver checks them

    def _stream(self, handle: int) -> Any:
        return self.fake.streams_by_handle.get(handle)

    def load_keeping_gil(self) -> None:
        pass

    def record_keeping_gil(self, event: int, stream: int) -> int:
        """cuEventRecord through ctypes.PyDLL: a CUresult, the GIL kept (no other thread runs here)."""
        return self._record(event, stream, holds_gil=True)

    def record_releasing_gil(self, event: int, stream: int) -> int:
        """cuEventRecord through ctypes.CDLL: a CUresult, the GIL released while it waits."""
        return self._record(event, stream, holds_gil=False)

    def stream_idle_keeping_gil(self, stream: int) -> bool:
        """cuStreamQuery through ctypes.PyDLL: True when the stream has no work left (never waits on a
        synchronous copy, measured)."""
        self.calls.append((threading.current_thread().name, "cuStreamQuery"))
        target = self._stream(stream)
        if target is None:
            raise OSError(f"cuStreamQuery failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        return self.fake.gpus[target.device_index]._floor(target.key) <= time.perf_counter()

    def _record(self, event: int, stream: int, *, holds_gil: bool) -> int:
        fake, target = self.fake, self._stream(stream)
        marker = fake._handles.get(event) if event else None
        thread = threading.current_thread().name
        self.calls.append((thread, "cuEventRecord"))
        device_idle = marker is not None and fake.gpus[marker._device]._queue_until <= time.perf_counter()
        self.record_routes.append((thread, "PyDLL" if holds_gil else "CDLL", device_idle))
        if marker is not None:
            fake._wait_for_sync(marker._device, "cuEventRecord", holds_gil=holds_gil, table=fake._in_copy)
        if marker is None or target is None:
            return CUDA_ERROR_INVALID_HANDLE  # an event never created (0 until its first record), or no stream
        if marker._device != target.device_index:
            return CUDA_ERROR_INVALID_HANDLE  # an event and a stream of two devices (contexts)
        capture = fake.capture
        if capture is not None and capture["thread"] != threading.get_ident():
            fake._unsafe("cuEventRecord")
        if fake.stream_is_captured(target):
            fake.records_on_capturing_stream += 1
            marker.captured = True
            return 0
        marker.captured = False
        if marker._marker is None:
            marker._marker = SimulatedMarker()
        fake.gil_keeping_records += 1
        fake.gpus[marker._device].stamp(marker._marker, stream=target.key)
        return 0

    def query_keeping_gil(self, handle: int) -> bool:
        """cuEventQuery through ctypes.PyDLL (the anchor's spin): the GIL kept."""
        event = self.fake._handles.get(handle) if handle else None
        if event is None:
            raise OSError(f"cuEventQuery failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        if event.captured:
            raise OSError(f"cuEventQuery failed (CUresult {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED})")
        return event.done()

    def event_synchronize(self, handle: int) -> None:
        event = self._event(handle, "cuEventSynchronize")
        if event.captured:
            raise OSError(f"cuEventSynchronize failed (CUresult {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED})")
        if event._marker is not None:
            left = event._marker.done_at - time.perf_counter()
            if left > 0:
                self.fake.gil_released_blocks.append((threading.current_thread().name, "cuEventSynchronize", left))
                time.sleep(left)


class _NoDriver:
    """No libcuda: what the adapter sees on a machine where ctypes cannot load the driver."""

    def _missing(self, *args: Any) -> Any:
        raise OSError("libcuda.so.1: cannot open shared object file")

    exchange_capture_mode = use_device = stream_priority_range = create_stream = _missing
    event_query = event_elapsed_ms = event_synchronize = _missing
    record_keeping_gil = query_keeping_gil = load_keeping_gil = _missing
    record_releasing_gil = stream_idle_keeping_gil = _missing
