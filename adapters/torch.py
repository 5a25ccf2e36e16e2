"""PyTorch: CUDA-event step timing resolved off the training thread, profiler and NVTX ranges.

On CUDA, :class:`TorchCudaDevice` records ``torch.cuda.Event(enable_timing=True)``
markers on the current stream at the step's dispatch point and at its exit;
the resolver thread polls them and places their device-clock timestamps on
the host clock. The training thread never synchronises.

CPU torch operators run synchronously, so a CPU step is host-timed
(``backend: "host"``), also on a machine that has a GPU.
"""

from __future__ import annotations

from typing import Any, Callable


def require_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("steptrace's torch backend needs torch: pip install 'steptrace[torch]'") from exc
    return torch


class TorchCudaDevice:
    """A stream device: pooled ``torch.cuda.Event`` markers on the current stream.

    The training thread pays for ``current_stream()`` once per step and one
    ``cudaEventRecord`` per marker; events come from a pool the resolver refills
    after reading them, so steady state allocates nothing. The resolver polls
    ``query()`` (never ``synchronize()``, which spin-waits a core by default) and
    reads times as ``elapsed_time`` against calibration anchors recorded on a
    side stream of the same device (``steptrace._clock``).
    """

    name = "torch-cuda"
    uses_events = True

    def __init__(self) -> None:
        torch = self._torch = require_torch()
        if not torch.cuda.is_available():
            raise ValueError("backend='torch' with CUDA events needs a CUDA device; torch.cuda.is_available() is False")
        self._Event = torch.cuda.Event
        self._current_stream = torch.cuda.current_stream
        self._capturing = torch.cuda.is_current_stream_capturing
        # Markers are bound to the device they are first recorded on: one device per process.
        self.device_index = torch.cuda.current_device()
        self._free: list[Any] = []  # pooled events; list.pop/append are atomic under the GIL
        self._side_stream: Any = None
        #: Events created so far (the pool's high-water mark).
        self.events_created = 0
        self._total_memory: int | None = None

    def current_stream(self) -> Any:
        # A timing event recorded inside a graph capture would be captured (or break it).
        if self._capturing():
            return None
        return self._current_stream()

    def record(self, stream: Any, marker: Any = None) -> Any:
        if marker is None:
            try:
                marker = self._free.pop()
            except IndexError:
                marker = self._Event(enable_timing=True)
                self.events_created += 1
        marker.record(stream)
        return marker

    def query(self, marker: Any) -> bool:
        return marker.query()

    def elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0  # milliseconds on the device clock

    def release(self, marker: Any) -> None:
        self._free.append(marker)

    def memory_stats(self) -> dict[str, int] | None:
        """Memory of the current CUDA device: in use now, the peak since the previous call (the
        previous step's record), and the device's total memory as the limit."""
        cuda = self._torch.cuda
        try:
            memory = {"in_use_bytes": int(cuda.memory_allocated()), "peak_bytes": int(cuda.max_memory_allocated())}
            cuda.reset_peak_memory_stats()
            if self._total_memory is None:
                self._total_memory = int(cuda.get_device_properties(cuda.current_device()).total_memory)
            memory["limit_bytes"] = self._total_memory
        except Exception:
            return None
        return memory

    def clock_marker(self) -> Any:
        if self._side_stream is None:
            # Created here, on the resolver thread: the training thread's stream choice is untouched.
            self._side_stream = self._torch.cuda.Stream(device=self.device_index)
        return self.record(self._side_stream)


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
