"""PyTorch: CUDA-event step timing resolved off the training thread, profiler and NVTX ranges.

On CUDA, :class:`TorchCudaDevice` records ``torch.cuda.Event(enable_timing=True)``
markers on the current stream of the GPU the rank's work runs on, at the step's
dispatch point and at its exit; the resolver thread polls them, reads durations
from the device clock and places them on the host clock (``steptrace._clock``),
with its CUDA calls made capture-safe and, through the driver API, without
holding the GIL. The training thread never synchronises.

CPU torch operators run synchronously, so a CPU step is host-timed
(``backend: "host"``), also on a machine that has a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
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
# CUresult values (cuda.h).
_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600
#: The training thread reads a GPU's allocator statistics at most this often (seconds). They are read
#: there, at a marker, because the allocator's mutex is taken holding the GIL: read from another thread
#: while the training thread is inside ``empty_cache`` (or any allocator call that synchronises), they
#: froze every Python thread for the whole call (759 ms measured on an H200, issue 32).
MEMORY_SAMPLE_EVERY_S = 1.0
#: Step entries after a GPU was chosen during which the choice is checked against where allocations
#: happen (the allocators' request counters, read on the training thread).
_CHECK_UNITS = 3
#: In ``TorchCudaDevice._timed``: no GPU is timed while this device is current (looked at again after
#: ``_NO_GPU_RETRY_S``: nothing said where the work is, and the current device has no context).
_NO_GPU = -1
_NO_GPU_RETRY_S = 1.0

log = logging.getLogger("steptrace")
_perf = time.perf_counter


class _Driver:
    """The CUDA calls steptrace makes through ctypes on the driver library every CUDA process has loaded
    (``libcuda.so.1``; its state is the runtime's). ``ctypes.CDLL`` releases the GIL for every call, so
    a call that waits in the driver (behind another thread's synchronising call) never freezes the
    process's other Python threads, as torch's bindings of ``Event.query``/``elapsed_time`` (which do
    not release it: ``torch/csrc/cuda/Event.cpp``) would:

    * ``cuThreadExchangeStreamCaptureMode``: the resolver thread's capture mode, made thread-local so
      its calls can never invalidate another thread's global-mode capture (``torch.cuda.graph``'s
      default), as PyTorch's NCCL watchdog does (pytorch#148594);
    * ``cuStreamCreateWithPriority``: a stream of steptrace's own, non-blocking and of the highest
      priority, rather than one of the 32 pool streams ``torch.cuda.Stream()`` shares round robin
      with NCCL process groups and graph capture;
    * ``cuEventQuery``, ``cuEventElapsedTime``, ``cuEventSynchronize`` on torch's events
      (``Event.cuda_event``): measured on an H200 to return exactly what torch's calls return
      (600 = CUDA_ERROR_NOT_READY while busy, from a thread with no current context).
    """

    def __init__(self) -> None:
        self._lib: Any = None
        self._contexts: dict[int, Any] = {}  # device -> its retained primary context
        self._tls = threading.local()
        self._elapsed: Any = None
        self._gil_lib: Any = None  # the same library through ctypes.PyDLL (calls keep the GIL)

    def _cuda(self) -> Any:
        if self._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuEventQuery", "cuEventSynchronize"):
                function = getattr(lib, name)
                function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
            lib.cuEventRecord.argtypes, lib.cuEventRecord.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
            # The _v2 symbol (CUDA 12.8+) where the unsuffixed one is gone; both measured equal.
            elapsed = getattr(lib, "cuEventElapsedTime", None) or lib.cuEventElapsedTime_v2
            elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
            elapsed.restype = ctypes.c_int
            self._elapsed = elapsed
            self._lib = lib
        return self._lib

    def _check(self, rc: int, what: str) -> None:
        if rc != _CUDA_SUCCESS:
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
        self.use_device(device)

    def use_device(self, device: int) -> None:
        """Make ``device``'s primary context current on the calling thread (retained once per device; only
        ever asked for a GPU the rank already uses, whose context exists)."""
        if getattr(self._tls, "device", None) == device:
            return
        lib = self._cuda()
        context = self._contexts.get(device)
        if context is None:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            self._check(lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
            self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = context
        self._check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self._tls.device = device

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

    def event_query(self, handle: int) -> bool:
        """True once the event has completed (``cuEventQuery``; never blocks on the device)."""
        rc = self._cuda().cuEventQuery(ctypes.c_void_p(handle))
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds from ``start`` to ``end``, both complete (float32, as ``cudaEventElapsedTime``)."""
        self._cuda()
        value = ctypes.c_float()
        self._check(self._elapsed(ctypes.byref(value), ctypes.c_void_p(start), ctypes.c_void_p(end)),
                    "cuEventElapsedTime")
        return float(value.value)

    def create_event(self, device: int) -> int:
        """A new timing event on ``device`` (``cuEventCreate`` with ``CU_EVENT_DEFAULT``: timing on)."""
        self.use_device(device)
        event = ctypes.c_void_p()
        self._check(self._cuda().cuEventCreate(ctypes.byref(event), ctypes.c_uint(0)), "cuEventCreate")
        return int(event.value or 0)

    def event_synchronize(self, handle: int) -> None:
        self._check(self._cuda().cuEventSynchronize(ctypes.c_void_p(handle)), "cuEventSynchronize")

    def record_releasing_gil(self, event: int, stream: int) -> int:
        """``cuEventRecord(event, stream)`` through ``ctypes.CDLL``, which releases the GIL; a CUresult.

        For the resolver's calibration anchors. ``cuEventRecord`` waits while another thread is inside a
        synchronous copy (measured on an H200, driver 580.159.04: 769-820 ms from a second thread while
        the training thread was in ``.item()``, ``.cpu()`` or a pageable ``.to("cuda")`` behind a 1 s
        kernel; ``cuEventQuery``, ``cuStreamQuery`` and ``cuEventElapsedTime`` waited at most 1.7 ms,
        and nothing waited during ``torch.cuda.synchronize``). Through ``PyDLL`` that wait held the GIL
        and froze every Python thread, the stall watch included, for the rest of the copy (1.6 s seen).
        The anchor's bracket does not need the GIL kept across the record: its lower bound is the last
        query that saw it incomplete."""
        return self._cuda().cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def stream_idle_keeping_gil(self, stream: int) -> bool:
        """``cuStreamQuery`` through ``PyDLL``: True when ``stream`` has no work left. It did not wait
        while another thread was inside a synchronous copy (at most 0.06 ms, measured)."""
        rc = self._keeping_gil().cuStreamQuery(stream)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuStreamQuery")
        return True

    def load_keeping_gil(self) -> None:
        self._keeping_gil()

    def _keeping_gil(self) -> Any:
        lib = self._gil_lib
        if lib is None:
            lib = ctypes.PyDLL("libcuda.so.1")
            lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuEventRecord.restype = ctypes.c_int
            lib.cuEventQuery.argtypes = [ctypes.c_void_p]
            lib.cuEventQuery.restype = ctypes.c_int
            lib.cuStreamQuery.argtypes = [ctypes.c_void_p]
            lib.cuStreamQuery.restype = ctypes.c_int
            self._gil_lib = lib
        return lib

    def record_keeping_gil(self, event: int, stream: int) -> int:
        """``cuEventRecord(event, stream)`` through ``ctypes.PyDLL``, which keeps the GIL; a CUresult.

        torch's ``Event.record`` releases the GIL around ``cudaEventRecord`` (on an H200, torch 2.11, a
        sleeping thread woke 263 times in 0.2 s of back-to-back calls; never for ``query``). A thread
        waiting for the GIL (the resolver after a GIL-holding call) then ran between a step's start
        marker and its first kernel while the GPU was idle, and that idle time became the step's compute
        (+0.24 to 1.4 ms on 10 ms steps after a 30 ms ``sorted()``), and an anchor's first query came
        3 ms after its record (never placed). Recorded here, nothing runs in between."""
        return self._keeping_gil().cuEventRecord(event, stream)

    def query_keeping_gil(self, handle: int) -> bool:
        """``cuEventQuery`` keeping the GIL: the anchor's spin, whose bracket must hold no other thread."""
        rc = self._keeping_gil().cuEventQuery(handle)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True


