"""PyTorch: CUDA-event step timing resolved off the training thread, profiler and NVTX ranges.

On CUDA, :class:`TorchCudaDevice` records ``torch.cuda.Event(enable_timing=True)``
markers on the current stream at the step's dispatch point and at its exit;
the resolver thread synchronises on the exit marker and reads the device time
between the two with ``elapsed_time``. The training thread never synchronises.

On CPU-only torch, operators run synchronously, so host times are exact and
the step is host-timed (``backend: "host"``).
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
    """A stream device: CUDA events on the current stream."""

    name = "torch-cuda"
    uses_events = True

    def __init__(self) -> None:
        self._torch = require_torch()
        if not self._torch.cuda.is_available():
            raise ValueError("backend='torch' with CUDA events needs a CUDA device; torch.cuda.is_available() is False")

    def event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, asynchronously
        return event

    def wait_event(self, event: Any) -> float | None:
        event.synchronize()  # resolver thread only; releases the GIL while waiting
        return None

    def elapsed(self, start_event: Any, end_event: Any) -> float:
        return start_event.elapsed_time(end_event) / 1000.0  # milliseconds on the device clock

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        # CUDA steps are timed by their markers; values are not needed.
        return None


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


def step_annotator(cuda: bool) -> Callable[[int], Any]:
    """Build the per-step annotator: ``torch.profiler.record_function`` while the torch profiler
    runs (it costs ~10 µs per step otherwise, measured here) and an NVTX range on CUDA."""
    torch = require_torch()
    profiler_enabled = torch.autograd._profiler_enabled
    nvtx = torch.cuda.nvtx if cuda else None

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
