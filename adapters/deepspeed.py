"""DeepSpeed: drop-in hooks that turn DeepSpeed's engine and pipeline engine into steptrace records.

::

    import steptrace.adapters.deepspeed
    steptrace.adapters.deepspeed.install(run_id="my-run")   # before or after deepspeed.initialize

What is hooked (class attributes are replaced; no file is edited), checked against DeepSpeed
0.19.8; the user guide is ``docs/deepspeed.md``:

- ``DeepSpeedEngine.forward``: the first training forward (module in training mode, gradients
  enabled) when no step is open opens ``steptrace.step(n)`` with ``n = engine.global_steps`` (the
  count of optimizer updates DeepSpeed keeps and restores from its checkpoints) and ``samples`` =
  this rank's micro-batch size × gradient accumulation steps.
- ``DeepSpeedEngine.step``: when the call applied an update (``global_steps`` advanced: the
  gradient accumulation boundary), its return closes the step; ``attrs["micro_batches"]`` counts
  the forwards in it.
- ``PipelineEngine.train_batch``: one step (``n = global_steps``; the engine's whole schedule and
  optimizer step); ``eval_batch`` is an ``eval`` span.
- ``PipelineEngine._exec_forward_pass`` / ``_exec_backward_pass``: the instructions the pipeline
  schedule runs for each micro-batch, each a ``steptrace.microbatch`` with ``stage`` =
  ``engine.stage_id`` and ``microbatch`` = its position among the step's forwards (backwards):
  DeepSpeed's ``TrainSchedule`` runs each stage's forwards, and its backwards, in micro-batch order,
  and the instruction carries only the buffer id.
- ``PipelineEngine._exec_load_micro_batch`` (the first and last stages' ``next(data_iter)``): a
  ``data`` span.
- ``DeepSpeedEngine.save_checkpoint``: a ``steptrace.checkpoint`` of the last step run (blocking
  part: the save's time after that step's end). With a decoupled checkpoint engine
  (``"checkpoint": {"writer": {"decoupled": true, ...}}``: ``save_checkpoint`` queues the state to a
  writer subprocess and returns; a later ``engine.step()`` commits it) the save is asynchronous: its
  ``async_seconds`` ends when ``DecoupledCheckpointEngine.commit`` returned, the writer done.
- ``DecoupledCheckpointEngine.commit`` (from ``step()`` on the next accumulation boundary, or from
  ``engine.destroy()``): the training thread waiting for the writer, a ``checkpoint`` span
  (``attrs["waiting"] = "commit"``): inside a step, that step's idle ``checkpoint``. A commit that
  raises (the writer died) marks the saves it was committing ``error``; a save still uncommitted at
  ``steptrace.shutdown()`` is ``incomplete``.
- ``DeepSpeedEngine.load_checkpoint``: a ``steptrace.restore()``
  with ``attrs["restored_step"]`` = the ``global_steps`` it loaded (``restored: false`` when it found
  no checkpoint: it returns ``(None, None)``); the next step is ``first_after_restore``.

Inside your own ``with steptrace.step(n)`` the hooks open no step. A hook whose target's signature
differs from what it reads disables itself with one ``SteptraceWarning`` naming the function and
DeepSpeed's version; the run continues without it.
"""

from __future__ import annotations

from typing import Any, Callable

import steptrace
from steptrace.adapters._hooks import Hooks, NothingRestored, installed_version, start_steptrace, timed_restore

__all__ = ["install", "installed", "uninstall"]

_hooks = Hooks("DeepSpeed", lambda: f"deepspeed {installed_version('deepspeed') or '(version unknown)'}")


def require_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError("steptrace's DeepSpeed hooks need deepspeed: DS_BUILD_OPS=0 pip install "
                          "'steptrace[deepspeed]'") from exc
    return deepspeed


class _State:
    """Per-process hook state: the step the engine hooks opened, and the micro-batch counters."""

    def __init__(self) -> None:
        self.open: Any = None  # the step handle begin_step returned, or None
        self.micro_batches = 0
        self.forwards = 0  # pipeline: forwards / backwards run in this step, the next microbatch index
        self.backwards = 0


_state = _State()

# On a decoupled checkpoint engine, the checkpoint handles its next commit completes (DeepSpeed commits
# every save queued since the last commit at once: the writer's queue is FIFO). An attribute of the
# engine, not a weak mapping: DeepSpeed commits a pending save from the engine's __del__ (cleanup), and a
# collection of a reference cycle clears weak references before it calls __del__.
_PENDING = "_steptrace_pending_commits"


