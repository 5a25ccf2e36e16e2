"""torchtitan: drop-in hooks that turn torchtitan's ``Trainer`` into steptrace records.

::

    import steptrace.adapters.torchtitan
    steptrace.adapters.torchtitan.install(run_id="my-run")   # before trainer.train()

What is hooked (class attributes are replaced; no file is edited), checked against torchtitan
0.3.0 (``torchtitan/trainer.py``, ``torchtitan/components/checkpointer/dcp.py``); the user guide
is ``docs/torchtitan.md``:

- ``Trainer.train_step``: one ``steptrace.step(n)`` with ``n = trainer.step`` (torchtitan's own
  step number, 1-based, restored from its checkpoints), unless a step is already open (your own
  ``with steptrace.step(n)``). At the step's end it is given ``tokens`` = the label tokens the step
  fetched (what torchtitan counts for its tps) divided by the parallel dimensions that share a batch
  (``parallel_dims.non_data_parallel_size``: tensor, pipeline and context ranks see the same
  tokens), and ``flops`` = those tokens × ``metrics_processor.num_flops_per_token`` (the model FLOPs
  torchtitan's own TFLOPs and MFU use), so summed over ranks both are the job's.
- ``Trainer.batch_generator``: each batch fetched (``next``) is a ``data`` span: the step's
  ``idle_breakdown["data"]``.
- ``CheckpointManager._save`` (behind ``checkpointer.save``, called only when checkpointing is
  enabled): when torchtitan decides to save (its ``_should_save``), a ``steptrace.checkpoint`` of
  ``curr_step``. Its ``blocking_seconds`` is the time the training thread spent in it (with
  ``async_mode="async"``/``"async_with_pinned_mem"``: waiting for the previous save, staging, starting
  ``dcp.async_save``); the background commit is tracked to the ``save_future`` the save left
  (``async_seconds``, never charged to a step). The last step's save, synchronous in torchtitan, is
  all blocking.
- ``CheckpointManager._maybe_wait_for_staging`` (inside the step, before the optimizer, with
  ``async_with_pinned_mem``): a ``checkpoint`` span while a staging is still in flight.
- ``CheckpointManager._load`` (``checkpointer.load`` at ``train()`` start): a
  ``steptrace.restore()`` with ``attrs["restored_step"]`` = the trainer's step after the load
  (``restored: false`` when no checkpoint was found); the next step is ``first_after_restore``.
- ``Validator.validate``: an ``eval`` span.
- Pipeline parallelism: torchtitan runs its schedules from torch.distributed.pipelining, whose hooks
  (``steptrace.adapters.torch_pipelining``) are installed too: each stage's microbatches are
  ``steptrace.microbatch`` records inside the trainer's step.

A hook whose target's signature differs from what it reads disables itself with one
``SteptraceWarning`` naming the function and torchtitan's version; the run continues without it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import steptrace
from steptrace.adapters._hooks import Hooks, NothingRestored, installed_version, start_steptrace, timed_restore

__all__ = ["install", "installed", "uninstall"]

_hooks = Hooks("torchtitan", lambda: f"torchtitan {installed_version('torchtitan') or '(version unknown)'}")

_TRAINER = "torchtitan.trainer"
_DCP = "torchtitan.components.checkpointer.dcp"
_VALIDATE = "torchtitan.components.validate"


def require_torchtitan() -> Any:
    try:
        import torchtitan.trainer
    except ImportError as exc:
        raise ImportError("steptrace's torchtitan hooks need torchtitan: pip install 'steptrace[torchtitan]'") from exc
    return torchtitan.trainer


class _State:
    """Per-process hook state: the step the trainer hook opened and the label tokens it fetched."""

    def __init__(self) -> None:
        self.open: Any = None  # the step handle train_step's hook opened, or None
        self.tokens_fetched = 0  # label tokens fetched by batch_generator while self.open


_state = _State()


def _per_rank(trainer: Any, tokens: int) -> tuple[int | float, float | None]:
    """This rank's share of ``tokens`` fetched, and its model FLOPs (None when torchtitan has none)."""
    try:
        share = int(trainer.parallel_dims.non_data_parallel_size)
    except Exception:  # an older ParallelDims: every rank counts its own batch
        share = 1
    share = max(share, 1)
    rank_tokens: int | float = tokens // share if tokens % share == 0 else tokens / share
    flops_per_token = getattr(getattr(trainer, "metrics_processor", None), "num_flops_per_token", None)
    if not isinstance(flops_per_token, (int, float)) or flops_per_token <= 0:  # unset: torchtitan's -1
        return rank_tokens, None
    return rank_tokens, float(flops_per_token) * rank_tokens


def _hook_train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_step(self: Any, data_iterator: Any) -> Any:
        if not steptrace.enabled() or steptrace.current_step() is not None or _state.open is not None:
            return original(self, data_iterator)
        handle = steptrace.begin_step(int(self.step))
        if steptrace.current_step() is not handle:  # refused (misuse already warned): run unrecorded
            return original(self, data_iterator)
        _state.open, _state.tokens_fetched = handle, 0
        try:
            result = original(self, data_iterator)
        except BaseException as exc:
            _close(self, handle, exc)
            raise
        _close(self, handle, None)
        return result

    return train_step


