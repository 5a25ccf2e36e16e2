"""JAX on a CUDA GPU, for tests on machines without one: outputs that become ready on a simulated device
timeline, their DLPack export to a CUDA stream, and the CUDA driver calls steptrace makes for a JAX
step's device-clock end (``steptrace.adapters.jax.DeviceEnds``).

The rules it enforces, each with its source:

* a jitted call returns at once and its outputs are ready when the GPU has run the work queued before
  it and its own (JAX "Asynchronous dispatch"; one compute stream per device in XLA's GPU client);
* ``Array.is_ready()``, ``block_until_ready()`` and ``__dlpack__`` raise ``RuntimeError`` on a deleted
  (donated) array (jax ``ArrayImpl._check_if_deleted``: "Array has been deleted with shape=...");
* ``__dlpack__(stream=s)`` makes stream ``s`` wait for the array's definition and returns without
  waiting (jaxlib ``xla/python/dlpack.cc``, ``WaitUntilBufferReadyOnStream``; the DLPack Python
  specification's ``stream`` argument); without a stream it blocks the host until the array is ready
  (the same file: ``AwaitBuffersReady``); on a CPU array it raises ``UNIMPLEMENTED:
  WaitUntilBufferReadyOnStream is only implemented for GPU`` (measured: jax 0.11.2, H200); ``stream=0``
  is refused (DLPack spec: "0 is disallowed due to its ambiguity"); it takes a single device's buffer;
* the capsule holds an external reference to the buffer until it is freed, and a donation of a buffer
  with an external reference fails (PJRT ``PjRtStreamExecutorBuffer::AcquireDonation``: "Donation
  requested for buffer with external reference");
* driver calls act on the calling thread's current context, one per device (CUDA driver API, "Context
  Management": ``CUDA_ERROR_INVALID_CONTEXT`` with none current); an event records only on a stream of
  its own device (``cuEventRecord``: ``CUDA_ERROR_INVALID_HANDLE``); a stream runs its work in order, an
  event is stamped when its stream reaches it, on the device's clock, which is not the host's (an
  offset and a drift here); ``cuEventElapsedTime`` gives float32 milliseconds and fails with
  ``CUDA_ERROR_NOT_READY`` unless both events completed, and for events of two devices.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
from typing import Any, Iterator

CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_READY = 600

_perf = time.perf_counter


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class _Client:
    platform_version = "cuda 13000 (fake)"


class _CpuClient:
    platform_version = "<unknown>"


class FakeCudaDevice:
    """A ``jax.Device`` of a CUDA GPU: platform, CUDA ordinal, client."""

    platform = "gpu"
    client = _Client()

    def __init__(self, ordinal: int):
        self.id = self.local_hardware_id = ordinal

    def __repr__(self) -> str:
        return f"FakeCudaDevice(id={self.id})"


class FakeCpuDevice:
    platform = "cpu"
    client = _CpuClient()
    local_hardware_id = None
    id = 0


class _Shard:
    def __init__(self, device: Any, data: "FakeGpuArray"):
        self.device, self.data = device, data


class _Capsule:
    """A DLPack capsule: the buffer's external reference lives as long as it does."""

    def __init__(self, array: "FakeGpuArray"):
        self._array = array
        array.external_references += 1

    def __del__(self) -> None:
        self._array.external_references -= 1


class FakeGpuArray:
    """A ``jax.Array`` on one GPU (or sharded over several: ``shards``)."""

    def __init__(self, gpu: "FakeJaxGpu", devices: list[Any], ready_at: float,
                 shards: list["FakeGpuArray"] | None = None):
        self._gpu, self._devices, self.ready_at = gpu, devices, ready_at
        self._shards = shards
        self.deleted = False
        self.external_references = 0

    def _check_if_deleted(self) -> None:
        if self.deleted:
            raise RuntimeError("Array has been deleted with shape=float32[].")

    def devices(self) -> set[Any]:
        return set(self._devices)

    @property
    def addressable_shards(self) -> list[_Shard]:
        parts = self._shards or [self]
        return [_Shard(part._devices[0], part) for part in parts]

    def is_ready(self) -> bool:
        self._check_if_deleted()
        return _perf() >= self.ready_at

    def block_until_ready(self) -> "FakeGpuArray":
        self._check_if_deleted()
        left = self.ready_at - _perf()
        if left > 0:
            time.sleep(left)  # the GIL released, as jaxlib's wait does
        return self

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> _Capsule:
        self._check_if_deleted()
        if len(self._devices) != 1:
            raise BufferError("__dlpack__ only supports arrays on a single device")
        device = self._devices[0]
        if device.platform != "gpu":
            raise RuntimeError("UNIMPLEMENTED: WaitUntilBufferReadyOnStream is only implemented for GPU.")
        if stream is None:
            self.block_until_ready()
        elif stream == 0:
            raise BufferError("stream=0 is ambiguous and disallowed for CUDA (DLPack)")
        else:
            self._gpu.driver.stream_wait(int(stream), device.local_hardware_id, self.ready_at)
        self._gpu.exports.append(threading.current_thread().name)
        return _Capsule(self)


