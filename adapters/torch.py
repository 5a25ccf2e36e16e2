"""PyTorch: CUDA-event step timing resolved off the training thread, profiler and NVTX ranges.

On CUDA, :class:`TorchCudaDevice` records ``torch.cuda.Event(enable_timing=True)``
markers on the current stream of the unit's GPU at the step's dispatch point
and at its exit; the resolver thread polls them, reads durations from the
device clock and places them on the host clock (``steptrace._clock``), with
its CUDA calls made capture-safe. The training thread never synchronises.

CPU torch operators run synchronously, so a CPU step is host-timed
(``backend: "host"``), also on a machine that has a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable


def require_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("steptrace's torch backend needs torch: pip install 'steptrace[torch]'") from exc
    return torch


# cudaStreamCaptureMode / CUstreamCaptureMode values (CUDA runtime and driver API).
_CAPTURE_MODE_THREAD_LOCAL = 1
# cudaStreamNonBlocking / CU_STREAM_NON_BLOCKING: no implicit synchronization with the legacy stream.
_STREAM_NON_BLOCKING = 1

log = logging.getLogger("steptrace")


class _Driver:
    """The two CUDA calls steptrace needs that torch (2.11-2.13) does not expose in Python, through ctypes
    on the driver library every CUDA process has loaded (``libcuda.so.1``; its state is the runtime's):

    * ``cuThreadExchangeStreamCaptureMode``: the resolver thread's capture mode, made thread-local so
      its ``query``/``elapsed_time``/``record`` can never invalidate another thread's global-mode
      capture (``torch.cuda.graph``'s default), as PyTorch's NCCL watchdog does (pytorch#148594);
    * ``cuStreamCreateWithPriority``: a stream of steptrace's own, non-blocking and of the highest
      priority, rather than one of the 32 pool streams ``torch.cuda.Stream()`` shares round robin
      with NCCL process groups and graph capture.
    """

    def __init__(self) -> None:
        self._lib: Any = None

    def _cuda(self) -> Any:
        if self._lib is None:
            self._lib = ctypes.CDLL("libcuda.so.1")
        return self._lib

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{what} failed (CUresult {rc})")

    def exchange_capture_mode(self, mode: int) -> int:
        value = ctypes.c_int(mode)
        self._check(self._cuda().cuThreadExchangeStreamCaptureMode(ctypes.byref(value)),
                    "cuThreadExchangeStreamCaptureMode")
        return value.value

    def _bind(self, device: int) -> None:
        # Driver calls act on the calling thread's current context: make it the device's primary
        # context (the one torch's runtime uses) if the thread has none yet.
        lib = self._cuda()
        current = ctypes.c_void_p()
        self._check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        handle, context = ctypes.c_int(), ctypes.c_void_p()
        self._check(lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
        self._check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        self._bind(device)
        least, greatest = ctypes.c_int(), ctypes.c_int()
        self._check(self._cuda().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                    "cuCtxGetStreamPriorityRange")
        return least.value, greatest.value

    def create_stream(self, priority: int, device: int) -> int:
        """A new stream on ``device`` (the calling thread's current device, set by the caller)."""
        self._bind(device)
        stream = ctypes.c_void_p()
        self._check(self._cuda().cuStreamCreateWithPriority(ctypes.byref(stream), _STREAM_NON_BLOCKING,
                                                            ctypes.c_int(priority)),
                    "cuStreamCreateWithPriority")
        return int(stream.value or 0)


_DRIVER: Any = _Driver()


class _OffThread(threading.local):
    """Per host thread: whether its capture mode was exchanged, and its current CUDA device."""

    capture_safe: bool | None = None  # None: not tried; False: could not be made safe
    device: int | None = None


_OFF_THREAD = _OffThread()


class _Placement:
    """A stream as the training thread records on it: the GPU it belongs to and torch's stream object.
    One per (GPU, stream), cached, so a unit costs no Python ``Stream`` object."""

    __slots__ = ("steptrace_device", "stream")

    def __init__(self, gpu: "TorchCudaGpu", stream: Any):
        self.steptrace_device = gpu  # the runtime times the unit on this GPU (see Runtime.start_markers)
        self.stream = stream


class TorchCudaDevice:
    """The torch CUDA backend: finds the GPU each unit runs on and hands it to that GPU's stream device.

    A unit's GPU is the current device of the training thread when its start marker is recorded
    (``torch.cuda.set_device`` before or after ``init()`` alike), or the device of the CUDA tensors
    given to ``wait_for`` when they live elsewhere (``model.to(rank)`` without ``set_device``): then
    a warning says so once and later units start on that GPU's current stream. Each GPU
    (:class:`TorchCudaGpu`) has its own event pool, its own anchor stream and its own clock.
    """

    name = "torch-cuda"
    uses_events = True

    def __init__(self) -> None:
        torch = self._torch = require_torch()
        if not torch.cuda.is_available():
            raise ValueError("backend='torch' with CUDA events needs a CUDA device; torch.cuda.is_available() is False")
        self._gpus: dict[int, TorchCudaGpu] = {}
        self._placements: dict[tuple[int, int], _Placement] = {}
        self._get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or \
            torch.cuda.is_current_stream_capturing
        #: The GPU the step's tensors were found on when it is not the current device (None: current).
        self.tensor_device: int | None = None
        self._warned_device = False

    def gpu(self, index: int) -> "TorchCudaGpu":
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = self._gpus[index] = TorchCudaGpu(self, index)
        return gpu

    def current_stream(self) -> Any:
        # Training thread, once per unit: three C calls and a cache hit (no Python Stream object).
        if self._capturing():
            return None
        index = self.tensor_device
        if index is None:
            index = self._get_device()
        raw = self._raw_stream
        if raw is not None:
            placement = self._placements.get((index, raw(index)))
            if placement is not None:
                return placement
        return self.placement(index)

    def placement(self, index: int) -> Any:
        """The training thread's current stream on GPU ``index``, or None while it is being captured
        (a marker recorded there would become part of the graph, or break the capture)."""
        if self._capturing():
            return None
        raw = self._raw_stream(index) if self._raw_stream is not None else None
        placement = self._placements.get((index, raw)) if raw is not None else None
        if placement is None:
            placement = _Placement(self.gpu(index), self._torch.cuda.current_stream(index))
            if raw is not None:
                self._placements[index, raw] = placement
        return placement

    def for_value(self, value: Any) -> Any:
        """The GPU a CUDA tensor given to ``wait_for`` lives on."""
        try:
            index = int(value.get_device())
        except Exception:
            index = -1
        if index < 0:
            return self.gpu(self._get_device())
        if self.tensor_device != index and index != self._get_device():
            if not self._warned_device:
                self._warned_device = True
                log.warning("steptrace: the step's CUDA tensors live on cuda:%d but the current device is "
                            "cuda:%d; timing cuda:%d. Call torch.cuda.set_device(local_rank) before training "
                            "to silence this.", index, self._get_device(), index)
            self.tensor_device = index
        return self.gpu(index)

    # Markers always belong to a GPU; the runtime records through the GPU of the stream.
    def record(self, stream: Any, marker: Any = None) -> Any:
        return stream.steptrace_device.record(stream, marker)

    def query(self, marker: Any) -> bool:
        return marker.steptrace_gpu.query(marker)

    def elapsed(self, start: Any, end: Any) -> float:
        return start.steptrace_gpu.elapsed(start, end)

    def release(self, marker: Any) -> None:
        marker.steptrace_gpu.release(marker)

    def clock_marker(self) -> Any:
        return self.gpu(self._get_device()).clock_marker()


class TorchCudaGpu:
    """One GPU as a stream device: pooled ``torch.cuda.Event`` markers on the training thread's stream.

    The training thread pays one ``cudaEventRecord`` per marker (events come from a pool the resolver
    refills, so steady state allocates nothing). Everything else runs on the resolver thread, with
    its capture mode made thread-local and its current device set to this GPU: ``query()`` (never
    ``synchronize()``), ``elapsed_time`` between two completed events of this GPU, and calibration
    anchors on a stream steptrace created itself (``steptrace._clock``).
    """

    name = "torch-cuda"
    uses_events = True

    def __init__(self, owner: TorchCudaDevice, index: int):
        self._owner = owner
        torch = self._torch = owner._torch
        self.index = index
        self.clock_name = f"torch-cuda:{index}"
        self._Event = torch.cuda.Event
        self._free: list[Any] = []  # pooled events; list.pop/append are atomic under the GIL
        self._anchor_stream: Any = None
        #: How the anchor stream was made: "own" (steptrace's), "pool" (fallback), None (not yet).
        self.anchor_stream_kind: str | None = None
        self._last: Any = None  # the newest marker the training thread recorded
        #: Events created so far (the pool's high-water mark).
        self.events_created = 0
        self._total_memory: int | None = None

    # -- training thread ---------------------------------------------------------------------
    def current_stream(self) -> Any:
        return self._owner.placement(self.index)

    def record(self, stream: Any, marker: Any = None) -> Any:
        if stream is None:  # a unit without a start marker: this GPU's current stream, if not captured
            stream = self.current_stream()
            if stream is None:
                raise RuntimeError("the current stream is being captured into a CUDA graph")
        if marker is None:
            marker = self._take_event()
        marker.record(stream.stream)
        self._last = marker
        return marker

    # -- resolver thread -----------------------------------------------------------------------
    def _off_thread(self) -> None:
        """Make the calling (resolver) thread safe for CUDA calls: thread-local capture mode, this GPU."""
        state = _OFF_THREAD
        if state.capture_safe is None:
            try:
                _DRIVER.exchange_capture_mode(_CAPTURE_MODE_THREAD_LOCAL)
                state.capture_safe = True
            except Exception as exc:
                state.capture_safe = False
                log.warning("steptrace could not make its thread's CUDA calls capture-safe (%r): a CUDA graph "
                            "captured in 'global' mode (torch.cuda.graph's default) while steps are pending may "
                            "fail. Capture with capture_error_mode='thread_local' to be safe.", exc)
        if state.device != self.index:
            self._torch.cuda.set_device(self.index)  # the current device is per host thread
            state.device = self.index

    def query(self, marker: Any) -> bool:
        self._off_thread()
        return marker.query()

    def elapsed(self, start: Any, end: Any) -> float:
        self._off_thread()
        return start.elapsed_time(end) / 1000.0  # milliseconds on the device clock

    def release(self, marker: Any) -> None:
        self._free.append(marker)

    def drained(self) -> bool:
        """True when the newest marker the training thread recorded has completed (the GPU is idle)."""
        last = self._last
        if last is None:
            return True
        self._off_thread()
        return bool(last.query())

    def clock_marker(self) -> Any:
        self._off_thread()
        if self._anchor_stream is None:
            self._anchor_stream = self._make_anchor_stream()
        return self._record_anchor()

    def _take_event(self) -> Any:
        """A timing event from the pool (list.pop is atomic under the GIL), or a new one."""
        try:
            return self._free.pop()
        except IndexError:
            marker = self._Event(enable_timing=True)
            marker.steptrace_gpu = self
            self.events_created += 1
            return marker

    def _record_anchor(self) -> Any:
        marker = self._take_event()
        marker.record(self._anchor_stream)  # not self._last: the training thread's work is not behind it
        return marker

    def _make_anchor_stream(self) -> Any:
        """A non-blocking, highest-priority stream of steptrace's own on this GPU (never a pool stream:
        those are shared round robin with NCCL and graph capture). Without the driver: the
        highest-priority pool stream, said once."""
        cuda = self._torch.cuda
        try:
            _least, greatest = _DRIVER.stream_priority_range(self.index)
            pointer = _DRIVER.create_stream(greatest, self.index)
            stream = cuda.ExternalStream(pointer, device=self.index)
            self.anchor_stream_kind = "own"
            return stream
        except Exception as exc:
            log.warning("steptrace could not create a CUDA stream of its own (%r); calibration uses a "
                        "high-priority pool stream, which NCCL may share", exc)
            self.anchor_stream_kind = "pool"
            return cuda.Stream(device=self.index, priority=-1)

    def memory_stats(self) -> dict[str, int] | None:
        """This GPU's memory: in use now, the peak since the process started (or since the program's own
        last ``reset_peak_memory_stats``; steptrace never resets it: Megatron's report_memory and
        Lightning's DeviceStatsMonitor read the same counter), and the GPU's total memory."""
        cuda = self._torch.cuda
        index = self.index
        try:
            memory = {"in_use_bytes": int(cuda.memory_allocated(index)),
                      "peak_bytes": int(cuda.max_memory_allocated(index))}
            if self._total_memory is None:
                self._total_memory = int(cuda.get_device_properties(index).total_memory)
            memory["limit_bytes"] = self._total_memory
        except Exception:
            return None
        return memory


def scalar_reader(value: Any) -> Any:
    """A logged torch scalar: a CPU tensor is read now (it is computed); a CUDA tensor's copy to
    pinned host memory is queued on the current stream now and read by the resolver after the
    step, behind an event recorded after the copy (so nothing waits on the training thread)."""
    try:
        if value.numel() != 1:
            return None
        if not value.is_cuda:
            return float(value.detach().reshape(()))
        torch = require_torch()
        host = value.detach().reshape(()).to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    except Exception:
        return None

    def read() -> float:
        copied.synchronize()  # already complete once the step has ended on the device
        return float(host)

    return read


class StepFlopCounter:
    """Hardware FLOPs of a ``flops="auto"`` step from ``torch.utils.flop_counter.FlopCounterMode``.

    The counter intercepts every operator in Python, so it runs over one step only: the second
    auto step (the first runs one-time work: lazy initialisation, autotuning). Its count (the
    operators torch has formulas for: matrix multiplies, convolutions, attention; recomputed
    activations counted again) is every later step's. The counted step itself runs slower by
    the counter's overhead. A count of zero (the step ran no torch operators: JAX) is no count.
    """

    source = "torch_flop_counter"
    COUNTED_STEP = 2  # the n-th auto step is counted

    def __init__(self) -> None:
        self.seen = 0
        self.flops: float | None = None
        self._mode: Any = None

    def enter(self, step: Any) -> None:
        self.seen += 1
        if self.seen != self.COUNTED_STEP:
            return
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def exit(self, step: Any) -> float | None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            total = mode.get_total_flops()
            if total > 0:
                self.flops = float(total)
        return self.flops


class _Ranges:
    """Exits what :func:`step_annotator` opened."""

    __slots__ = ("_record_function", "_nvtx")

    def __init__(self, record_function: Any, nvtx: Any):
        self._record_function = record_function
        self._nvtx = nvtx

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._nvtx is not None:
            self._nvtx.range_pop()
        if self._record_function is not None:
            self._record_function.__exit__(exc_type, exc, tb)


def step_annotator() -> Callable[[int], Any]:
    """Build the per-step annotator: ``torch.profiler.record_function`` while the torch profiler
    runs (it costs ~10 µs per step otherwise, measured here) and an NVTX range where CUDA is
    available (Nsight Systems shows steps by number)."""
    torch = require_torch()
    profiler_enabled = torch.autograd._profiler_enabled
    try:
        nvtx = torch.cuda.nvtx if torch.cuda.is_available() else None
        if nvtx is not None:  # probe once: a build without NVTX raises here, never inside a step
            nvtx.range_push("steptrace")
            nvtx.range_pop()
    except Exception:
        nvtx = None

    def annotate(n: int) -> Any:
        record = None
        if profiler_enabled():
            record = torch.profiler.record_function(f"steptrace.step.{n}")
            record.__enter__()
        if nvtx is not None:
            nvtx.range_push(f"step {n}")
        if record is None and nvtx is None:
            return None
        return _Ranges(record, nvtx)

    return annotate
