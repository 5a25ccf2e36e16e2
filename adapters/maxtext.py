"""MaxText drop-in hooks: device-true step, data, eval and checkpoint timings without editing MaxText.

One line::

    python -m steptrace.adapters.maxtext <the usual maxtext train arguments>

installs the hooks and runs MaxText's own train entry point
(``maxtext.trainers.pre_train.train.main``). From your own launcher, call
:func:`install` before MaxText's training loop starts.

Every hook replaces a module or class attribute (never a file), checked against
the signature it was written for (maxtext 0.2.5). A hook whose target has a
different signature, or is missing, disables itself with one warning naming the
function and the installed maxtext version; the others still run.

What each hook touches:

* ``maxtext.trainers.pre_train.train.training_loop_iteration`` (looked up by
  global name in ``train_loop``): the whole iteration is ``steptrace.step(n)``
  (``n = python_vars["step"]``). For the iteration only, the train-step
  programs in ``jax_device_state`` (``p_train_step`` and the dropless /
  first-phase variants) are wrapped so that ``wait_for`` receives
  ``metrics["scalar"]["learning/loss"]`` the moment the step is dispatched;
  the dict entries are put back afterwards. The loss is a fresh output, never
  the donated state.
* ``maxtext.common.metric_logger.MetricLogger.buffer_and_write_metrics``: the
  fallback ``wait_for(loss)`` for training metrics when no program was wrapped,
  and the end of an ``eval`` span.
* ``MetricLogger.mark_eval_loop_start``: opens that ``eval`` span.
* ``maxtext.common.data_loader.DataLoader.load_next_batch``: a ``data`` span.
* ``maxtext.common.checkpointing.save_checkpoint`` (called by global name from
  ``maybe_save_checkpoint``): a ``checkpoint`` record for the saved step. Its
  blocking part is the save's host time after the step's loss was ready; it
  lands in the next step's ``idle_breakdown["checkpoint"]``, never in compute.
* ``maxtext.common.checkpointing.load_state_if_possible`` (called as a module attribute by
  ``setup_training_state``, inside MaxText's ``TRAINING_PREPARATION`` goodput window): a restore
  (``steptrace.restore()``, the record Lightning's and HF's hooks write) with
  ``attrs["restored_step"]`` = the checkpoint step it loaded (``step``, or ``latest_step`` for
  ``-1``); a params-only load (``load_parameters_path``, ``load_full_state_path``) has no step of
  this run. Nothing to load: ``attrs["restored"] = False``. Orbax returns the restored arrays when
  they are read, so the restore is its blocking time; the next step is ``first_after_restore``.

Why wait on the loss at dispatch: MaxText's own ``seconds`` is the host time
between two dispatches (``datetime.now()`` after ``p_train_step`` returns), so
step 0 shows compile + dispatch, a step can look faster than the hardware, and
a checkpoint save (which blocks on the state) is charged to the next step.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Sequence

import steptrace
from steptrace.adapters._hooks import Hooks, NothingRestored, installed_version, start_steptrace, timed_restore

__all__ = ["install", "installed", "main", "uninstall"]

TRAIN_MODULE = "maxtext.trainers.pre_train.train"
CHECKPOINTING = "maxtext.common.checkpointing"
# jax_device_state entries that run a training step and return (state, metrics).
_TRAIN_PROGRAMS = ("p_train_step", "p_train_step_dropless", "p_train_step_first_phase")

_hooks = Hooks("MaxText", lambda: f"maxtext {maxtext_version()}")


def maxtext_version() -> str:
    return installed_version("maxtext") or "unknown"


def _require_maxtext() -> None:
    try:
        import maxtext  # noqa: F401
    except ImportError as exc:
        raise ImportError("steptrace.adapters.maxtext needs MaxText (Python >= 3.12): "
                          "pip install maxtext, plus its CPU/TPU/GPU dependencies "
                          "(see requirements-maxtext.txt or `make maxtext-env`)") from exc


# -- the hooks ------------------------------------------------------------------------

def _loss_of(metrics: Any) -> Any:
    try:
        return metrics["scalar"]["learning/loss"]
    except (KeyError, TypeError, IndexError):
        return None


def _wrap_program(program: Any, handle: Any) -> Any:
    def run_step(*args: Any, **kwargs: Any) -> Any:
        out = program(*args, **kwargs)
        try:
            loss = _loss_of(out[1])
        except (TypeError, IndexError, KeyError):
            loss = None
        if loss is not None:
            # The step's device work was just dispatched: wait on its loss now (a later
            # checkpoint save blocks on the state, and waiting after it would charge the
            # save to the step). Several programs in one step (a dropless replay): wait for all.
            handle.wait_for(loss)
        return out

    run_step.__wrapped__ = program
    return run_step


def _make_iteration(original: Any) -> Any:
    def training_loop_iteration(jax_device_state: Any, python_vars: Any, immutable_data: Any) -> Any:
        if not steptrace.enabled():
            return original(jax_device_state, python_vars, immutable_data)
        step = python_vars["step"]
        with steptrace.step(int(step), tokens=_tokens_per_step(immutable_data)) as handle:
            wrapped = {}
            for key in _TRAIN_PROGRAMS:
                program = jax_device_state.get(key)
                if program is not None:
                    wrapped[key] = program
                    jax_device_state[key] = _wrap_program(program, handle)
            try:
                return original(jax_device_state, python_vars, immutable_data)
            finally:
                for key, program in wrapped.items():
                    jax_device_state[key] = program

    return training_loop_iteration


_tokens_cache: dict[int, Any] = {}


def _tokens_per_step(immutable_data: Any) -> int | None:
    """This process's tokens per step, from the config (plain ints; never a device value)."""
    config = immutable_data.get("config") if isinstance(immutable_data, dict) else None
    if config is None:
        return None
    key = id(config)
    if key not in _tokens_cache:
        try:
            import jax

            tokens = int(config.global_batch_size_to_train_on) * int(config.max_target_length)
            _tokens_cache[key] = tokens // max(1, jax.process_count())
        except Exception:
            _tokens_cache[key] = None
    return _tokens_cache[key]


