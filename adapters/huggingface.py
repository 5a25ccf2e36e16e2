"""Hugging Face Transformers: a ``TrainerCallback`` that records optimizer steps, data waits, eval and saves.

One line::

    trainer = transformers.Trainer(..., callbacks=[steptrace.adapters.huggingface.StepTrace()])

What it records:

* **Steps.** One ``steptrace.step(n)`` per *optimizer step*, ``n = state.global_step`` when it
  begins (0, 1, 2, ...): opened at ``on_step_begin`` and closed at ``on_step_end``, which the
  Trainer calls once per ``gradient_accumulation_steps`` micro-batches (``on_substep_end`` marks
  the others), after the optimizer update and ``zero_grad``. ``samples`` is the sum of the
  step's micro-batch sizes; ``tokens`` is the step's share of ``state.num_input_tokens_seen``
  (when ``include_num_input_tokens_seen`` is on; the Trainer sums it over processes, so it is
  divided by ``world_size``). Each micro-batch's loss (``Trainer.training_step``'s result) is
  passed to ``wait_for``: CPU tensors make the step host-timed, CUDA tensors CUDA-event-timed.
* **Data.** ``Trainer.get_batch_samples`` fetches all of an optimizer step's micro-batches
  before ``on_step_begin``; it runs in a ``data`` span, so the wait is the step's
  ``idle_breakdown["data"]``.
* **Eval.** ``Trainer.evaluate`` and ``Trainer.predict`` run in an ``eval`` span (the callback
  API only says when evaluation ended, ``on_evaluate``).
* **Checkpoints.** ``Trainer._save_checkpoint`` (model, optimizer, scheduler, RNG and trainer
  state) runs in ``steptrace.checkpoint(step)`` for the last step run, so ``blocking_seconds``
  is the save's host time after that step's end. ``on_save`` cannot do this: the Trainer calls it
  after saving. The ``checkpoint-N`` folder holds the state after N optimizer steps, i.e. after
  steptrace step ``N - 1``.

The four ``Trainer`` methods are patched on the class through ``steptrace.adapters._hooks``
(only trainers that have this callback are affected; subclasses reach them through ``super()``).
A transformers version whose method lacks a parameter the hook reads turns that hook off with
one ``SteptraceWarning`` naming the version; training and the other hooks go on. They are
installed when a Trainer is built with the callback (``on_init_end``) or at ``on_train_begin``.

Steptrace starts at ``on_train_begin``, per the contract every steptrace hook follows
(``adapters/_hooks.start_steptrace``): with ``init_settings`` (and ``STEPTRACE_*``) unless it is
already running and no settings were given; ``args.process_index``/``args.world_size`` fill in
``rank``/``world_size`` when neither the settings nor the environment give them. It is shut
down (flushed) at ``on_train_end`` only if this callback started it.
"""

from __future__ import annotations

from typing import Any, Callable

import steptrace
from steptrace.adapters._hooks import Hooks, start_steptrace_for_trainer

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("steptrace.adapters.huggingface needs Hugging Face Transformers: "
                      "pip install 'steptrace[huggingface]' (transformers and accelerate)") from exc

__all__ = ["StepTrace", "installed", "uninstall"]


def transformers_version() -> str:
    return f"transformers {getattr(transformers, '__version__', 'unknown')}"


_hooks = Hooks("Hugging Face", transformers_version)


def _callback_of(trainer: Any, *, enabled_only: bool = True) -> "StepTrace | None":
    """The StepTrace callback of ``trainer``, when it has one and steptrace is on (``enabled_only``)."""
    if enabled_only and not steptrace.enabled():
        return None
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        if isinstance(callback, StepTrace):
            return callback
    return None


def _make_restore(original: Callable[..., Any]) -> Callable[..., Any]:
    """``train(resume_from_checkpoint=...)``: loading the model, optimizer, scheduler and RNG states in
    ``steptrace.restore()``. The Trainer restores before ``on_train_begin``, so the callback starts
    steptrace here (as it would there): the restore is timed, and charged to ``restore`` in the
    job's accounting (docs/goodput.md)."""

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint = args[0] if args else next(iter(kwargs.values()), None)
        callback = _callback_of(self, enabled_only=False)
        if callback is None or not checkpoint:
            return original(self, *args, **kwargs)
        callback._start(self.args)
        if not steptrace.enabled():
            return original(self, *args, **kwargs)
        with steptrace.restore():
            return original(self, *args, **kwargs)

    return load


def _batch_size(batch: Any, main_input: str) -> int | None:
    value = None
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        try:
            value = batch[main_input] if main_input in batch else next(
                (v for v in batch.values() if hasattr(v, "shape")), None)
        except Exception:
            value = None
    elif isinstance(batch, (list, tuple)) and batch:
        value = batch[0]
    elif hasattr(batch, "shape"):
        value = batch
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape else None


