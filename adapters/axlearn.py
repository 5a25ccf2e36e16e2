"""AXLearn drop-in hooks: device-true step, data, eval, checkpoint and profiler timings without editing AXLearn.

Activation, no code change:

* current AXLearn (with ``axlearn.common.measurement``): its own recorder flag::

      python -m axlearn.common.launch_trainer_main --recorder_type=steptrace.adapters.axlearn:steptrace ...

  ``measurement.initialize`` imports this module, which registers the ``steptrace``
  recorder; the recorder's ``from_flags`` installs the hooks before the trainer is built.
* any AXLearn: ``python -m steptrace.adapters.axlearn <the usual launch_trainer_main flags>``
  installs the hooks and runs ``axlearn.common.launch_trainer_main`` as ``__main__``.
* your own launcher: call :func:`install` before ``trainer_config.instantiate(...)``
  (AXLearn binds a module's public methods when the module is built).

Every hook replaces a class attribute (never a file), checked against the signature it was
written for (axlearn 0.0.1.post20240213000026 on PyPI; the same signatures in AXLearn's current
source). A hook whose target has another signature, or is missing, turns itself off with one
warning naming the function and the installed axlearn version; training goes on.

What each hook touches:

* ``SpmdTrainer._run_step``: the step, ``steptrace.step(trainer.step)`` (the number AXLearn
  gives ``jax.profiler.StepTraceAnnotation``), ``tokens`` from ``input_ids``'s shape.
* The train program, so ``wait_for(outputs["loss"])`` happens the moment the step is dispatched
  (before the evalers and the checkpoint save block on the state): the function returned by
  ``SpmdTrainer._get_compiled_train_step_fn`` (current AXLearn), else ``trainer._jit_train_step``
  for the duration of ``_run_step`` (2024 releases). Fallback: the loss ``_run_step`` returns.
* ``SpmdTrainer._prepare_training``: after it (and after a restore that replaced the input
  iterator) the trainer's input iterator is wrapped so each ``next()`` is a ``data`` span. Not
  when ``save_input_iterator`` is set: the iterator itself goes into the checkpoint.
* ``SpmdTrainer.restore_checkpoint`` (called by ``_prepare_training`` between AXLearn's
  ``START_TRAINING_PREPARATION`` and ``END_TRAINING_PREPARATION`` events): a restore
  (``steptrace.restore()``, the record Lightning's and HF's hooks write) with
  ``attrs["restored_step"]`` = the step it returns; ``attrs["restored"] = False`` when it found no
  checkpoint (it returns None). The checkpointer's restore reads the state before it returns, so
  the span is the whole restore; the next step (restored step + 1) is ``first_after_restore``.
* ``SpmdTrainer._maybe_stop_or_start_tracing``: starting or stopping the profiler is a
  ``profile`` span, and the steps inside the trace carry ``attrs["profiler_trace"] = True``.
* ``SpmdEvaler.eval_step``: an ``eval`` span when the evaler's policy runs it (the policy is
  observed, not re-evaluated).
* ``Checkpointer.save``: ``steptrace.checkpoint(step, async_save=True)`` when the save policy
  saves; ``async_done()`` when the storage's ``on_commit_callback`` has run (the background
  tensorstore writes are committed).
* ``Checkpointer.wait_until_finished``: a ``checkpoint`` span (a blocking wait on background
  writes); saves still uncommitted after it are marked done at its end.

Why: ``SpmdTrainer.run``'s "Average step time" is ``perf_counter`` around ``_run_step``, which
returns once the step is dispatched; a save that blocks on the state lands in whichever step
follows, and a step can look faster than the hardware.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any, Sequence

import steptrace
from steptrace.adapters._hooks import Hooks, NothingRestored, installed_version, start_steptrace, timed_restore

__all__ = ["RECORDER_NAME", "install", "installed", "main", "uninstall"]

TRAINER = "axlearn.common.trainer"
EVALER = "axlearn.common.evaler"
CHECKPOINTER = "axlearn.common.checkpointer"
LAUNCH_MAIN = "axlearn.common.launch_trainer_main"
#: ``--recorder_type=steptrace.adapters.axlearn:steptrace``
RECORDER_NAME = "steptrace"

_hooks = Hooks("AXLearn", lambda: f"axlearn {axlearn_version()}")


def axlearn_version() -> str:
    return installed_version("axlearn") or "unknown"


def _require_axlearn() -> None:
    try:
        import axlearn.common.trainer  # noqa: F401
    except ImportError as exc:
        raise ImportError("steptrace.adapters.axlearn needs AXLearn and its jax/tensorflow pins: "
                          "pip install axlearn (see requirements-axlearn.txt or `make axlearn-env`)") from exc


# -- steps and the train program ---------------------------------------------------------

def _loss_of(outputs: Any) -> Any:
    try:
        return outputs["loss"]
    except (KeyError, TypeError, IndexError):
        return None


def _waiting(program: Any, handle: Any) -> Any:
    """``program`` (returns ``(trainer_state, outputs)``), calling ``handle.wait_for(loss)`` at dispatch."""

    def train_step(*args: Any, **kwargs: Any) -> Any:
        out = program(*args, **kwargs)
        try:
            loss = _loss_of(out[1])
        except (TypeError, IndexError):
            loss = None
        if loss is not None:
            # The loss is a fresh output, never the donated trainer state.
            handle.wait_for(loss)
        return out

    train_step.__wrapped__ = program
    return train_step


def _tokens(input_batch: Any) -> int | None:
    """This process's tokens per step: ``input_ids``'s shape (a shape, never a device value)."""
    try:
        shape = input_batch["input_ids"].shape
        import jax

        tokens = 1
        for dim in shape:
            tokens *= int(dim)
        return tokens // max(1, jax.process_count())
    except Exception:
        return None


_trace_window: list[int] = []  # [first, last] step of the running profiler trace, if any


def _make_run_step(original: Any) -> Any:
    def _run_step(self: Any, input_batch: Any, *, force_run_evals: Any = None) -> Any:
        if not steptrace.enabled():
            return original(self, input_batch, force_run_evals=force_run_evals)
        n = int(self.step)
        attrs = {"profiler_trace": True} if _trace_window and _trace_window[0] <= n <= _trace_window[1] else {}
        with steptrace.step(n, tokens=_tokens(input_batch), **attrs) as handle:
            # 2024 releases call the pjit-ed program stored on the instance; current AXLearn
            # calls what _get_compiled_train_step_fn returns (hooked on the class).
            swapped = None
            if _hooks.hooked("SpmdTrainer._get_compiled_train_step_fn") is None:
                program = self.__dict__.get("_jit_train_step")
                if callable(program):
                    swapped = program
                    self._jit_train_step = _waiting(program, handle)
            try:
                out = original(self, input_batch, force_run_evals=force_run_evals)
            finally:
                if swapped is not None:
                    self._jit_train_step = swapped
            if not getattr(handle, "waited", True):
                loss = _loss_of(out)
                if loss is not None:
                    handle.wait_for(loss)
            return out

    return _run_step


def _make_get_compiled(original: Any) -> Any:
    def _get_compiled_train_step_fn(self: Any, *, trainer_state: Any, input_batch: Any,
                                    with_xsc: bool = False) -> Any:
        program = original(self, trainer_state=trainer_state, input_batch=input_batch, with_xsc=with_xsc)
        handle = steptrace.current_step()
        return program if handle is None else _waiting(program, handle)

    return _get_compiled_train_step_fn


# -- data ------------------------------------------------------------------------------------

class _TimedIterator:
    """The trainer's input iterator; each ``next()`` is a ``data`` span."""

    __steptrace_hook__ = True

    def __init__(self, inner: Any):
        self.inner = inner

    def __iter__(self) -> "_TimedIterator":
        return self

    def __next__(self) -> Any:
        with steptrace.span("data"):
            return next(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _make_prepare_training(original: Any) -> Any:
    def _prepare_training(self: Any, prng_key: Any) -> Any:
        ready = original(self, prng_key)
        it = self.__dict__.get("_input_iter")
        if (ready and it is not None and not isinstance(it, _TimedIterator)
                and not getattr(self.config, "save_input_iterator", False)):
            self._input_iter = _TimedIterator(it)
        return ready

    return _prepare_training


# -- profiler trace window --------------------------------------------------------------------

def _make_tracing(original: Any) -> Any:
    def _maybe_stop_or_start_tracing(self: Any, stop_trace_step: Any, output: Any) -> Any:
        step = self.step
        # AXLearn stops when step == stop_trace_step (blocking on the last traced step's output)
        # and starts when step is in start_trace_steps; both run before the next step opens.
        acting = step == stop_trace_step or step in (getattr(self.config, "start_trace_steps", None) or ())
        if not acting:
            return original(self, stop_trace_step, output)
        with steptrace.span("profile"):
            new_stop = original(self, stop_trace_step, output)
        if stop_trace_step is not None and step == stop_trace_step:
            _trace_window.clear()
        if new_stop is not None and new_stop != stop_trace_step:
            # Traced: the steps after this one up to new_stop (AXLearn increments the step next).
            _trace_window[:] = [int(step) + 1, int(new_stop)]
        return new_stop

    return _maybe_stop_or_start_tracing


# -- eval --------------------------------------------------------------------------------------

class _ObservedPolicy:
    """Calls the evaler's (or checkpointer's) own policy once; on True, calls ``on_true``."""

    def __init__(self, policy: Any, on_true: Any):
        self.policy = policy
        self.on_true = on_true

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decision = self.policy(*args, **kwargs)
        if decision:
            self.on_true()
        return decision


def _make_eval_step(original: Any) -> Any:
    def eval_step(self: Any, step: Any, *, prng_key: Any, model_params: Any, return_aux: bool = False,
                  train_summaries: Any = None, force_run: bool = False) -> Any:
        opened: list[Any] = []

        def open_span() -> None:
            span = steptrace.span("eval", evaler=str(getattr(self.config, "name", "")))
            span.__enter__()
            opened.append(span)

        policy = self.__dict__.get("_eval_policy")
        if force_run:
            open_span()
        elif policy is not None:
            self._eval_policy = _ObservedPolicy(policy, open_span)
        try:
            return original(self, step, prng_key=prng_key, model_params=model_params, return_aux=return_aux,
                            train_summaries=train_summaries, force_run=force_run)
        finally:
            if policy is not None:
                self._eval_policy = policy
            for span in opened:
                span.__exit__(None, None, None)

    return eval_step


# -- checkpoints -------------------------------------------------------------------------------

_pending: dict[int, list[Any]] = {}  # id(checkpointer) -> its saves whose commit is not seen yet


def _commit_done(owner: int, ckpt: Any) -> None:
    ckpt.async_done()
    saves = _pending.get(owner)
    if saves and ckpt in saves:
        saves.remove(ckpt)


def _make_save(original: Any) -> Any:
    def save(self: Any, *, step: Any, state: Any, evaler_summaries: Any = None) -> Any:
        if not steptrace.enabled():
            return original(self, step=step, state=state, evaler_summaries=evaler_summaries)
        owner = id(self)
        opened: list[Any] = []

        def open_checkpoint() -> None:
            ckpt = steptrace.checkpoint(int(step), async_save=True)
            ckpt.__enter__()
            opened.append(ckpt)

        policy = self.__dict__.get("_save_policy")
        storage = self.__dict__.get("_storage")
        if policy is None or storage is None:
            return original(self, step=step, state=state, evaler_summaries=evaler_summaries)
        self._save_policy = _ObservedPolicy(policy, open_checkpoint)
        save_to_dir = storage.save_to_dir

        def committing_save_to_dir(*args: Any, on_commit_callback: Any = None, **kwargs: Any) -> Any:
            if on_commit_callback is None or not opened:
                return save_to_dir(*args, **kwargs) if on_commit_callback is None else \
                    save_to_dir(*args, on_commit_callback=on_commit_callback, **kwargs)
            ckpt = opened[0]

            def on_commit(*cargs: Any, **ckwargs: Any) -> Any:
                # Runs on the storage's background thread once every write has committed.
                try:
                    return on_commit_callback(*cargs, **ckwargs)
                finally:
                    _commit_done(owner, ckpt)

            return save_to_dir(*args, on_commit_callback=on_commit, **kwargs)

        storage.save_to_dir = committing_save_to_dir  # this call only; the class is untouched
        try:
            return original(self, step=step, state=state, evaler_summaries=evaler_summaries)
        except BaseException as exc:
            for ckpt in opened:
                ckpt.__exit__(type(exc), exc, exc.__traceback__)
            opened.clear()
            raise
        finally:
            self._save_policy = policy
            try:
                del storage.save_to_dir
            except AttributeError:
                pass
            for ckpt in opened:
                if getattr(ckpt, "async_end", 0) is None:
                    _pending.setdefault(owner, []).append(ckpt)
                ckpt.__exit__(None, None, None)

    return save


def _make_wait(original: Any) -> Any:
    def wait_until_finished(self: Any) -> Any:
        if not steptrace.enabled():
            return original(self)
        with steptrace.span("checkpoint"):
            out = original(self)
        # Every background write has finished; a storage that never called its commit
        # callback gets its saves closed here (an upper bound on their commit time).
        for ckpt in _pending.pop(id(self), []):
            ckpt.async_done()
        return out

    return wait_until_finished


# -- the recorder (AXLearn's measurement registry) ---------------------------------------------

def _register_recorder() -> bool:
    """Register the ``steptrace`` recorder with AXLearn's measurement registry, where it exists."""
    try:
        from axlearn.common import measurement_base as base
    except ImportError:
        return False
    recorders = getattr(base, "_recorders", None)
    if isinstance(recorders, dict) and RECORDER_NAME in recorders:
        return True

    class SteptraceRecorder(base.Recorder):
        """``--recorder_type=steptrace.adapters.axlearn:steptrace``: installs the steptrace hooks.

        The hooks time steps, data, eval and checkpoints themselves (device-true, which the
        recorder's events are not); the recorder is how AXLearn's launcher turns them on.
        Configure steptrace with ``STEPTRACE_*`` variables.
        """

        @classmethod
        def from_flags(cls, fv: Any) -> "SteptraceRecorder":
            install()
            return cls.default_config().set(name=RECORDER_NAME).instantiate()

        def record(self, event: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(event, "name", None) == "END_JOB":
                steptrace.flush()

        def start_monitoring(self, **kwargs: Any) -> None:
            pass

    SteptraceRecorder.__module__ = __name__
    base.register_recorder(RECORDER_NAME)(SteptraceRecorder)
    globals()["SteptraceRecorder"] = SteptraceRecorder
    return True


def _make_restore_checkpoint(original: Any) -> Any:
    def restored_step(step: Any) -> int:
        if step is None:
            raise NothingRestored
        return int(step)

    def restore_checkpoint(self: Any, restore_step: Any = None) -> Any:
        if not steptrace.enabled():
            return original(self, restore_step)
        return timed_restore(lambda: original(self, restore_step), restored_step)

    return restore_checkpoint


_HOOKS = (
    # name, module, attribute, expected parameters, wrapper factory, missing_ok
    ("SpmdTrainer._run_step", TRAINER, "SpmdTrainer._run_step",
     ("self", "input_batch", "force_run_evals"), _make_run_step, False),
    # Current AXLearn only (2024 releases call self._jit_train_step directly).
    ("SpmdTrainer._get_compiled_train_step_fn", TRAINER, "SpmdTrainer._get_compiled_train_step_fn",
     ("self", "trainer_state", "input_batch", "with_xsc"), _make_get_compiled, True),
    ("SpmdTrainer._prepare_training", TRAINER, "SpmdTrainer._prepare_training",
     ("self", "prng_key"), _make_prepare_training, False),
    ("SpmdTrainer.restore_checkpoint", TRAINER, "SpmdTrainer.restore_checkpoint", ("self", "restore_step"),
     _make_restore_checkpoint, False),
    ("SpmdTrainer._maybe_stop_or_start_tracing", TRAINER, "SpmdTrainer._maybe_stop_or_start_tracing",
     ("self", "stop_trace_step", "output"), _make_tracing, False),
    ("SpmdEvaler.eval_step", EVALER, "SpmdEvaler.eval_step",
     ("self", "step", "prng_key", "model_params", "return_aux", "train_summaries", "force_run"),
     _make_eval_step, False),
    ("Checkpointer.save", CHECKPOINTER, "Checkpointer.save",
     ("self", "step", "state", "evaler_summaries"), _make_save, False),
    ("Checkpointer.wait_until_finished", CHECKPOINTER, "Checkpointer.wait_until_finished",
     ("self",), _make_wait, False),
)


def install(**init_settings: Any) -> list[str]:
    """Install the AXLearn hooks; returns the names of those installed.

    Call it before the trainer is instantiated. The contract of every steptrace framework hook
    (``steptrace.adapters._hooks``): starts steptrace with ``init_settings`` (and ``STEPTRACE_*``)
    unless it is already running and no settings are given. Idempotent.
    """
    _require_axlearn()
    start_steptrace(init_settings)
    for name, module, attr, expected, make, missing_ok in _HOOKS:
        _hooks.patch(name, module, attr, make, exact=expected, missing_ok=missing_ok)
    _register_recorder()
    return installed()


def installed() -> list[str]:
    return _hooks.installed()


def uninstall() -> None:
    """Put the original attributes back (trainers built meanwhile keep the hooks they bound)."""
    _hooks.uninstall()
    _trace_window.clear()
    _pending.clear()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m steptrace.adapters.axlearn --module=... --config=... --trainer_dir=...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    install()
    sys.argv = [LAUNCH_MAIN] + args
    try:
        # AXLearn's own entry point, as `python -m axlearn.common.launch_trainer_main` runs it.
        runpy.run_module(LAUNCH_MAIN, run_name="__main__", alter_sys=True)
    finally:
        steptrace.shutdown()


# measurement.initialize() imports this module for `--recorder_type=steptrace.adapters.axlearn:steptrace`
# and then looks the name up: register now when AXLearn's registry is already loaded.
if "axlearn.common.measurement_base" in sys.modules:
    _register_recorder()

if __name__ == "__main__":
    main()