_eval_span: list[Any] = []  # the open eval span, if any


def _close_eval_span() -> None:
    while _eval_span:
        span = _eval_span.pop()
        try:
            span.__exit__(None, None, None)
        except Exception:
            pass


def _make_mark_eval(original: Any) -> Any:
    def mark_eval_loop_start(self: Any) -> Any:
        _close_eval_span()
        span = steptrace.span("eval")
        span.__enter__()
        _eval_span.append(span)
        return original(self)

    return mark_eval_loop_start


def _make_buffer_and_write(original: Any) -> Any:
    def buffer_and_write_metrics(self: Any, metrics: Any, step: Any, step_time_delta: Any = None,
                                 is_training: bool = True) -> Any:
        if is_training:
            _close_eval_span()
            handle = steptrace.current_step()
            if handle is not None and not handle.waited:
                loss = _loss_of(metrics)
                if loss is not None:
                    handle.wait_for(loss)
        return original(self, metrics, step, step_time_delta, is_training)

    return buffer_and_write_metrics


def _make_load_next_batch(original: Any) -> Any:
    def load_next_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        with steptrace.span("data"):
            return original(self, *args, **kwargs)

    return load_next_batch


def _make_save_checkpoint(original: Any) -> Any:
    def save_checkpoint(checkpoint_manager: Any, step: Any, state: Any, config: Any = None,
                        data_iterator: Any = None, force: bool = False) -> Any:
        # Asynchronous saves are reported by their blocking part only: MaxText offers no
        # completion callback to hang async_done() on.
        with steptrace.checkpoint(int(step)):
            return original(checkpoint_manager, step, state, config, data_iterator, force)

    return save_checkpoint


def _make_load_state(original: Any) -> Any:
    signature = inspect.signature(original)

    def load_state_if_possible(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(*args, **kwargs)
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # the call is MaxText's to reject
            return original(*args, **kwargs)
        manager, step = arguments.get("checkpoint_manager"), arguments.get("step", -1)

        def restored_step(result: Any) -> int | None:
            restored, params = result
            if restored is None and params is None:
                raise NothingRestored
            if restored is None or manager is None:
                return None  # parameters or state from another run's checkpoint path
            if isinstance(step, int) and step >= 0:
                return step
            latest = sys.modules[CHECKPOINTING].latest_step(manager)  # what MaxText restored for -1
            return None if latest is None else int(latest)

        return timed_restore(lambda: original(*args, **kwargs), restored_step)

    return load_state_if_possible


_HOOKS = (
    # name, module, attribute, expected parameters, wrapper factory
    ("training_loop_iteration", TRAIN_MODULE, "training_loop_iteration",
     ("jax_device_state", "python_vars", "immutable_data"), _make_iteration),
    ("MetricLogger.buffer_and_write_metrics", "maxtext.common.metric_logger",
     "MetricLogger.buffer_and_write_metrics",
     ("self", "metrics", "step", "step_time_delta", "is_training"), _make_buffer_and_write),
    ("MetricLogger.mark_eval_loop_start", "maxtext.common.metric_logger", "MetricLogger.mark_eval_loop_start",
     ("self",), _make_mark_eval),
    ("DataLoader.load_next_batch", "maxtext.common.data_loader", "DataLoader.load_next_batch",
     ("self", "args", "kwargs"), _make_load_next_batch),
    ("save_checkpoint", "maxtext.common.checkpointing", "save_checkpoint",
     ("checkpoint_manager", "step", "state", "config", "data_iterator", "force"), _make_save_checkpoint),
)


def install(**init_settings: Any) -> list[str]:
    """Install the MaxText hooks; returns the names of those installed.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given. Idempotent.
    """
    _require_maxtext()
    start_steptrace(init_settings)
    for name, module, attr, expected, make in _HOOKS:
        _hooks.patch(name, module, attr, make, exact=expected)
    # Called with MaxText's config spelled out as keywords: the hook reads two of them by name.
    _hooks.patch("load_state_if_possible", CHECKPOINTING, "load_state_if_possible", _make_load_state,
                 requires=("checkpoint_manager", "step"))
    return installed()


def installed() -> list[str]:
    return _hooks.installed()


def uninstall() -> None:
    """Put the original attributes back."""
    _hooks.uninstall()
    _close_eval_span()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m steptrace.adapters.maxtext <config.yml> key=value ...``: MaxText's train, hooked."""
    args = list(sys.argv[1:] if argv is None else argv)
    install()
    import importlib

    from absl import app

    train = importlib.import_module(TRAIN_MODULE)
    try:
        # MaxText's own entry point (`python -m maxtext.trainers.pre_train.train`) is app.run(main);
        # argv[0] is the program name, as there.
        app.run(train.main, argv=[TRAIN_MODULE] + args)
    finally:
        steptrace.shutdown()


if __name__ == "__main__":
    main()