# -- the hooks ----------------------------------------------------------------------------
def _make_get_batch_samples(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_batch_samples(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _callback_of(self)
        if callback is None:
            return original(self, *args, **kwargs)
        with steptrace.span("data"):
            result = original(self, *args, **kwargs)
        try:
            main_input = getattr(self.model, "main_input_name", "input_ids")
            sizes = [_batch_size(b, main_input) for b in result[0]]
            callback._fetched_samples = None if None in sizes else sum(sizes)
        except Exception:
            callback._fetched_samples = None
        return result

    return get_batch_samples


def _make_training_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        loss = original(self, *args, **kwargs)
        callback = _callback_of(self)
        handle = None if callback is None else callback._handle
        if handle is not None and steptrace.current_step() is handle and hasattr(loss, "device"):
            handle.wait_for(loss)
        return loss

    return training_step


def _make_eval(original: Callable[..., Any]) -> Callable[..., Any]:
    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _callback_of(self)
        if callback is None or callback._in_eval:
            return original(self, *args, **kwargs)
        callback._in_eval = True
        try:
            with steptrace.span("eval"):
                return original(self, *args, **kwargs)
        finally:
            callback._in_eval = False

    return evaluate


def _make_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _callback_of(self)
        if callback is None:
            return original(self, *args, **kwargs)
        last = steptrace.last_step()
        step = last if last is not None else max(int(self.state.global_step) - 1, 0)
        with steptrace.checkpoint(step):
            return original(self, *args, **kwargs)

    return _save_checkpoint


_HOOKS = (
    # hook name, Trainer attribute, parameters it reads (requires) or the whole list (exact), factory
    ("Trainer._save_checkpoint", "_save_checkpoint", {"requires": ("model", "trial")}, _make_save_checkpoint),
    ("Trainer.get_batch_samples", "get_batch_samples", {"requires": ("epoch_iterator", "num_batches")},
     _make_get_batch_samples),
    ("Trainer.training_step", "training_step", {"requires": ("model", "inputs")}, _make_training_step),
    ("Trainer.evaluate", "evaluate", {}, _make_eval),
    ("Trainer.predict", "predict", {}, _make_eval),
    ("Trainer._load_from_checkpoint", "_load_from_checkpoint", {"requires": ("resume_from_checkpoint",)},
     _make_restore),
    ("Trainer._load_optimizer_and_scheduler", "_load_optimizer_and_scheduler", {"requires": ("checkpoint",)},
     _make_restore),
    ("Trainer._load_rng_state", "_load_rng_state", {"requires": ("checkpoint",)}, _make_restore),
)


_checked = False  # the signatures are checked once per process, so a mismatch warns once


def install() -> list[str]:
    """Patch the Trainer methods (idempotent); returns the hooks installed. The callback calls it."""
    global _checked
    if not _checked:
        _checked = True
        for name, attribute, check, make in _HOOKS:
            _hooks.patch(name, transformers.Trainer, attribute, make, **check)
    return installed()


def installed() -> list[str]:
    return _hooks.installed()


def uninstall() -> None:
    """Put the original Trainer methods back."""
    global _checked
    _hooks.uninstall()
    _checked = False


# -- the callback -------------------------------------------------------------------------
class StepTrace(TrainerCallback):
    """Transformers ``Trainer`` callback: optimizer steps, ``data``/``eval`` spans and checkpoints.

    ``StepTrace(**init_settings)``: ``steptrace.init`` settings, used when this callback starts
    steptrace (at ``on_train_begin``).
    """

    def __init__(self, **init_settings: Any) -> None:
        self.init_settings = dict(init_settings)
        self._started = False
        self._handle: Any = None
        self._fetched_samples: int | None = None
        self._micro_batches = 0
        self._tokens_at_end = 0
        self._in_eval = False

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        install()  # a changed transformers warns when the Trainer is built, not mid-run

    def _start(self, args: Any) -> None:
        """Start steptrace per the hooks' contract, once per training run (at ``on_train_begin``, or
        earlier when the Trainer restores a checkpoint first)."""
        if self._started:
            return
        # The Trainer logs (to its trackers) at global_step after the update; steptrace's step n is the
        # update that makes global_step n + 1: a tracker of steptrace's writes on the Trainer's axis.
        # (Only where this callback starts steptrace: a run the user started keeps the user's settings.)
        settings = dict(self.init_settings)
        if settings or not steptrace.enabled():
            settings.setdefault("tracker_step_offset", 1)
        if start_steptrace_for_trainer(settings, rank=int(getattr(args, "process_index", 0) or 0),
                                       world_size=int(getattr(args, "world_size", 1) or 1)):
            self._started = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start(args)
        install()
        self._tokens_at_end = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not steptrace.enabled() or self._handle is not None:
            return
        n = int(state.global_step)
        last = steptrace.last_step()
        if last is not None and n <= last:
            n = last + 1  # keep step numbers increasing (a second train() on the same process)
        samples, self._fetched_samples = self._fetched_samples, None
        if samples is None and "Trainer.get_batch_samples" not in installed():
            # Without the data hook: full micro-batches (the last step of an epoch may hold fewer).
            samples = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
        handle = steptrace.step(n, samples=samples)
        handle.__enter__()
        self._handle = handle

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None):
            # Counted from one step end to the next: transformers 4.x counts a micro-batch's
            # tokens before on_step_begin, 5.x after it. Known only once the step ran; the
            # record is finalized after the block exits, so it is set on the handle just before.
            handle.tokens = max(seen - self._tokens_at_end, 0) // max(int(getattr(args, "world_size", 1) or 1), 1)
        self._tokens_at_end = seen
        handle.__exit__(None, None, None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.__exit__(None, None, None)
        if self._started:
            self._started = False
            steptrace.shutdown()