class FakeJaxGpu:
    """GPUs that run jitted steps asynchronously, each on its own compute stream."""

    def __init__(self, count: int = 1):
        self.devices = [FakeCudaDevice(i) for i in range(count)]
        self._busy_until = [0.0] * count
        self.driver = FakeCudaDriver(count)
        #: The thread of every DLPack export.
        self.exports: list[str] = []

    def run(self, seconds: float, device: int = 0) -> FakeGpuArray:
        """Dispatch ``seconds`` of work on GPU ``device``: returns its output at once."""
        ready = max(_perf(), self._busy_until[device]) + seconds
        self._busy_until[device] = ready
        return FakeGpuArray(self, [self.devices[device]], ready)

    def run_sharded(self, seconds: list[float]) -> FakeGpuArray:
        """One program over every GPU (SPMD): GPU i works ``seconds[i]``; the output is sharded."""
        shards = [self.run(s, device=i) for i, s in enumerate(seconds)]
        return FakeGpuArray(self, list(self.devices), max(s.ready_at for s in shards), shards=shards)

    def donate(self, array: FakeGpuArray) -> None:
        """The next step donates ``array`` (``donate_argnums``): refused while it is exported."""
        for part in array._shards or [array]:
            if part.external_references:
                raise RuntimeError("INVALID_ARGUMENT: Donation requested for buffer with external reference")
        array.deleted = True
        for part in array._shards or []:
            part.deleted = True


class _Stream:
    __slots__ = ("device", "floor")

    def __init__(self, device: int):
        self.device, self.floor = device, 0.0


class _Event:
    __slots__ = ("device", "stamp")

    def __init__(self, device: int):
        self.device = device
        self.stamp: float | None = None


class FakeCudaDriver:
    """``steptrace.adapters.torch._DRIVER`` as the JAX device-clock end uses it."""

    #: The device clock against the host's: a large offset and a 50 ppm drift.
    OFFSET_S = 1234.5
    DRIFT = 50e-6

    def __init__(self, count: int):
        self.count = count
        self._handles = itertools.count(0x7E0000, 16)
        self.streams: dict[int, _Stream] = {}
        self.events: dict[int, _Event] = {}
        self._local = threading.local()
        #: Set to an exception to make every driver call fail (a driver that cannot be used).
        self.broken: Exception | None = None
        #: (thread name, call) of every call.
        self.calls: list[tuple[str, str]] = []

    # the device's clock
    def device_time(self, host: float) -> float:
        return host * (1 + self.DRIFT) + self.OFFSET_S

    def _current(self, what: str) -> int:
        self.calls.append((threading.current_thread().name, what))
        if self.broken is not None:
            raise self.broken
        device = getattr(self._local, "device", None)
        if device is None:
            raise OSError(f"{what} failed (CUresult {CUDA_ERROR_INVALID_CONTEXT})")
        return device

    def use_device(self, device: int) -> None:
        if self.broken is not None:
            raise self.broken
        if not 0 <= device < self.count:
            raise OSError("cuDeviceGet failed (CUresult 101)")
        self._local.device = device

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        self._current("cuCtxGetStreamPriorityRange")
        return 0, -5

    def create_stream(self, priority: int, device: int) -> int:
        if self._current("cuStreamCreateWithPriority") != device:
            raise AssertionError("a stream is created on the thread's current device: use_device first")
        handle = next(self._handles)
        self.streams[handle] = _Stream(device)
        return handle

    def create_event(self, device: int) -> int:
        self.use_device(device)
        self._current("cuEventCreate")
        handle = next(self._handles)
        self.events[handle] = _Event(device)
        return handle

    def stream_wait(self, stream: int, device: int, host_ready: float) -> None:
        """What ``WaitUntilBufferReadyOnStream`` does: the stream's later work waits for the buffer."""
        target = self.streams.get(stream)
        if target is None or target.device != device:
            raise RuntimeError("INVALID_ARGUMENT: the stream is not a stream of the array's device")
        target.floor = max(target.floor, self.device_time(host_ready))

    def record_releasing_gil(self, event: int, stream: int) -> int:
        device = self._current("cuEventRecord")
        target, marker = self.streams.get(stream), self.events.get(event)
        if target is None or marker is None or target.device != marker.device:
            return CUDA_ERROR_INVALID_HANDLE
        if target.device != device:
            return CUDA_ERROR_INVALID_CONTEXT
        stamp = max(target.floor, self.device_time(_perf()))
        target.floor = marker.stamp = stamp
        return 0

    def event_query(self, handle: int) -> bool:
        self._current("cuEventQuery")
        marker = self.events.get(handle)
        if marker is None or marker.stamp is None:
            raise OSError(f"cuEventQuery failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        return self.device_time(_perf()) >= marker.stamp

    def event_elapsed_ms(self, start: int, end: int) -> float:
        self._current("cuEventElapsedTime")
        first, second = self.events.get(start), self.events.get(end)
        if first is None or second is None or first.device != second.device:
            raise OSError(f"cuEventElapsedTime failed (CUresult {CUDA_ERROR_INVALID_HANDLE})")
        now = self.device_time(_perf())
        if first.stamp is None or second.stamp is None or first.stamp > now or second.stamp > now:
            raise OSError(f"cuEventElapsedTime failed (CUresult {CUDA_ERROR_NOT_READY})")
        return _float32((second.stamp - first.stamp) * 1000.0)


@contextlib.contextmanager
def fake_jax_gpu(monkeypatch: Any, count: int = 1) -> Iterator[FakeJaxGpu]:
    """GPUs whose arrays steptrace classifies as JAX's, and the driver the JAX adapter uses."""
    from steptrace.adapters import jax as jax_adapter

    gpu = FakeJaxGpu(count)
    monkeypatch.setattr(jax_adapter, "_driver", lambda: gpu.driver)
    yield gpu


# steptrace decides the backend by the value's type module: these arrays are JAX's.
FakeGpuArray.__module__ = "jaxlib.fake_gpu"