_DRIVER: Any = _Driver()


def cuda_driver() -> Any:
    """The CUDA driver API through ctypes (``libcuda.so.1``), shared by every adapter that needs it: the
    JAX adapter's device-clock ends use it without torch (nothing here imports torch)."""
    return _DRIVER
#: Events each GPU's pool starts with, made at its first marker (before it): creating one later, on the
#: training thread, records it through torch, which releases the GIL right before the marker it is for.
_POOL_RESERVE = 64
#: Free events below which the resolver makes more (``TorchCudaGpu.replenish``), whatever is in flight.
_POOL_LOW = 16


def _driver_loads() -> bool:
    try:
        _DRIVER.load_keeping_gil()
        return True
    except Exception as exc:
        log.warning("steptrace could not load cuEventRecord from the CUDA driver (%r): markers are recorded "
                    "with torch's Event.record, which lets another thread run between a step's start marker "
                    "and its first kernel", exc)
        return False


class _OffThread(threading.local):
    """Per host thread other than the training thread: whether its capture mode was exchanged, its current
    CUDA device, and whether its event calls go through the driver (the GIL released)."""

    capture_safe: bool | None = None  # None: not tried; False: could not be made safe
    device: int | None = None
    driver: bool | None = None  # None: not tried


_OFF_THREAD = _OffThread()
_warned_driver = False


def _off_thread(torch: Any, index: int) -> _OffThread:
    """Make the calling (resolver) thread safe for CUDA calls on GPU ``index``: thread-local capture mode,
    ``index`` its current device, for the runtime (torch's calls) and for the driver."""
    global _warned_driver
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
    if state.device != index:
        torch.cuda.set_device(index)  # the current device is per host thread
        state.device = index
        if state.driver is not False:
            try:
                _DRIVER.use_device(index)
                state.driver = True
            except Exception as exc:
                state.driver = False
                if not _warned_driver:
                    _warned_driver = True
                    log.warning("steptrace could not use the CUDA driver library (%r): its background thread "
                                "queries events through torch, which holds the GIL while a call waits", exc)
    return state


