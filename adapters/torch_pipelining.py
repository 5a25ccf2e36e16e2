"""torch.distributed.pipelining: drop-in hooks that time every pipeline schedule's microbatches.

::

    import steptrace
    import steptrace.adapters.torch_pipelining

    steptrace.init()
    steptrace.adapters.torch_pipelining.install()   # before the training loop

What is hooked (class attributes are replaced; no file is edited), checked against torch 2.13.0's
``torch/distributed/pipelining/schedules.py`` and ``stage.py``; the user guide is
``docs/torch_pipelining.md``:

- ``PipelineScheduleSingle.step`` and ``PipelineScheduleMulti.step`` (every schedule: GPipe, 1F1B,
  Interleaved1F1B, LoopedBFS, the zero-bubble ones, DualPipeV): a call is a ``steptrace.step``
  numbered from 0 on this rank, unless a step is already open (the user's ``with steptrace.step(n)``
  around the schedule and the optimizer), in which case it runs inside it. ``schedule.eval(...)``
  (the same ``step`` with ``_has_backward`` off) is an ``eval`` span.
- ``_PipelineStageBase.forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``:
  every schedule runs a stage's microbatch through them, so each call is a ``steptrace.microbatch``
  with ``stage`` = the rank's index in the pipeline group (``stage.group_rank``), ``chunk`` = the
  virtual stage held by that rank (``stage_index // group_size``: 0, 1, ... for looped and V-shaped
  placements alike; None when every rank holds one stage, as Megatron's records without virtual
  stages), ``microbatch`` = the chunk id the schedule passes, and ``kind``: ``forward``,
  ``backward`` (``full_backward=True``), and for the zero-bubble schedules' split backward
  ``backward_input`` (``full_backward=False``: the input gradient only) and ``backward_weight``.
  A backward the stage skips (``has_backward`` off: eval) records nothing.

Only computation is a microbatch: the schedule's p2p sends and receives between them are waiting (on
gloo, measured by ``steptrace.adapters.torch_distributed`` in ``Work.wait``), and the loss function the
last stage applies after its forward stays in the pipeline window between microbatches, so it
counts in the bubble. Per step and stage the record carries ``pipeline_bubble_ratio`` (step start to
the stage's last microbatch) and ``optimizer_seconds`` (the rest of the step).

A hook whose target's signature differs from what it reads disables itself with one
``SteptraceWarning`` naming the function and torch's version; the run continues without it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import steptrace
from steptrace.adapters._hooks import Hooks, installed_version, start_steptrace

__all__ = ["install", "installed", "uninstall"]

_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"

# The parameter lists each hook reads by position (argument positions are fixed at install).
_EXPECTED = {
    "forward_one_chunk": ("self", "fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "backward_one_chunk": ("self", "bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "backward_weight_one_chunk": ("self", "bwd_chunk_id", "last_backward"),
}

_hooks = Hooks("torch.distributed.pipelining", lambda: f"torch {installed_version('torch') or '(version unknown)'}")


def require_pipelining() -> tuple[Any, Any]:
    try:
        from torch.distributed.pipelining import schedules, stage
    except ImportError as exc:
        raise ImportError("steptrace's torch.distributed.pipelining hooks need torch with torch.distributed: "
                          "pip install 'steptrace[torch]'") from exc
    return schedules, stage


class _State:
    """Per-process hook state: the next step number when the hook opens the step itself."""

    def __init__(self) -> None:
        self.next_step = 0


_state = _State()


def _where(stage: Any) -> tuple[Any, Any]:
    """(stage, chunk) of a pipeline stage object in steptrace's terms: (pipeline rank, virtual stage)."""
    size = stage.group_size
    chunk = stage.stage_index // size if stage.num_stages > size else None
    return stage.group_rank, chunk


def _hook_schedule_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or steptrace.current_step() is not None:
            return original(self, *args, **kwargs)  # off, or inside the user's own step
        if not getattr(self, "_has_backward", True):
            with steptrace.span("eval"):  # schedule.eval(): forward only
                return original(self, *args, **kwargs)
        n = _state.next_step
        _state.next_step = n + 1
        with steptrace.step(n):
            return original(self, *args, **kwargs)

    return step


# -- the per-call path: one wrapper per microbatch and kind --------------------------------
def _hook_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    current_step = steptrace.current_step

    def forward_one_chunk(self: Any, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if current_step() is None:
            return original(self, fwd_chunk_id, *args, **kwargs)
        stage, chunk = _where(self)
        with steptrace.microbatch(fwd_chunk_id, stage=stage, chunk=chunk, kind="forward"):
            return original(self, fwd_chunk_id, *args, **kwargs)

    return forward_one_chunk


def _hook_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    current_step = steptrace.current_step

    def backward_one_chunk(self: Any, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        if current_step() is None or not self.has_backward:  # the stage returns at once: no work
            return original(self, bwd_chunk_id, loss, full_backward, last_backward)
        stage, chunk = _where(self)
        kind = "backward" if full_backward else "backward_input"
        with steptrace.microbatch(bwd_chunk_id, stage=stage, chunk=chunk, kind=kind):
            return original(self, bwd_chunk_id, loss, full_backward, last_backward)

    return backward_one_chunk


def _hook_backward_weight(original: Callable[..., Any]) -> Callable[..., Any]:
    current_step = steptrace.current_step

    def backward_weight_one_chunk(self: Any, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        if current_step() is None or not self.has_backward:
            return original(self, bwd_chunk_id, last_backward)
        stage, chunk = _where(self)
        with steptrace.microbatch(bwd_chunk_id, stage=stage, chunk=chunk, kind="backward_weight"):
            return original(self, bwd_chunk_id, last_backward)

    return backward_weight_one_chunk


# -- installation ----------------------------------------------------------------------
def install(**init_settings: Any) -> list[str]:
    """Install the hooks (idempotent) and return the names of the methods hooked.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given. The methods are patched on torch's classes, so schedules and stages built
    before or after the call are timed alike. Raises ``ImportError`` when torch.distributed is missing.
    """
    schedules, stage = require_pipelining()
    start_steptrace(init_settings)
    if _hooks.installed():
        return installed()
    base = stage._PipelineStageBase
    for name, make in (("forward_one_chunk", _hook_forward), ("backward_one_chunk", _hook_backward),
                       ("backward_weight_one_chunk", _hook_backward_weight)):
        _hooks.patch(f"{_STAGE}._PipelineStageBase.{name}", base, name, make, exact=_EXPECTED[name])
    for cls in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        _hooks.patch(f"{_SCHEDULES}.{cls}.step", schedules, f"{cls}.step", _hook_schedule_step,
                     requires=("self", "args", "kwargs"))
    return installed()


def installed() -> list[str]:
    """``module.Class.method`` names currently hooked."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked method (for tests and for runs that want the originals back)."""
    _hooks.uninstall()
    _state.__init__()  # type: ignore[misc]