def _samples(engine: Any) -> Any:
    try:
        return int(engine.train_micro_batch_size_per_gpu()) * int(engine.gradient_accumulation_steps())
    except Exception:  # reading a figure must never fail the step
        return None


def _close_step(error: BaseException | None = None) -> None:
    handle, _state.open = _state.open, None
    if handle is None or steptrace.current_step() is not handle:
        return
    attrs = getattr(handle, "attrs", None)
    if isinstance(attrs, dict):
        attrs["micro_batches"] = _state.micro_batches
    steptrace.end_step(error=error)


def _hook_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.open is None and steptrace.enabled() and steptrace.current_step() is None:
            import torch

            if self.module.training and torch.is_grad_enabled():
                handle = steptrace.begin_step(int(self.global_steps), samples=_samples(self))
                if steptrace.current_step() is handle:
                    _state.open, _state.micro_batches = handle, 0
        if _state.open is not None:
            _state.micro_batches += 1
        return original(self, *args, **kwargs)

    return forward


def _hook_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, lr_kwargs: Any = None) -> Any:
        if _state.open is None:
            return original(self, lr_kwargs)
        before = self.global_steps
        try:
            result = original(self, lr_kwargs)
        except BaseException as exc:
            _close_step(error=exc)
            raise
        if self.global_steps != before:  # the update was applied: the accumulation boundary
            _close_step()
        return result

    return step


def _hook_train_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_batch(self: Any, data_iter: Any = None) -> Any:
        if not steptrace.enabled() or steptrace.current_step() is not None:
            _state.forwards = _state.backwards = 0
            return original(self, data_iter)
        _state.forwards = _state.backwards = 0
        with steptrace.step(int(self.global_steps), samples=_samples(self),
                            micro_batches=int(self.gradient_accumulation_steps())):
            return original(self, data_iter)

    return train_batch


def _hook_eval_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def eval_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or steptrace.current_step() is not None:
            return original(self, *args, **kwargs)
        with steptrace.span("eval"):
            return original(self, *args, **kwargs)

    return eval_batch