def nvml_uuid(index: int) -> str | None:
    """The NVML UUID (``GPU-<uuid>``) of CUDA device ``index`` as this process numbers it, or None.

    CUDA_VISIBLE_DEVICES renumbers devices for CUDA but not for NVML, which numbers every GPU on the
    node: the sampler finds the GPU by UUID, never by index. torch reports the UUID CUDA gives
    (``cudaDeviceProp.uuid``, ``torch.cuda.get_device_properties(i).uuid``); NVML spells the same
    bytes with a ``GPU-`` prefix (nvmlDeviceGetUUID; the ``nvidia-smi -L`` form)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _event_done(event: Any) -> bool:
    """Whether ``event`` has completed (an off-training thread prepared by ``_off_thread``)."""
    handle = event.cuda_event if _OFF_THREAD.driver else 0
    if handle:
        return _DRIVER.event_query(handle)
    return bool(event.query())


def _event_wait(event: Any) -> None:
    """Wait for ``event`` with the GIL released (``cuEventSynchronize``; torch's ``synchronize`` releases it too)."""
    handle = event.cuda_event if _OFF_THREAD.driver else 0
    if handle:
        _DRIVER.event_synchronize(handle)
    else:
        event.synchronize()


class _Placement:
    """A stream as the training thread records on it: the GPU it belongs to and torch's stream object.
    One per (GPU, stream), cached, so a unit costs no Python ``Stream`` object."""

    __slots__ = ("steptrace_device", "stream", "handle")

    def __init__(self, gpu: "TorchCudaGpu", stream: Any):
        self.steptrace_device = gpu  # the runtime times the unit on this GPU (see Runtime.start_markers)
        self.stream = stream
        self.handle = int(stream.cuda_stream)  # the raw cudaStream_t, for the driver's record


class TorchCudaDevice:
    """The torch CUDA backend: finds the GPU each unit runs on and hands it to that GPU's stream device.

    Work follows the tensors' device, not the current device, and recording an event on a GPU makes
    that GPU's CUDA context (hundreds of MB), so a unit's GPU is chosen without touching any other
    (training thread, :meth:`current_stream`):

    * the GPU of the CUDA tensors given to ``wait_for`` once they said it;
    * else the training thread's current device when this process's allocator holds memory there
      (``torch.cuda.set_device`` before or after ``init()`` alike);
    * else the GPU whose allocator holds memory (``model.to(rank)`` without ``set_device``: the
      current device is 0, which the rank never used); of several, ``LOCAL_RANK``'s, else the
      largest. A warning names it once with the fix, ``torch.cuda.set_device(local_rank)``;
    * for the first steps after that choice, the allocators' request counters check it: when the
      chosen GPU saw no allocation between two step entries while exactly one other did, the steps
      are timed there from then on (warned once);
    * where no allocator holds memory (nothing allocated yet, or ``cudaMallocAsync``, whose counters
      read zero), the GPUs with a CUDA context the same way (the process made one only where it did
      something); with nothing to go on, the current device if it has a context (checked like a
      choice), else the unit is host-timed and the question asked again a second later: never an
      idle GPU that would need a new context.

    Each GPU (:class:`TorchCudaGpu`) has its own event pool, its own anchor stream and its own clock.
    """

    name = "torch-cuda"
    uses_events = True
    #: The compiled hot path (steptrace/_hotpath.c) records this device's start markers itself in the steady
    #: state :meth:`start_unit` describes, reading the same fields (``_capturing``, ``_get_device``,
    #: ``tensor_device``, ``_timed``, ``_checks_left``, ``_raw_stream``, ``_placements``); everything else
    #: goes to :meth:`start_unit`. Keep the two in step (tests/test_cuda_cost.py compares them).
    compiled_markers = "device"

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
        self._has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        #: The GPU the step's tensors were found on (wait_for), when they said one (None: not yet).
        self.tensor_device: int | None = None
        #: current device -> the GPU units are timed on while it is current
        self._timed: dict[int, int] = {}
        self._checks_left = 0
        self._usage_before: list[tuple[int, int]] | None = None
        self._retry_at = 0.0
        self._warned_device = False
        # The placement current_stream() just returned after checking the capture status: recording on
        # it next (the start marker, at once) needs no second check.
        self.checked: Any = None
        try:
            self._device_count = int(torch.cuda.device_count())
        except Exception:
            self._device_count = 1
        try:
            self._local_rank: int | None = int(os.environ["LOCAL_RANK"])
        except (KeyError, ValueError):
            self._local_rank = None

    def gpu(self, index: int) -> "TorchCudaGpu":
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = self._gpus[index] = TorchCudaGpu(self, index)
        return gpu

    def current_stream(self) -> Any:
        # Training thread, once per step: three C calls, two cache hits (no Python Stream object) and
        # a clock read (the allocator is sampled at most once a second, here, at a step's entry).
        if self._capturing():
            return None
        index = self.tensor_device
        if index is None:
            current = self._get_device()
            index = self._timed.get(current)
            if index is None or self._checks_left or index == _NO_GPU and _perf() >= self._retry_at:
                index = self._choose(current, None if index == _NO_GPU else index)
            if index is None or index < 0:
                return None
        raw = self._raw_stream
        placement = self._placements.get((index, raw(index))) if raw is not None else None
        if placement is None:
            placement = self.placement(index)
            if placement is None:
                return None
        gpu = placement.steptrace_device
        now = _perf()
        if now >= gpu.memory_due:
            gpu.memory_due = now + MEMORY_SAMPLE_EVERY_S
            gpu.sample_memory()
        self.checked = placement
        return placement

    def start_unit(self, unit: Any, rt: Any) -> None:
        """A step's start marker in one call (training thread; the compiled entry calls it): what
        ``Runtime.start_markers`` does through :meth:`current_stream` and ``TorchCudaGpu.record``, inline
        for the steady state (the GPU chosen, its stream seen before, its allocator not due, an event in
        the pool, the driver's record); anything else goes the general way, before any side effect."""
        try:
            if self._capturing():
                return  # a graph capture is in progress: no marker may go on this stream
            current = self._get_device()
            index = self.tensor_device
            if index is None:
                index = self._timed.get(current)
                if index is None or index < 0 or self._checks_left:
                    rt.start_markers(unit, self)  # the GPU is still being chosen (or none is timed)
                    return
            raw = self._raw_stream
            placement = self._placements.get((index, raw(index))) if raw is not None else None
            if placement is None or current != index:
                rt.start_markers(unit, self)  # a stream not seen yet, or torch's record (it sets the device)
                return
            gpu = placement.steptrace_device
            free, record_raw = gpu._free, gpu._record_raw
            if not free or record_raw is None or _perf() >= gpu.memory_due:
                rt.start_markers(unit, self)  # the pool's first events, no driver, or the allocator's sample
                return
            marker = free.pop()
            stream = placement.handle
            rc = record_raw(marker.steptrace_handle, stream)
            if rc:  # (the event is not given back: it may be the one that is broken)
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        except Exception as exc:  # a broken backend must not kill training
            rt.device_failed(exc)
            return
        gpu._last = marker
        gpu._last_stream_handle = stream
        unit.start_event = marker
        unit.device = gpu
        unit.stream = placement
        unit.start_recorded_after = unit.host_start

    def timed_index(self) -> int | None:
        """The GPU a unit starting now would be timed on (training thread), or None when none is known."""
        if self.tensor_device is not None:
            return self.tensor_device
        current = self._get_device()
        index = self._timed.get(current)
        if index is None:
            index = self._choose(current, None)
        return None if index is None or index < 0 else index

    # -- which GPU (training thread) -------------------------------------------------------------
    def _usage(self) -> list[tuple[int, int]]:
        """Per GPU, (bytes this process's caching allocator reserved, allocation requests so far): read
        from the allocator's counters, which make no CUDA context. Empty when they cannot be read."""
        stats = getattr(self._torch.cuda, "memory_stats_as_nested_dict", None)
        if stats is None:
            return []
        usage = []
        try:
            for i in range(self._device_count):
                nested = stats(i)
                usage.append((int(nested["reserved_bytes"]["all"]["current"]),
                              int(nested["allocation"]["all"]["allocated"])))
        except Exception:
            return []
        return usage

    def _choose(self, current: int, chosen: int | None) -> int | None:
        if self._device_count < 2:
            self._timed[current] = current
            return current
        usage = self._usage()
        if not usage:
            self._timed[current] = current  # cannot tell: the current device, as torch says
            return current
        if chosen is None:
            chosen = self._first_choice(current, usage)
            if chosen is None:
                # Nothing says where the work is: the current device if the rank touched it, never a new
                # context for a marker, nor an idle GPU; asked again in a second.
                has_context = self._has_context
                if has_context is not None and not has_context(current):
                    self._timed[current] = _NO_GPU
                    self._retry_at = _perf() + _NO_GPU_RETRY_S
                    return _NO_GPU
                chosen = current
            self._timed[current] = chosen
            self._checks_left, self._usage_before = _CHECK_UNITS, usage
            return chosen
        # The first steps after the choice: did the chosen GPU see work while another one did?
        before, self._usage_before = self._usage_before or usage, usage
        self._checks_left -= 1
        grew = [i for i, (_, requests) in enumerate(usage) if requests > before[i][1]]
        if grew and chosen not in grew:
            other = self._prefer(grew, usage)
            self._warn_device(current, other, f"its allocations since the last step were on cuda:{other}, "
                                              f"none on cuda:{chosen}")
            self._timed[current] = chosen = other
            self._checks_left = 0
        return chosen

    def _first_choice(self, current: int, usage: list[tuple[int, int]]) -> int | None:
        if usage[current][0] > 0:
            return current
        used = [i for i, (reserved, _) in enumerate(usage) if reserved > 0]
        what = "its memory is on"
        if not used and self._has_context is not None:
            # The allocator says nothing (cudaMallocAsync reads zero): where has the process a context?
            used = [i for i in range(self._device_count) if self._has_context(i)]
            what = "it has a CUDA context only on"
            if current in used and (len(used) == 1 or self._local_rank not in used):
                return current
        if not used:
            return None
        chosen = self._prefer(used, usage)
        self._warn_device(current, chosen, f"{what} {', '.join(f'cuda:{i}' for i in used)}")
        return chosen

    def _prefer(self, candidates: list[int], usage: list[tuple[int, int]]) -> int:
        if len(candidates) == 1:
            return candidates[0]
        if self._local_rank in candidates:
            return self._local_rank  # type: ignore[return-value]
        return max(candidates, key=lambda i: usage[i][0])

    def _warn_device(self, current: int, chosen: int, why: str) -> None:
        if self._warned_device:
            return
        self._warned_device = True
        log.warning("steptrace: this rank's current CUDA device is cuda:%d but %s; timing cuda:%d. Call "
                    "torch.cuda.set_device(local_rank) before creating the model, so that steptrace, NCCL and "
                    "torch.cuda calls without a device all use the rank's GPU.", current, why, chosen)

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
        self.checked = placement
        return placement

    def for_value(self, value: Any) -> Any:
        """The GPU a CUDA tensor given to ``wait_for`` lives on (from then on, units start there)."""
        try:
            index = int(value.get_device())
        except Exception:
            index = -1
        if index < 0:
            return self.gpu(self._get_device())
        if self.tensor_device != index:
            current = self._get_device()
            if index != current and self._timed.get(current) != index:
                self._warn_device(current, index, f"the step's CUDA tensors live on cuda:{index}")
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
        index = self.tensor_device
        if index is None:
            index = next(iter(self._timed.values()), None)
        if index is None:
            raise LookupError("no GPU has been timed yet")  # never the resolver's own current device
        return self.gpu(index).clock_marker()


class TorchCudaGpu:
    """One GPU as a stream device: pooled ``torch.cuda.Event`` markers on the training thread's stream.

    The training thread pays one ``cudaEventRecord`` per marker (events come from a pool the resolver
    refills, so steady state allocates nothing), a capture-status check for markers recorded on a
    stream it did not just look up (end and span markers), and, at most once a second at a step's
    entry, a read of this GPU's allocator statistics (``memory_stats``). Everything else runs on the
    resolver thread, with its capture mode made thread-local and its current device (runtime and
    driver) set to this GPU: ``query`` (never ``synchronize()``) and ``elapsed_time`` between two
    completed events of this GPU, through the driver API (``ctypes.CDLL`` releases the GIL) where
    libcuda loads, and calibration anchors on a stream steptrace created itself (``steptrace._clock``).
    """

    name = "torch-cuda"
    uses_events = True
    #: As TorchCudaDevice's: the compiled hot path records the steady state of :meth:`start_unit`,
    #: :meth:`end_unit` and :meth:`span_marker` itself, reading ``_owner``, ``index``, ``_free``,
    #: ``_record_raw`` and the placement's ``handle``, and setting ``_last`` and ``_last_stream_handle``.
    compiled_markers = "gpu"

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
        #: Times the resolver topped the pool up (``replenish``).
        self.events_replenished = 0
        self._total_memory: int | None = None
        #: The newest allocator sample (training thread): in use and peak bytes; replaced, never mutated.
        self.memory_sample: dict[str, int] | None = None
        self._anchor_stream_handle = 0
        self._last_stream_handle: int | None = None  # the stream of the newest marker (training thread)
        # Markers are recorded through the driver keeping the GIL (see _Driver.record_keeping_gil);
        # None: no driver here, torch's record.
        self._record_raw: Any = None
        if _driver_loads():
            self._record_raw = _DRIVER.record_keeping_gil
        #: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting): every stream shares one hardware queue, so an
        #: anchor recorded while the GPU is busy waits behind its work. With several queues steptrace's own
        #: stream is not behind the training stream (an H200, busy: 34 µs p50, 62 µs max to complete).
        self.one_queue = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"
        self.memory_due = 0.0  # when the training thread samples it next (perf_counter)

    # -- training thread ---------------------------------------------------------------------
    def current_stream(self) -> Any:
        return self._owner.placement(self.index)

    def record(self, stream: Any, marker: Any = None) -> Any:
        """Record a marker on ``stream`` now; None while the training thread's current stream is being
        captured into a CUDA graph (the marker could be captured too: the captured stream is the current
        one, and a capture on the step's own stream would take it)."""
        owner = self._owner
        if stream is None:  # a unit without a start marker: this GPU's current stream, if not captured
            stream = self.current_stream()
            if stream is None:
                return None
        elif stream is not owner.checked and owner._capturing():
            return None
        owner.checked = None  # one use: a start marker recorded on the stream just looked up
        if marker is None:
            try:
                marker = self._free.pop()  # (_take_event, inline: a call less per marker)
            except IndexError:
                if not self.events_created:
                    self._fill_first_reserve(stream.stream)
                marker = self._take_event()
        record_raw = self._record_raw
        handle = marker.cuda_event
        if record_raw is not None and handle and owner._get_device() == self.index:
            # The calling thread's current device is this GPU (else torch's record, which sets it first).
            rc = record_raw(handle, stream.handle)
            if rc:
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        else:
            marker.record(stream.stream)
        self._last = marker
        self._last_stream_handle = stream.handle
        return marker

    def start_unit(self, unit: Any, rt: Any) -> None:
        """A microbatch's start marker in one call (training thread; its step is timed on this GPU): what
        ``Runtime.start_markers`` does through :meth:`current_stream` and :meth:`record`, inline for the
        steady state; anything else goes the general way, before any side effect."""
        owner = self._owner
        try:
            if owner._capturing():
                return
            index, raw, free, record_raw = self.index, owner._raw_stream, self._free, self._record_raw
            placement = owner._placements.get((index, raw(index))) if raw is not None else None
            if placement is None or not free or record_raw is None or owner._get_device() != index:
                rt.start_markers(unit, self)
                return
            marker = free.pop()
            stream = placement.handle
            rc = record_raw(marker.steptrace_handle, stream)
            if rc:  # (the event is not given back: it may be the one that is broken)
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        except Exception as exc:
            rt.device_failed(exc)
            return
        self._last = marker
        self._last_stream_handle = stream
        unit.start_event = marker
        unit.device = self
        unit.stream = placement
        unit.start_recorded_after = unit.host_start

    def end_unit(self, unit: Any, rt: Any) -> None:
        """A step's or microbatch's end marker in one call (training thread; the compiled exits call it):
        what ``Runtime.end_marker`` does through :meth:`record`, inline for the steady state (its stream
        known, not being captured, an event in the pool, the driver's record); else the general way."""
        owner = self._owner
        placement, free, record_raw = unit.stream, self._free, self._record_raw
        try:
            if placement is None or not free or record_raw is None or owner._get_device() != self.index:
                rt.end_marker(unit)
                return
            if owner._capturing():
                rt.end_marker(unit)  # it checks again and falls back to host timing
                return
            owner.checked = None
            marker = free.pop()
            stream = placement.handle
            unit.end_recorded_after = _perf()
            rc = record_raw(marker.steptrace_handle, stream)
            if rc:  # (the event is not given back: it may be the one that is broken)
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        except Exception as exc:
            rt.device_failed(exc)  # as Runtime.end_marker: the unit falls back to host timing
            rt.host_timed(unit)
            return
        self._last = marker
        self._last_stream_handle = stream
        unit.end_event = marker

    def span_marker(self, step: Any, rt: Any) -> Any:
        """A marker on ``step``'s stream as a host span inside it begins or ends, in one call (training
        thread; the compiled span calls it): what ``Runtime.span_marker`` does through :meth:`record`,
        inline for the steady state. ``(self, marker, host time read before recording)``, or None (a graph
        capture is in progress, or the record failed: counted)."""
        owner = self._owner
        placement, free, record_raw = step.stream, self._free, self._record_raw
        if placement is None or not free or record_raw is None or owner._get_device() != self.index:
            return rt.span_marker(step)
        recorded_after = _perf()
        try:
            if owner._capturing():
                return None  # the marker could be captured too
            owner.checked = None
            marker = free.pop()
            stream = placement.handle
            rc = record_raw(marker.steptrace_handle, stream)
            if rc:  # (the event is not given back: it may be the one that is broken)
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        except Exception as exc:
            rt.device_failed(exc)
            return None
        self._last = marker
        self._last_stream_handle = stream
        return (self, marker, recorded_after)

    def sample_memory(self) -> None:
        """This GPU's allocator, read here where this thread cannot be inside an allocator call."""
        cuda = self._torch.cuda
        try:
            stats = getattr(cuda, "memory_stats_as_nested_dict", None)
            nested = stats(self.index) if stats is not None else None
            if nested:
                allocated = nested["allocated_bytes"]["all"]
                self.memory_sample = {"in_use_bytes": int(allocated["current"]), "peak_bytes": int(allocated["peak"])}
            else:
                self.memory_sample = {"in_use_bytes": int(cuda.memory_allocated(self.index)),
                                      "peak_bytes": int(cuda.max_memory_allocated(self.index))}
        except Exception:
            pass

    # -- resolver thread -----------------------------------------------------------------------
    def _off_thread(self) -> None:
        state = _OFF_THREAD
        if state.device != self.index or state.capture_safe is None:  # else set up already (one check)
            _off_thread(self._torch, self.index)

    # (query and elapsed run a few times a step on the resolver: the thread's set-up check is inline, and
    # a pooled event's raw handle is the one read at its creation.)
    def query(self, marker: Any) -> bool:
        state = _OFF_THREAD
        if state.device != self.index or state.capture_safe is None:
            _off_thread(self._torch, self.index)
        handle = marker.steptrace_handle if state.driver else 0
        if handle:
            return _DRIVER.event_query(handle)
        return _event_done(marker)

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` on this GPU's clock (``cudaEventElapsedTime``: float32 ms)."""
        state = _OFF_THREAD
        if state.device != self.index or state.capture_safe is None:
            _off_thread(self._torch, self.index)
        if state.driver:
            a, b = start.steptrace_handle, end.steptrace_handle
            if a and b:
                return _DRIVER.event_elapsed_ms(a, b) / 1000.0
        return start.elapsed_time(end) / 1000.0

    def elapsed_pair(self, ref: Any, start: Any, end: Any) -> tuple[float, float]:
        """``(elapsed(ref, start), elapsed(start, end))`` in one call: the resolver's CUDA fast path reads a
        step's two durations together (the thread's set-up checked once; two ``cuEventElapsedTime``)."""
        state = _OFF_THREAD
        if state.device != self.index or state.capture_safe is None:
            _off_thread(self._torch, self.index)
        if state.driver:
            a, b, c = ref.steptrace_handle, start.steptrace_handle, end.steptrace_handle
            read = _DRIVER.event_elapsed_ms
            # (Each as elapsed() reads it: through the driver where both handles are known.)
            first = read(a, b) if a and b else ref.elapsed_time(start)
            return first / 1000.0, (read(b, c) if b and c else start.elapsed_time(end)) / 1000.0
        return ref.elapsed_time(start) / 1000.0, start.elapsed_time(end) / 1000.0

    def release(self, marker: Any) -> None:
        self._free.append(marker)

    def drained(self) -> bool:
        """True when the newest marker the training thread recorded has completed (the GPU is idle)."""
        last = self._last
        if last is None:
            return True
        self._off_thread()
        return _event_done(last)

    def prepare_clock_marker(self) -> None:
        """Make the anchor stream and a spare event ready before the clock reads its lower bound: the first
        anchor's bracket held the stream's creation (212 µs on an H200) and was never placed."""
        self._off_thread()
        if self._anchor_stream is None:
            self._anchor_stream = self._make_anchor_stream()
        if not self._free:
            self._free.append(self._new_event(self._anchor_stream))

    def clock_marker(self) -> Any:
        self.prepare_clock_marker()
        return self._record_anchor()

    def clock_query(self, marker: Any) -> bool:
        """The anchor's spin: keeps the GIL, so no other thread runs inside the anchor's bracket."""
        handle = marker.cuda_event
        if self._record_raw is not None and handle:
            return _DRIVER.query_keeping_gil(handle)
        return self.query(marker)

    def _fill_first_reserve(self, stream: Any) -> None:
        """The pool's first events, made by the training thread at the GPU's first marker, before it (a
        step's start marker comes after them), so the steps take theirs from the pool; events come back
        to it once the resolver has read them, so it grows only past ``_POOL_RESERVE`` units in flight."""
        for _ in range(_POOL_RESERVE):
            self._free.append(self._new_event(stream))

    def replenish(self) -> None:
        """Resolver thread, after a step: give the pool back ``_POOL_RESERVE`` free events once the training
        thread has taken it below ``_POOL_LOW`` (more units in flight than it held: a burst of short steps
        the resolver is behind on), made here on steptrace's own stream, so the training thread does not
        make them: torch's record that creates one gives the GIL away right before the marker it is for.

        A fixed reserve, not one that follows the backlog: making events costs the resolver time, and a
        pool grown with a resolver that falls behind made it fall further behind (a one-queue pipeline of
        32 microbatches a step under load on the fake: 57-81 of 200 steps finalized after training ended,
        against 0-5 with the fixed reserve). A deep pipeline's first step still makes its events on the
        training thread; they all come back after it.
        """
        free = self._free
        if len(free) >= _POOL_LOW or not self.events_created:
            return
        self._off_thread()
        if self._anchor_stream is None:
            self._anchor_stream = self._make_anchor_stream()
        for _ in range(_POOL_RESERVE - len(free)):
            free.append(self._new_event(self._anchor_stream))
        self.events_replenished += 1

    def _take_event(self) -> Any:
        """A timing event from the pool (list.pop is atomic under the GIL), or a new one."""
        try:
            return self._free.pop()
        except IndexError:
            # The pool grows here while more units are in flight than it holds (the first steps of a
            # deep pipeline): torch's record that creates the event releases the GIL (see _new_event).
            return self._new_event(self._torch.cuda.current_stream(self.index))

    def _new_event(self, stream: Any) -> Any:
        """A timing event whose CUDA event exists: c10 creates it at its first ``record``, and the driver's
        record needs the handle, so it is recorded once here, on ``stream`` (a stream of this GPU; a pool
        event's first record is never read)."""
        marker = self._Event(enable_timing=True)
        marker.steptrace_gpu = self
        marker.steptrace_handle = 0
        if self._record_raw is not None:
            marker.record(stream)
            # The cudaEvent_t, fixed from its first record to its destruction: read once here, not
            # through the property at every marker.
            marker.steptrace_handle = int(marker.cuda_event)
        self.events_created += 1
        return marker

    def _record_anchor(self) -> Any:
        marker = self._take_event()
        # Not behind self._last: the training thread's work is not queued before it.
        handle = marker.cuda_event
        if self._record_raw is not None and handle:
            # Keeping the GIL (a tight bracket) only while the training stream is idle: a synchronous
            # copy the training thread may be inside then ends at once. While that stream is busy, the
            # record can wait for such a copy to the end of the queued work, or of a hang: through
            # CDLL the other Python threads run meanwhile (see _Driver.record_releasing_gil).
            if self._training_stream_idle():
                rc = self._record_raw(handle, self._anchor_stream_handle)
            else:
                rc = _DRIVER.record_releasing_gil(handle, self._anchor_stream_handle)
            if rc:
                self._free.append(marker)
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        else:
            marker.record(self._anchor_stream)
        return marker

    def _training_stream_idle(self) -> bool:
        """Whether the stream of the newest marker has no work left (``cuStreamQuery`` keeping the GIL,
        which never waits on another thread's copy: measured). False when it cannot say."""
        stream = self._last_stream_handle
        if stream is None:
            return True  # no marker yet: the training thread has queued nothing steptrace knows of
        try:
            return bool(_DRIVER.stream_idle_keeping_gil(stream))
        except Exception:
            return False

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
            self._anchor_stream_handle = pointer
            return stream
        except Exception as exc:
            log.warning("steptrace could not create a CUDA stream of its own (%r); calibration uses a "
                        "high-priority pool stream, which NCCL may share", exc)
            self.anchor_stream_kind = "pool"
            stream = cuda.Stream(device=self.index, priority=-1)
            self._anchor_stream_handle = int(stream.cuda_stream)
            return stream

    def memory_stats(self) -> dict[str, int] | None:
        """This GPU's memory as the training thread last sampled it (at most a second before the step's
        last marker): in use, the peak since the process started (or since the program's own last
        ``reset_peak_memory_stats``; steptrace never resets it: Megatron's report_memory and Lightning's
        DeviceStatsMonitor read the same counter), and the GPU's total memory (a device property, which
        takes no allocator lock)."""
        sample = self.memory_sample
        if sample is None:
            return None
        if self._total_memory is None:
            try:
                self._total_memory = int(self._torch.cuda.get_device_properties(self.index).total_memory)
            except Exception:
                return None
        return {**sample, "limit_bytes": self._total_memory}


class _ScalarCopies:
    """Pinned host buffers and events for logged CUDA scalars, reused: taken on the training thread,
    given back by the resolver once read (list.pop/append are atomic under the GIL)."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, Any], list[tuple[Any, Any]]] = {}
        self.streams: dict[tuple[int, int], Any] = {}
        self._driver_record: bool | None = None

    @property
    def driver_record(self) -> bool:
        """Whether the copies' events are recorded through the driver (it loads), asked once."""
        if self._driver_record is None:
            self._driver_record = _driver_loads()
        return self._driver_record


_SCALARS = _ScalarCopies()


class _CudaScalar:
    """A logged CUDA scalar whose copy to pinned host memory is queued on its own GPU's stream, behind the
    kernel that computes it, with an event recorded after the copy on that same stream."""

    __slots__ = ("_torch", "_index", "_key", "_host", "_event")

    def __init__(self, torch: Any, index: int, key: tuple[int, Any], host: Any, event: Any):
        self._torch = torch
        self._index = index
        self._key = key
        self._host = host
        self._event = event

    def ready(self) -> bool:
        """Whether the copy has landed (resolver; never blocks): the step is finalized only then."""
        _off_thread(self._torch, self._index)
        return _event_done(self._event)

    def __call__(self) -> float:
        _off_thread(self._torch, self._index)
        if not _event_done(self._event):
            _event_wait(self._event)  # not reached when ready() said so first; the GIL is released
        value = float(self._host)
        _SCALARS.free.setdefault(self._key, []).append((self._host, self._event))
        return value


class _CapturedScalar:
    """A scalar logged while its stream was being captured into a CUDA graph: its copy would be captured
    too, so it is not queued; reading it fails (counted as a scalar error)."""

    def __call__(self) -> float:
        raise RuntimeError("logged while its CUDA stream was being captured into a graph")


def scalar_reader(value: Any) -> Any:
    """A logged torch scalar: a CPU tensor is read now (it is computed); a CUDA tensor's copy to pinned
    host memory is queued now on the current stream of the tensor's own GPU (where torch queues it), and
    read by the resolver once an event recorded after it on that stream has completed (so nothing waits
    on the training thread). Buffers and events are pooled."""
    try:
        if value.numel() != 1:
            return None
        if not value.is_cuda:
            return float(value.detach().reshape(()))
        torch = sys.modules.get("torch") or require_torch()  # (imported: the value is a torch tensor)
        index = int(value.get_device())
        scalars = _SCALARS
        raw = torch._C._cuda_getCurrentRawStream(index)
        stream = scalars.streams.get((index, raw))
        if stream is None:
            stream = scalars.streams[index, raw] = torch.cuda.current_stream(index)
        on_current = index == torch._C._cuda_getDevice()
        if on_current and torch._C._cuda_isCurrentStreamCapturing():
            return _CapturedScalar()
        scalar = value.detach().reshape(())
        key = (index, scalar.dtype)
        try:
            host, event = scalars.free[key].pop()
            host.copy_(scalar, non_blocking=True)
        except (KeyError, IndexError):
            host = scalar.to("cpu", non_blocking=True)  # pinned: torch pins a non_blocking copy's output
            event = torch.cuda.Event()  # created at its first record, on the stream's (the tensor's) GPU
        handle = event.cuda_event
        driver_record = scalars._driver_record
        if driver_record is None:
            driver_record = scalars.driver_record
        if handle and driver_record and on_current:
            # A pooled event (created by its first record): recorded through the driver keeping the GIL, as
            # markers are, where torch's record would give the GIL away on the training thread.
            rc = _DRIVER.record_keeping_gil(handle, raw)
            if rc:
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        else:
            event.record(stream)
    except Exception:
        return None
    return _CudaScalar(torch, index, key, host, event)


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


#: The variable through which a tool attaches to NVTX (Nsight Systems sets it for the process it launches).
#: NVTX reads it once, at its first call, and without a tool every NVTX call is a no-op (NVTX v3,
#: ``nvtxDetail/nvtxInit.h``, ``nvtxInitializeInjectionLibrary``: the injection library is found through
#: ``NVTX_INJECTION64_PATH``, else a statically linked one; none found: "all NVTX API functions will be set
#: to no-ops").
NVTX_TOOL_ENV = "NVTX_INJECTION64_PATH"


def nvtx_tool_attached() -> bool:
    """Whether an NVTX tool (Nsight Systems, Nsight Compute) is attached to this process."""
    return bool(os.environ.get(NVTX_TOOL_ENV))


def step_annotator() -> Callable[[int], Any]:
    """Build the per-step annotator: ``torch.profiler.record_function`` while the torch profiler
    runs (it costs ~10 µs per step otherwise, measured here) and an NVTX range where CUDA is
    available and an NVTX tool is attached (Nsight Systems shows steps by number). Without a tool
    NVTX discards the range, so the range's Python (a string, two calls, ~2 µs a step on the
    training thread) is not paid for nothing."""
    torch = require_torch()
    profiler_enabled = torch.autograd._profiler_enabled
    try:
        nvtx = torch.cuda.nvtx if nvtx_tool_attached() and torch.cuda.is_available() else None
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

    if nvtx is None:
        # annotate(n) is None while this says False: the runtime may call it alone (no Python frame).
        annotate.enabled = profiler_enabled  # type: ignore[attr-defined]
    return annotate
