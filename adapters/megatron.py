"""Megatron: drop-in hooks that turn Megatron's pipeline schedules into steptrace records.

::

    import steptrace
    import steptrace.adapters.megatron

    steptrace.init()
    steptrace.adapters.megatron.install()   # one line at the top of pretrain_*.py

What is hooked (module attributes are replaced; no file is edited), checked
against megatron-core 0.16.1:

- ``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``
  (and the same name re-exported by ``megatron.core.pipeline_parallel``): the
  function it returns is wrapped so that each call, one training iteration
  through the pipeline schedule, is a ``steptrace.step``. A call with
  ``forward_only=True`` (evaluation) is an ``eval`` span instead, and when a
  step is already open (``train_step`` below) the call runs inside it.
- ``schedules.forward_step`` and ``schedules.backward_step``: every schedule
  (no pipelining, 1F1B, interleaved 1F1B) calls them by their module-global
  name, so each call is a ``steptrace.microbatch`` record with ``stage`` (the
  pipeline rank), ``chunk`` (``vp_stage``, the virtual stage), ``microbatch``
  (``current_microbatch``) and ``kind``. ``backward_step`` is not told which
  microbatch or chunk it runs: the schedule hands it back the very output
  object ``forward_step`` returned for that microbatch, so backward calls are
  paired with their forward by that object's identity (in schedule order per
  chunk, first-in first-out, when the object is not recognised).
- With Megatron-LM's ``megatron.training`` importable (it is not part of the
  ``megatron-core`` wheel; without it these hooks are skipped silently):
  ``training.train_step`` (the step, so the optimizer update is inside it),
  ``training.save_checkpoint_and_time`` (a ``steptrace.checkpoint`` of the last
  step; with ``--async-save`` the blocking part only) and
  ``async_utils.maybe_finalize_async_save`` (its blocking waits are
  ``checkpoint`` spans; when no save is left pending, the async saves are
  reported done, so background commit time is never charged to a step).

Timing: on CUDA the microbatches are timed with CUDA events like steps; on CPU
torch they are host-timed (the work is synchronous). Per step and stage the
step record carries ``pipeline_bubble_ratio`` = 1 − Σ microbatch compute /
step compute: time a stage spends outside ``forward_step``/``backward_step``
(waiting on p2p communication, the pipeline fill and drain) is bubble.

A hook whose target's signature differs from what it expects disables itself
with one ``SteptraceWarning`` naming the function and the megatron-core
version; the run continues without that hook.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import steptrace
from steptrace.adapters._hooks import Hooks, start_steptrace

__all__ = ["install", "installed", "uninstall"]

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_PIPELINE_PACKAGE = "megatron.core.pipeline_parallel"
_TRAINING = "megatron.training.training"
_ASYNC_UTILS = "megatron.training.async_utils"

# Parameters each hook reads, by target. A target lacking one is a different API.
_EXPECTED = {
    "forward_step": ("forward_step_func", "data_iterator", "model", "current_microbatch", "vp_stage"),
    "backward_step": ("input_tensor", "output_tensor", "output_tensor_grad"),
    "get_forward_backward_func": (),
    "train_step": (),
    "save_checkpoint_and_time": ("iteration",),
    "maybe_finalize_async_save": ("blocking",),
}

_hooks = Hooks("Megatron", lambda: _megatron_version())


def require_megatron() -> Any:
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError as exc:
        raise ImportError("steptrace's Megatron hooks need megatron-core: "
                          "pip install 'steptrace[megatron]' (or megatron-core)") from exc
    return schedules


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return f"megatron-core {version('megatron-core')}"
    except Exception:
        return "megatron-core (version unknown)"


def _arg_reader(fn: Any, name: str) -> Callable[[tuple, dict], Any]:
    """A fast reader of argument ``name`` (keyword or positional) of calls to ``fn``."""
    params = list(inspect.signature(fn).parameters.values())
    index = [p.name for p in params].index(name)
    default = params[index].default
    default = None if default is inspect.Parameter.empty else default

    def read(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        if len(args) > index:
            return args[index]
        return default

    return read


def _current_step() -> Any:
    """The open steptrace step of this process, or None (also when steptrace is off)."""
    return steptrace.current_step()


def _pipeline_rank() -> int | None:
    try:
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_rank()
    except Exception:
        return None


class _State:
    """Per-process hook state: step numbering and the forward/backward pairing of one step."""

    def __init__(self) -> None:
        self.next_step = 0
        self.stage: int | None = None
        # id(forward output) -> (output, microbatch, chunk); the output is held so its id stays unique.
        self.by_output: dict[int, tuple[Any, Any, Any]] = {}
        self.fifo: dict[Any, list[int]] = {}  # chunk -> output ids not yet paired, in schedule order
        self.pending_async: list[Any] = []  # checkpoint handles of async saves not finalized yet

    def reset_pairing(self) -> None:
        self.by_output.clear()
        self.fifo.clear()

    def take_step_number(self, wanted: Any = None) -> int:
        n = self.next_step
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted >= n:
            n = wanted
        self.next_step = n + 1
        return n


_state = _State()


def _wrap_forward_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "__steptrace_wrapped__", False):
        return fn

    @functools.wraps(fn)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return fn(*args, **kwargs)
        _state.stage = _pipeline_rank()
        _state.reset_pairing()
        try:
            if _current_step() is not None:
                return fn(*args, **kwargs)  # inside train_step's step (or the user's own)
            if kwargs.get("forward_only"):
                with steptrace.span("eval"):
                    return fn(*args, **kwargs)
            with steptrace.step(_state.take_step_number()):
                return fn(*args, **kwargs)
        finally:
            _state.reset_pairing()

    forward_backward.__steptrace_wrapped__ = True  # type: ignore[attr-defined]
    return forward_backward


def _hook_get_forward_backward_func(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return _wrap_forward_backward(original(*args, **kwargs))

    return get_forward_backward_func


def _output_keys(output: Any) -> tuple[int, ...]:
    # forward_step returns [tensor] (or the tensor); the schedule passes that same object,
    # or its element, to backward_step.
    if isinstance(output, (list, tuple)) and output:
        return (id(output), id(output[0]))
    return (id(output),)


def _hook_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    read_microbatch = _arg_reader(original, "current_microbatch")
    read_chunk = _arg_reader(original, "vp_stage")

    @functools.wraps(original)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        if _current_step() is None:
            return original(*args, **kwargs)  # eval outside a step, or steptrace off
        index = read_microbatch(args, kwargs)
        chunk = read_chunk(args, kwargs)
        with steptrace.microbatch(index, stage=_state.stage, chunk=chunk, kind="forward"):
            result = original(*args, **kwargs)
        output = result[0] if isinstance(result, tuple) and len(result) == 2 else result
        keys = _output_keys(output)
        entry = (output, index, chunk)
        for key in keys:
            _state.by_output[key] = entry
        _state.fifo.setdefault(chunk, []).append(keys[0])
        return result

    return forward_step


def _pair_backward(output: Any) -> tuple[Any, Any]:
    """(microbatch, chunk) of the forward whose output ``backward_step`` was given."""
    entry = None
    for key in _output_keys(output):
        entry = _state.by_output.get(key)
        if entry is not None:
            break
    if entry is None:
        # Not recognised (a schedule that copies outputs): the oldest unpaired forward, in
        # schedule order, which is the 1F1B order within a chunk.
        for queue in _state.fifo.values():
            while queue:
                entry = _state.by_output.get(queue[0])
                if entry is not None:
                    break
                queue.pop(0)
            if entry is not None:
                break
    if entry is None:
        return None, None
    _, index, chunk = entry
    for key in _output_keys(entry[0]):
        _state.by_output.pop(key, None)
    queue = _state.fifo.get(chunk)
    if queue:
        first = _output_keys(entry[0])[0]
        if queue[0] == first:
            queue.pop(0)
        elif first in queue:
            queue.remove(first)
    return index, chunk


def _hook_backward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    read_output = _arg_reader(original, "output_tensor")

    @functools.wraps(original)
    def backward_step(*args: Any, **kwargs: Any) -> Any:
        if _current_step() is None:
            return original(*args, **kwargs)
        index, chunk = _pair_backward(read_output(args, kwargs))
        with steptrace.microbatch(index, stage=_state.stage, chunk=chunk, kind="backward"):
            return original(*args, **kwargs)

    return backward_step


# -- megatron.training (Megatron-LM), when importable -------------------------------------
def _hook_train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or _current_step() is not None:
            return original(*args, **kwargs)
        with steptrace.step(_state.take_step_number(kwargs.get("iteration"))):
            return original(*args, **kwargs)

    return train_step


def _async_save_on() -> bool:
    try:
        from megatron.training import get_args

        return bool(getattr(get_args(), "async_save", False))
    except Exception:
        return False


def _hook_save_checkpoint_and_time(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint_and_time(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(*args, **kwargs)
        # The save holds the state after the last step run; steptrace ties it to that step.
        step = steptrace.last_step()
        if step is None:
            step = max(_state.next_step - 1, 0)
        async_save = _async_save_on()
        with steptrace.checkpoint(step, async_save=async_save) as ckpt:
            result = original(*args, **kwargs)
        if async_save:
            _state.pending_async.append(ckpt)
        return result

    return save_checkpoint_and_time


def _unfinalized_async_saves(module: Any) -> int | None:
    queue = getattr(module, "_async_calls_queue", None)
    count = getattr(queue, "get_num_unfinalized_calls", None)
    try:
        return int(count()) if callable(count) else None
    except Exception:
        return None


def _hook_maybe_finalize_async_save(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    read_blocking = _arg_reader(original, "blocking")

    @functools.wraps(original)
    def maybe_finalize_async_save(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(*args, **kwargs)
        if read_blocking(args, kwargs) and _state.pending_async:
            with steptrace.span("checkpoint"):  # the training thread waits for the commit
                result = original(*args, **kwargs)
        else:
            result = original(*args, **kwargs)
        left = _unfinalized_async_saves(module)
        if left == 0 or (left is None and read_blocking(args, kwargs)):
            pending, _state.pending_async = _state.pending_async, []
            for ckpt in pending:
                ckpt.async_done()
        return result

    return maybe_finalize_async_save


# -- installation ---------------------------------------------------------------------
def _patch(module: Any, name: str, make: Callable[[Any], Any], rebind_in: tuple = ()) -> bool:
    # Megatron-LM's modules are optional (not in the megatron-core wheel): absent is not a changed API.
    return _hooks.patch(f"{module.__name__}.{name}", module, name, make, requires=_EXPECTED[name],
                        rebind_in=rebind_in, missing_ok=True)


def install(**init_settings: Any) -> list[str]:
    """Install the hooks (idempotent) and return the names of the functions hooked.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given, so call it after ``steptrace.init(...)`` or pass the settings here.
    Call it before the training loop, ideally before importing ``megatron.training``
    (modules that imported ``get_forward_backward_func`` by name before are patched too
    when they are known: ``megatron.core.pipeline_parallel``, ``megatron.training.training``).
    Raises ``ImportError`` naming the package to install when megatron-core is missing.
    """
    schedules = require_megatron()
    import importlib

    start_steptrace(init_settings)
    if _hooks.installed():
        return installed()
    _patch(schedules, "forward_step", _hook_forward_step)
    _patch(schedules, "backward_step", _hook_backward_step)
    _patch(schedules, "get_forward_backward_func", _hook_get_forward_backward_func,
           rebind_in=(_PIPELINE_PACKAGE, _TRAINING))
    # megatron.training is Megatron-LM, not in the megatron-core wheel: skip quietly without it.
    try:
        training = importlib.import_module(_TRAINING)
    except Exception:
        training = None
    if training is not None:
        _patch(training, "train_step", _hook_train_step)
        _patch(training, "save_checkpoint_and_time", _hook_save_checkpoint_and_time)
        try:
            async_utils = importlib.import_module(_ASYNC_UTILS)
        except Exception:
            async_utils = None
        if async_utils is not None:
            _patch(async_utils, "maybe_finalize_async_save",
                   lambda fn: _hook_maybe_finalize_async_save(fn, async_utils), rebind_in=(training,))
    return installed()


def installed() -> list[str]:
    """``module.function`` names currently hooked."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked attribute (for tests and for runs that want the originals back)."""
    _hooks.uninstall()
    _state.__init__()
