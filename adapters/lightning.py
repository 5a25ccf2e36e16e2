"""PyTorch Lightning: a callback that records optimizer steps, data waits, validation and checkpoints.

One line::

    trainer = lightning.Trainer(..., callbacks=[steptrace.adapters.lightning.StepTrace()])

:class:`StepTrace` is a Lightning ``Callback`` (of ``lightning.pytorch`` and, when it is
importable too, of ``pytorch_lightning``, so either package's ``Trainer`` accepts it).

What it records:

* **Steps.** One ``steptrace.step(n)`` per *optimizer step*, numbered ``n = trainer.global_step``
  when it begins (0, 1, 2, ...). With ``accumulate_grad_batches=N`` the step opens at the first
  micro-batch's ``on_train_batch_start`` and closes at the ``on_train_batch_end`` after which
  ``trainer.global_step`` has advanced (the optimizer update is inside the step), so N
  micro-batches make one record. Each micro-batch's loss (``training_step``'s output) is passed
  to ``wait_for``: a CPU tensor makes the step host-timed, a CUDA tensor CUDA-event-timed.
  ``samples`` is the sum of the micro-batches' batch sizes (Lightning's ``extract_batch_size``);
  ``tokens`` is derived when ``tokens_per_sample`` is given (an int, or a callable
  ``batch -> tokens`` applied to each micro-batch).
* **Data.** The training loop reports each fetch from the train dataloader to the trainer's
  profiler as the action ``[_TrainingEpochLoop].train_dataloader_next``; the callback wraps the
  profiler's ``start``/``stop`` (public ``Profiler`` methods, on the trainer's own profiler
  object, whatever profiler is configured) and turns that action into a ``data`` span. The fetch
  of a step's first micro-batch comes before the step opens, so its wait is the step's
  ``idle_breakdown["data"]``; fetches of later micro-batches fall inside the step (spans, not
  idle: the device model has no idle time inside a step). A Lightning that never reports the
  action turns data spans off with one ``SteptraceWarning`` naming its version.
* **Validation.** ``on_validation_start`` .. ``on_validation_end`` is an ``eval`` span (the
  sanity check included).
* **Checkpoints.** ``Trainer.save_checkpoint`` (what ``ModelCheckpoint`` and users call; it
  gathers the state, writes it through the strategy's ``CheckpointIO`` and waits at the barrier)
  is wrapped, through ``steptrace.adapters._hooks``, in ``steptrace.checkpoint(step)`` for the
  last step run, so ``blocking_seconds`` is the save's host time after that step's end.
  ``on_save_checkpoint`` cannot do this: Lightning calls it before writing. With
  ``AsyncCheckpointIO`` only the blocking part (handing the write to its thread) is recorded. A
  ``Trainer.save_checkpoint`` without ``filepath`` turns this off with one warning.

Steptrace starts in ``setup(stage="fit")``, per the contract every steptrace hook follows
(``adapters/_hooks.start_steptrace``): with ``init_settings`` (and ``STEPTRACE_*``) unless it is
already running and no settings were given; the trainer's ``global_rank``/``world_size`` fill in
``rank``/``world_size`` when neither settings nor the environment give them. It is shut down
(flushed) at ``on_fit_end``, or on an exception, only if this callback started it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import steptrace
from steptrace.adapters._hooks import Hooks, installed_version, parameters, start_steptrace_for_trainer

__all__ = ["StepTrace", "installed"]

_BASES: list[type] = []
try:
    import lightning.pytorch as _lightning

    _BASES.append(_lightning.Callback)
except ImportError:
    _lightning = None
try:
    import pytorch_lightning as _pytorch_lightning

    _BASES.append(_pytorch_lightning.Callback)
except ImportError:
    _pytorch_lightning = None
if not _BASES:
    raise ImportError("steptrace.adapters.lightning needs PyTorch Lightning: "
                      "pip install 'steptrace[lightning]' (or lightning / pytorch-lightning)")

#: The profiler action Lightning's training loop wraps around each fetch from the train dataloader.
DATA_ACTION = "train_dataloader_next"


def lightning_version() -> str:
    for dist in ("lightning", "pytorch-lightning"):
        version = installed_version(dist)
        if version:
            return f"{dist} {version}"
    return "lightning (version unknown)"


_hooks = Hooks("Lightning", lightning_version)
#: trainer -> the StepTrace callback set up on it (read by the class-level save_checkpoint hook).
_active: "weakref.WeakKeyDictionary[Any, StepTrace]" = weakref.WeakKeyDictionary()


def installed() -> list[str]:
    """Names of the framework functions hooked now (only while a fit with the callback runs)."""
    return _hooks.installed()


def _trainer_class(trainer: Any) -> type | None:
    """The framework's own ``Trainer`` class in ``trainer``'s MRO (user subclasses call it through super())."""
    for cls in type(trainer).__mro__:
        if cls.__name__ == "Trainer" and cls.__module__.endswith("trainer.trainer"):
            return cls
    return None


def _make_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _active.get(self)
        if callback is None or not steptrace.enabled():
            return original(self, *args, **kwargs)
        with steptrace.checkpoint(callback._saved_step(self)):
            return original(self, *args, **kwargs)

    return save_checkpoint


def _make_restore(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_CheckpointConnector`` restores (``fit(ckpt_path=...)``) in ``steptrace.restore()``: before the
    first step, the job's accounting charges it to ``restore`` (docs/goodput.md)."""

    def restore(self: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = getattr(self, "trainer", None)
        restoring = bool(args[0] if args else kwargs.get("checkpoint_path")) or bool(
            getattr(self, "_loaded_checkpoint", None))
        if trainer is None or _active.get(trainer) is None or not restoring or not steptrace.enabled():
            return original(self, *args, **kwargs)
        with steptrace.restore():
            return original(self, *args, **kwargs)

    return restore


def _batch_size(batch: Any) -> int | None:
    try:
        from lightning.pytorch.utilities.data import extract_batch_size
    except ImportError:
        from pytorch_lightning.utilities.data import extract_batch_size
    try:
        return int(extract_batch_size(batch))
    except Exception:
        return None


def _loss_of(outputs: Any) -> Any:
    if isinstance(outputs, dict):
        return outputs.get("loss")
    if hasattr(outputs, "device") and hasattr(outputs, "shape"):
        return outputs
    return None


class StepTrace(*_BASES):  # type: ignore[misc]
    """Lightning callback: optimizer steps, ``data``/``eval`` spans and checkpoint saves into steptrace.

    ``StepTrace(tokens_per_sample=None, **init_settings)``: ``init_settings`` are
    ``steptrace.init`` settings (used when this callback starts steptrace, in ``setup``);
    ``tokens_per_sample`` (an int, or a callable from a micro-batch to its token count) gives each
    step's ``tokens``. Bad values raise ``ValueError`` here, never in the loop.
    """

    def __init__(self, *, tokens_per_sample: int | Callable[[Any], int] | None = None,
                 **init_settings: Any) -> None:
        super().__init__()
        if tokens_per_sample is not None and not callable(tokens_per_sample) and (
                isinstance(tokens_per_sample, bool) or not isinstance(tokens_per_sample, int)
                or tokens_per_sample <= 0):
            raise ValueError(f"tokens_per_sample: expected a positive int or a callable, got {tokens_per_sample!r}")
        self.tokens_per_sample = tokens_per_sample
        self.init_settings = dict(init_settings)
        self._started = False
        self._reset()

    def _reset(self) -> None:
        self._handle: Any = None
        self._begin_global_step = 0
        self._samples: int | None = 0
        self._tokens: int | None = 0
        self._eval_span: Any = None
        self._data_span: Any = None
        self._data_seen = False
        self._data_checked = False
        self._profiler: Any = None

    # -- starting and stopping ------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if start_steptrace_for_trainer(self.init_settings, rank=int(getattr(trainer, "global_rank", 0) or 0),
                                       world_size=int(getattr(trainer, "world_size", 1) or 1)):
            self._started = True
        self._reset()
        _active[trainer] = self
        cls = _trainer_class(trainer)
        if cls is not None:
            _hooks.patch(f"{cls.__module__}.Trainer.save_checkpoint", cls, "save_checkpoint",
                         _make_save_checkpoint, requires=("filepath",))
            connectors = cls.__module__.rpartition(".")[0] + ".connectors.checkpoint_connector"
            # Loading the model and callbacks, then the optimizer, schedulers and loops: both restore.
            _hooks.patch(f"{connectors}._CheckpointConnector._restore_modules_and_callbacks", connectors,
                         "_CheckpointConnector._restore_modules_and_callbacks", _make_restore,
                         requires=("checkpoint_path",), missing_ok=True)
            _hooks.patch(f"{connectors}._CheckpointConnector.restore_training_state", connectors,
                         "_CheckpointConnector.restore_training_state", _make_restore, missing_ok=True)
        self._wrap_profiler(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer, exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer, None)

    def _finish(self, trainer: Any, exception: BaseException | None) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            if exception is None:
                handle.__exit__(None, None, None)
            else:
                handle.__exit__(type(exception), exception, exception.__traceback__)
        for attr in ("_data_span", "_eval_span"):
            span = getattr(self, attr)
            if span is not None:
                setattr(self, attr, None)
                span.__exit__(None, None, None)
        self._unwrap_profiler()
        if _active.get(trainer) is self:
            del _active[trainer]
        if not _active:
            _hooks.uninstall()
        if self._started:
            self._started = False
            steptrace.shutdown()

    # -- steps ----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not steptrace.enabled():
            return
        if self._handle is None:
            n = int(trainer.global_step)
            last = steptrace.last_step()
            if last is not None and n <= last:
                n = last + 1  # an optimizer step that did not advance global_step: keep numbers increasing
            self._begin_global_step = int(trainer.global_step)
            self._samples, self._tokens = 0, 0
            handle = steptrace.step(n)
            handle.__enter__()
            self._handle = handle
        size = _batch_size(batch)
        if self._samples is not None:
            self._samples = None if size is None else self._samples + size
        if callable(self.tokens_per_sample) and self._tokens is not None:
            try:
                self._tokens += int(self.tokens_per_sample(batch))
            except Exception:
                self._tokens = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check_data_spans()
        handle = self._handle
        if handle is None:
            return
        loss = _loss_of(outputs)
        # Waiting on the first micro-batch's loss also fixes the step's dispatch point there, so
        # the data spans of later micro-batches do not move its start (DESIGN.md section 2).
        if loss is not None:
            handle.wait_for(loss)
        else:
            handle.wait_for()
        if int(trainer.global_step) > self._begin_global_step or self._window_done(trainer, pl_module, batch_idx):
            self._close_step()

    @staticmethod
    def _window_done(trainer: Any, pl_module: Any, batch_idx: int) -> bool:
        # Automatic optimization steps every accumulate_grad_batches micro-batches; global_step
        # normally says so, this is for an optimizer_step override that skipped the update.
        if not getattr(pl_module, "automatic_optimization", True):
            return False
        every = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        return (batch_idx + 1) % every == 0

    def _close_step(self) -> None:
        handle, self._handle = self._handle, None
        samples = self._samples or None
        tokens = None
        if isinstance(self.tokens_per_sample, int) and samples is not None:
            tokens = samples * self.tokens_per_sample
        elif callable(self.tokens_per_sample):
            tokens = self._tokens
        # The step's counts are known only once its last micro-batch ran; the record is finalized
        # after the block exits, so they are set on the handle just before.
        handle.samples, handle.tokens = samples, tokens
        handle.__exit__(None, None, None)

    def _saved_step(self, trainer: Any) -> int:
        last = steptrace.last_step()
        return last if last is not None else max(int(trainer.global_step) - 1, 0)

    # -- validation -----------------------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if steptrace.enabled() and self._eval_span is None:
            self._eval_span = steptrace.span("eval")
            self._eval_span.__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        span, self._eval_span = self._eval_span, None
        if span is not None:
            span.__exit__(None, None, None)

    # -- data -----------------------------------------------------------------------------
    def _wrap_profiler(self, trainer: Any) -> None:
        profiler = getattr(trainer, "profiler", None)
        start, stop = getattr(profiler, "start", None), getattr(profiler, "stop", None)
        if not (callable(start) and callable(stop)):
            _hooks.disabled("data spans", "the trainer has no profiler start/stop")
            self._data_checked = True
            return
        if "action_name" not in (parameters(start) or ()) or "action_name" not in (parameters(stop) or ()):
            _hooks.disabled("data spans", "Profiler.start/stop do not take action_name")
            self._data_checked = True
            return

        def start_action(action_name: str) -> Any:
            if action_name.endswith(DATA_ACTION) and self._data_span is None and steptrace.enabled():
                self._data_seen = True
                span = steptrace.span("data")
                span.__enter__()
                self._data_span = span
            return start(action_name)

        def stop_action(action_name: str) -> Any:
            try:
                return stop(action_name)
            finally:
                if action_name.endswith(DATA_ACTION) and self._data_span is not None:
                    span, self._data_span = self._data_span, None
                    span.__exit__(None, None, None)

        # On this trainer's profiler object only (instance attributes shadow the class's methods).
        profiler.start, profiler.stop = start_action, stop_action
        self._profiler = profiler

    def _unwrap_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            for name in ("start", "stop"):
                profiler.__dict__.pop(name, None)

    def _check_data_spans(self) -> None:
        # After the first training batch the loop has fetched at least one batch through the
        # profiler action (a training_step taking dataloader_iter fetches inside the step).
        if self._data_checked or self._profiler is None:
            return
        self._data_checked = True
        if not self._data_seen:
            _hooks.disabled("data spans", f"the training loop reported no '{DATA_ACTION}' profiler action")
            self._unwrap_profiler()