def _hook_pass(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    counter = "forwards" if kind == "forward" else "backwards"

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_pass(self: Any, buffer_id: Any) -> Any:
            if steptrace.current_step() is None or (kind == "backward" and not self.module.training):
                return original(self, buffer_id)
            index = getattr(_state, counter)
            setattr(_state, counter, index + 1)
            with steptrace.microbatch(index, stage=self.stage_id, kind=kind):
                return original(self, buffer_id)

        return run_pass

    return make


def _hook_load_micro_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def _exec_load_micro_batch(self: Any, buffer_id: Any) -> Any:
        if not steptrace.enabled():
            return original(self, buffer_id)
        with steptrace.span("data"):  # next(data_iter) and the copy to the device
            return original(self, buffer_id)

    return _exec_load_micro_batch


def _hook_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(self, *args, **kwargs)
        step = steptrace.last_step()
        checkpoint_engine = getattr(self, "checkpoint_engine", None)
        decoupled = _commit_is_timed(checkpoint_engine)
        with steptrace.checkpoint(step if step is not None else max(int(self.global_steps) - 1, 0),
                                  async_save=decoupled) as ckpt:
            result = original(self, *args, **kwargs)
        if decoupled:
            if _commit_pending(checkpoint_engine):  # the writer has it; a later commit completes it
                try:
                    pending = getattr(checkpoint_engine, _PENDING, None)
                    if pending is None:
                        pending = []
                        setattr(checkpoint_engine, _PENDING, pending)
                    pending.append(ckpt)
                except Exception:  # an engine that takes no attribute: the commit cannot be tied to it
                    ckpt.async_done()
            else:
                ckpt.async_done()
        return result

    return save_checkpoint


def _commit_is_timed(checkpoint_engine: Any) -> bool:
    """Whether ``checkpoint_engine`` is decoupled and its ``commit`` is the hooked one (DeepSpeed's
    ``DecoupledCheckpointEngine`` or a subclass that keeps its commit)."""
    try:
        return bool(checkpoint_engine.is_decoupled()) and bool(
            getattr(type(checkpoint_engine).commit, "__steptrace_hook__", False))
    except Exception:  # not a CheckpointEngine: the save is recorded by its blocking part
        return False


def _commit_pending(checkpoint_engine: Any) -> bool:
    try:
        return checkpoint_engine.get_commit_info() is not None  # set by create(), cleared by commit()
    except Exception:
        return True


def _hook_commit(original: Callable[..., Any]) -> Callable[..., Any]:
    def commit(self: Any, info: Any) -> Any:
        waiting = getattr(self, _PENDING, None)
        if waiting:
            setattr(self, _PENDING, None)
        if not waiting or not steptrace.enabled():
            return original(self, info)
        # The training thread waits here for the writer subprocess (save_event): checkpoint time,
        # and inside a step that step's idle `checkpoint`, as any host span.
        with steptrace.span("checkpoint", waiting="commit", checkpoint_step=getattr(waiting[-1], "step", None)):
            try:
                result = original(self, info)
            except BaseException as exc:
                for ckpt in waiting:
                    try:
                        ckpt.status, ckpt.error = "error", f"{type(exc).__name__}: {exc}"
                    except AttributeError:  # steptrace's no-op handle
                        pass
                    ckpt.async_done()
                raise
            for ckpt in waiting:
                ckpt.async_done()
        return result

    return commit


def _hook_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(self, *args, **kwargs)

        def restored_step(result: Any) -> int:
            if not result or result[0] is None:  # (None, None): no checkpoint found
                raise NothingRestored
            return int(self.global_steps)

        return timed_restore(lambda: original(self, *args, **kwargs), restored_step)

    return load_checkpoint


def install(**init_settings: Any) -> list[str]:
    """Install the hooks (idempotent) and return the names of the methods hooked.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given. Methods are patched on DeepSpeed's classes, so engines built before or after
    the call are timed alike. Raises ``ImportError`` naming the install when deepspeed is missing.
    """
    require_deepspeed()
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as decoupled_module
    from deepspeed.runtime.pipe import engine as pipe_module

    start_steptrace(init_settings)
    if _hooks.installed():
        return installed()
    engine, pipe = engine_module.DeepSpeedEngine, pipe_module.PipelineEngine
    base = "deepspeed.runtime.engine.DeepSpeedEngine"
    pipe_name = "deepspeed.runtime.pipe.engine.PipelineEngine"
    # forward is wrapped by DeepSpeed's instrument_w_nvtx (signature (*args, **kwargs)); the hook reads no argument.
    _hooks.patch(f"{base}.forward", engine, "forward", _hook_forward)
    _hooks.patch(f"{base}.step", engine, "step", _hook_step, exact=("self", "lr_kwargs"))
    _hooks.patch(f"{base}.save_checkpoint", engine, "save_checkpoint", _hook_save_checkpoint,
                 requires=("self", "save_dir"))
    _hooks.patch("deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine.DecoupledCheckpointEngine.commit",
                 decoupled_module.DecoupledCheckpointEngine, "commit", _hook_commit, exact=("self", "info"))
    _hooks.patch(f"{base}.load_checkpoint", engine, "load_checkpoint", _hook_load_checkpoint,
                 requires=("self", "load_dir"))
    _hooks.patch(f"{pipe_name}.train_batch", pipe, "train_batch", _hook_train_batch, exact=("self", "data_iter"))
    _hooks.patch(f"{pipe_name}.eval_batch", pipe, "eval_batch", _hook_eval_batch)
    _hooks.patch(f"{pipe_name}._exec_forward_pass", pipe, "_exec_forward_pass", _hook_pass("forward"),
                 exact=("self", "buffer_id"))
    _hooks.patch(f"{pipe_name}._exec_backward_pass", pipe, "_exec_backward_pass", _hook_pass("backward"),
                 exact=("self", "buffer_id"))
    _hooks.patch(f"{pipe_name}._exec_load_micro_batch", pipe, "_exec_load_micro_batch", _hook_load_micro_batch,
                 exact=("self", "buffer_id"))
    # _exec_schedule runs instructions through _INSTRUCTION_MAP, which holds the functions the class
    # body defined (not a lookup by name): the map is replaced by one that holds the hooks.
    _hooks.patch(f"{pipe_name}._INSTRUCTION_MAP", pipe, "_INSTRUCTION_MAP",
                 lambda original: _hooked_map(pipe, original))
    return installed()


class _InstructionMap(dict):
    """PipelineEngine._INSTRUCTION_MAP with the hooked passes (a dict subclass: it can carry the
    attributes the patch mechanism marks a hook with)."""


def _hooked_map(pipe: Any, original: dict) -> _InstructionMap:
    hooked = {}
    for name in ("_exec_forward_pass", "_exec_backward_pass", "_exec_load_micro_batch"):
        wrapper = pipe.__dict__.get(name)
        source = getattr(wrapper, "__steptrace_original__", None)
        if source is not None:
            hooked[source] = wrapper
    return _InstructionMap({kind: hooked.get(fn, fn) for kind, fn in original.items()})


def installed() -> list[str]:
    """``module.Class.method`` names currently hooked."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked method (for tests and for runs that want the originals back)."""
    _hooks.uninstall()
    _state.__init__()  # type: ignore[misc]