def _close(trainer: Any, handle: Any, error: BaseException | None) -> None:
    _state.open = None
    if steptrace.current_step() is not handle:
        return
    if _state.tokens_fetched:
        tokens, flops = _per_rank(trainer, _state.tokens_fetched)
        handle.tokens = tokens
        if flops is not None:
            handle.flops = flops
    steptrace.end_step(error=error)


def _hook_batch_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    def batch_generator(self: Any, data_iterable: Any) -> Iterator[Any]:
        batches = original(self, data_iterable)
        while True:
            if not steptrace.enabled():
                yield from batches
                return
            with steptrace.span("data"):
                try:
                    batch = next(batches)
                except StopIteration:
                    return
            if _state.open is not None:
                labels = batch[1] if isinstance(batch, tuple) and len(batch) == 2 else None
                numel = getattr(labels, "numel", None)
                if callable(numel):
                    _state.tokens_fetched += int(numel())
            yield batch

    return batch_generator


def _hook_save(original: Callable[..., Any]) -> Callable[..., Any]:
    def _save(self: Any, curr_step: int, last_step: bool = False) -> Any:
        if not steptrace.enabled():
            return original(self, curr_step, last_step)
        try:
            saving = bool(self._should_save(curr_step, last_step))
        except Exception:  # cannot tell: time the call as a save (an empty one costs nothing)
            saving = True
        if not saving:
            return original(self, curr_step, last_step)
        mode = getattr(getattr(self, "async_mode", None), "value", getattr(self, "async_mode", "disabled"))
        # torchtitan's last-step save is a synchronous dcp.save in every mode.
        async_save = mode in ("async", "async_with_pinned_mem") and not last_step
        future_before = getattr(self, "save_future", None)
        with steptrace.checkpoint(int(curr_step), async_save=async_save) as ckpt:
            result = original(self, curr_step, last_step)
        if async_save:
            future = getattr(self, "save_future", None)
            if future is not None and future is not future_before and hasattr(future, "add_done_callback"):
                ckpt.track(future)
            else:  # nothing left running in the background
                ckpt.async_done()
        return result

    return _save


def _hook_wait_for_staging(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_wait_for_staging(self: Any) -> Any:
        if not steptrace.enabled() or getattr(self, "staging_future", None) is None:
            return original(self)
        with steptrace.span("checkpoint", waiting="staging"):
            return original(self)

    return _maybe_wait_for_staging


def _restored_step(manager: Any, loaded: Any) -> int | None:
    if loaded is False:
        raise NothingRestored
    states = getattr(manager, "states", None)
    train_state = states.get("train_state") if isinstance(states, dict) else None
    step = getattr(train_state, "step", None)
    return int(step) if isinstance(step, int) else None


def _hook_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def _load(self: Any, step: int = -1) -> Any:
        if not steptrace.enabled():
            return original(self, step)
        return timed_restore(lambda: original(self, step), lambda loaded: _restored_step(self, loaded))

    return _load


def _hook_validate(original: Callable[..., Any]) -> Callable[..., Any]:
    def validate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(self, *args, **kwargs)
        with steptrace.span("eval"):
            return original(self, *args, **kwargs)

    return validate


def install(**init_settings: Any) -> list[str]:
    """Install the hooks (idempotent) and return the names of the methods hooked.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given. Call it before ``trainer.train()`` (before or after building the trainer).
    Also installs ``steptrace.adapters.torch_pipelining`` (torchtitan's pipeline parallelism).
    Raises ``ImportError`` naming the package to install when torchtitan is missing.
    """
    trainer_module = require_torchtitan()
    start_steptrace(init_settings)
    if not _hooks.installed():
        trainer = trainer_module.Trainer
        _hooks.patch(f"{_TRAINER}.Trainer.train_step", trainer, "train_step", _hook_train_step,
                     exact=("self", "data_iterator"))
        _hooks.patch(f"{_TRAINER}.Trainer.batch_generator", trainer, "batch_generator", _hook_batch_generator,
                     exact=("self", "data_iterable"))
        _hooks.patch(f"{_DCP}.CheckpointManager._save", _DCP, "CheckpointManager._save", _hook_save,
                     exact=("self", "curr_step", "last_step"))
        _hooks.patch(f"{_DCP}.CheckpointManager._maybe_wait_for_staging", _DCP,
                     "CheckpointManager._maybe_wait_for_staging", _hook_wait_for_staging, exact=("self",))
        _hooks.patch(f"{_DCP}.CheckpointManager._load", _DCP, "CheckpointManager._load", _hook_load,
                     exact=("self", "step"))
        _hooks.patch(f"{_VALIDATE}.Validator.validate", _VALIDATE, "Validator.validate", _hook_validate,
                     missing_ok=True)
    import steptrace.adapters.torch_pipelining as pipelining

    pipelining.install()
    return installed()


def installed() -> list[str]:
    """``module.Class.method`` names currently hooked (torchtitan's; the pipelining hooks are listed by
    ``steptrace.adapters.torch_pipelining.installed()``)."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked method (the pipelining hooks stay: uninstall them with their module)."""
    _hooks.uninstall()
    _state.__init__()  # type: ignore[misc]
