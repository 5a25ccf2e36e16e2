"""Megatron: drop-in hooks that turn Megatron's training loop and pipeline schedules into steptrace records.

::

    import steptrace
    import steptrace.adapters.megatron

    steptrace.init()
    steptrace.adapters.megatron.install()   # one line at the top of pretrain_*.py

What is hooked (module attributes are replaced; no file is edited), checked
against megatron-core 0.16.1 and Megatron-LM main (megatron-core 0.20.0); the
user guide is ``docs/megatron.md``:

- ``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``
  (and the same name re-exported by ``megatron.core.pipeline_parallel`` and
  imported by ``megatron.training.training``): the function it returns is
  wrapped so that each call is a ``steptrace.step`` with this rank's tokens
  (``num_microbatches × micro_batch_size × seq_length``). A ``forward_only=True``
  call (evaluation) is an ``eval`` span instead; inside an open step
  (``train_step`` below) the call runs within it.
- ``schedules.forward_step`` and ``schedules.backward_step``: every schedule
  calls them by their module-global name, so each call is a
  ``steptrace.microbatch`` with ``stage`` (pipeline rank), ``chunk``
  (``vp_stage``), ``microbatch`` (``current_microbatch``) and ``kind``.
  ``backward_step`` is not told which microbatch it runs: the schedule hands it
  back the very object ``forward_step`` returned, so it is paired by identity
  (first-in first-out per chunk when the object is not recognised).
- With Megatron-LM's ``megatron.training`` (not in the ``megatron-core``
  wheel; absent, these hooks are skipped quietly; present but failing to
  import, one ``SteptraceWarning`` names the module and the error):
  ``training.train_step`` (the step: step number = Megatron's ``iteration``
  argument, ``attrs["megatron_iteration"]`` = the iteration Megatron logs and
  names the checkpoint after it, tokens and FLOPs from Megatron's arguments and
  its own ``num_floating_point_operations``), ``training.save_checkpoint_and_time``
  (a ``steptrace.checkpoint`` of the last step; with ``--async-save`` the blocking
  part) and ``async_utils.maybe_finalize_async_save`` (a ``checkpoint`` span
  when it has work: a blocking wait, or a non-blocking call while a save is in
  flight; the async commit ends when Megatron's queue finalized the save, not
  after the worker shutdown of ``terminate=True``), and ``checkpointing.load_checkpoint`` (also
  rebound in ``training``, which imported it by name; ``setup_model_and_optimizer`` calls it for
  ``--load``): a ``steptrace.restore()`` with ``attrs["restored_step"]`` = the iteration it loaded
  (the checkpoint's name), ``attrs["restored"] = False`` when it found none (it returns ``(0, 0)``).
  The load is synchronous; Megatron's barrier after it (``timers('load-checkpoint').stop(barrier=True)``)
  is outside the span, in start-up. The next ``train_step`` is ``first_after_restore``.
- With Megatron-LM's own OpenTelemetry export, ``training._otel_managed_span``: Megatron's per-step
  spans open under steptrace's step span, one trace per step (``steptrace.adapters.megatron_otel``).

Per step and stage the record carries ``pipeline_bubble_ratio`` over the
pipeline window (step start to the stage's last microbatch) and
``optimizer_seconds`` (gradient finalization and the optimizer, after it).

A hook whose target's signature differs from what it expects disables itself
with one ``SteptraceWarning`` naming the function and the version of the
megatron-core actually imported; the run continues without that hook.

The per-call path (``forward_step``/``backward_step``) is kept to a few
attribute reads beyond steptrace's own ``microbatch``: argument positions are
found once at install, pairing is one dict operation per call
(``bench/bench_megatron_hooks.py``).
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import inspect
import os
import warnings
from typing import Any, Callable

import steptrace
from steptrace._errors import SteptraceWarning
from steptrace.adapters._hooks import (
    Hooks,
    NothingRestored,
    installed_version,
    parameters,
    start_steptrace,
    timed_restore,
)

__all__ = ["install", "installed", "uninstall"]

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_PIPELINE_PACKAGE = "megatron.core.pipeline_parallel"
_TRAINING = "megatron.training.training"
_ASYNC_UTILS = "megatron.training.async_utils"
_CHECKPOINTING = "megatron.training.checkpointing"

# Parameters each hook reads, by target. A target lacking one is a different API.
_EXPECTED = {
    "forward_step": ("forward_step_func", "data_iterator", "model", "current_microbatch", "vp_stage"),
    "backward_step": ("input_tensor", "output_tensor", "output_tensor_grad"),
    "get_forward_backward_func": (),
    "train_step": (),
    "save_checkpoint_and_time": ("iteration",),
    "maybe_finalize_async_save": ("blocking",),
    "load_checkpoint": ("ddp_model", "optimizer", "opt_param_scheduler", "load_arg"),
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
    """The megatron-core actually imported: its ``package_info`` (right when the source runs from
    a checkout on PYTHONPATH), else the installed distribution's metadata."""
    try:
        from megatron.core import package_info

        where = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(package_info.__file__))))
        return f"megatron-core {package_info.__version__} from {where}"
    except Exception:
        pass
    version = installed_version("megatron-core")
    return f"megatron-core {version}" if version else "megatron-core (version unknown)"


def _arg_position(fn: Any, name: str) -> tuple[int, Any]:
    """(position, default) of parameter ``name`` of ``fn``: read once at install, not per call."""
    params = list(inspect.signature(fn).parameters.values())
    index = [p.name for p in params].index(name)
    default = params[index].default
    return index, (None if default is inspect.Parameter.empty else default)


def _arg_reader(fn: Any, name: str) -> Callable[[tuple, dict], Any]:
    """A reader of argument ``name`` (keyword or positional) of calls to ``fn``."""
    index, default = _arg_position(fn, name)

    def read(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        if len(args) > index:
            return args[index]
        return default

    return read


class _State:
    """Per-process hook state: step numbering and the forward/backward pairing of one step."""

    def __init__(self) -> None:
        self.next_step = 0
        self.stage: int | None = None
        # id(forward output) -> (output, microbatch, chunk); the output is held so its id stays unique.
        self.by_output: dict[int, tuple[Any, Any, Any]] = {}
        # chunk -> ids of forward outputs not yet paired, in schedule order
        self.fifo: dict[Any, collections.deque] = {}
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
_pipeline_rank_fn: list[Any] = []  # parallel_state.get_pipeline_model_parallel_rank, found once


def _pipeline_rank() -> int | None:
    try:
        if not _pipeline_rank_fn:
            from megatron.core import parallel_state

            _pipeline_rank_fn.append(parallel_state.get_pipeline_model_parallel_rank)
        return _pipeline_rank_fn[0]()
    except Exception:
        return None


def _schedule_tokens(kwargs: dict) -> int | None:
    """This rank's tokens in one schedule call: its data-parallel share of the global batch."""
    try:
        tokens = kwargs["num_microbatches"] * kwargs["micro_batch_size"] * kwargs["seq_length"]
    except (KeyError, TypeError):
        return None
    return tokens if isinstance(tokens, int) and tokens >= 0 else None


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
            if steptrace.current_step() is not None:
                return fn(*args, **kwargs)  # inside train_step's step (or the user's own)
            if kwargs.get("forward_only"):
                with steptrace.span("eval"):
                    return fn(*args, **kwargs)
            with steptrace.step(_state.take_step_number(), tokens=_schedule_tokens(kwargs)):
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


# -- the per-call path: forward_step / backward_step -----------------------------------
# Runs on the training thread once per microbatch and kind. Everything that can be decided at
# install (argument positions) is; per call it is steptrace.microbatch plus one dict operation.
def _hook_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    mb_at, mb_default = _arg_position(original, "current_microbatch")
    chunk_at, chunk_default = _arg_position(original, "vp_stage")
    state = _state
    current_step = steptrace.current_step

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        if current_step() is None:
            return original(*args, **kwargs)  # eval outside a step, or steptrace off
        n = len(args)
        index = kwargs.get("current_microbatch", mb_default) if n <= mb_at else args[mb_at]
        chunk = kwargs.get("vp_stage", chunk_default) if n <= chunk_at else args[chunk_at]
        with steptrace.microbatch(index, stage=state.stage, chunk=chunk, kind="forward"):
            result = original(*args, **kwargs)
        # forward_step returns (output, num_tokens); the schedule hands `output` back to backward_step.
        output = result[0] if type(result) is tuple and len(result) == 2 else result
        key = id(output)
        state.by_output[key] = (output, index, chunk)
        queue = state.fifo.get(chunk)
        if queue is None:
            queue = state.fifo[chunk] = collections.deque()
        queue.append(key)
        return result

    return forward_step


def _pair_backward(output: Any) -> tuple[Any, Any]:
    """(microbatch, chunk) of the forward whose output ``backward_step`` was given."""
    key = id(output)
    entry = _state.by_output.pop(key, None)
    if entry is None:
        key, entry = _pair_unrecognised(output)
        if entry is None:
            return None, None
    _, index, chunk = entry
    queue = _state.fifo.get(chunk)
    if queue:
        if queue[0] == key:
            queue.popleft()
        else:
            try:
                queue.remove(key)
            except ValueError:
                pass
    return index, chunk


def _pair_unrecognised(output: Any) -> tuple[int, Any]:
    """The slow path: the schedule passed the output's element (``output[0]``) or a copy."""
    by_output = _state.by_output
    for key, entry in list(by_output.items()):
        held = entry[0]
        if isinstance(held, (list, tuple)) and held and held[0] is output:
            return key, by_output.pop(key)
    # Not recognised at all: the oldest unpaired forward, in schedule order (1F1B within a chunk).
    for queue in _state.fifo.values():
        while queue:
            entry = by_output.pop(queue[0], None)
            if entry is not None:
                return queue[0], entry
            queue.popleft()
    return 0, None


def _hook_backward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    out_at, out_default = _arg_position(original, "output_tensor")
    state = _state
    current_step = steptrace.current_step

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        if current_step() is None:
            return original(*args, **kwargs)
        output = kwargs.get("output_tensor", out_default) if len(args) <= out_at else args[out_at]
        index, chunk = _pair_backward(output)
        with steptrace.microbatch(index, stage=state.stage, chunk=chunk, kind="backward"):
            return original(*args, **kwargs)

    return backward_step


# -- megatron.training (Megatron-LM), when importable -------------------------------------
def _megatron_args() -> Any:
    try:
        from megatron.training import get_args

        return get_args()
    except Exception:
        return None


class _Throughput:
    """Tokens and FLOPs of one training step on this rank, from Megatron's own arguments.

    Tokens: this rank's data-parallel share of the global batch, ``num_microbatches ×
    micro_batch_size × seq_length``. FLOPs: Megatron-LM's ``num_floating_point_operations(args,
    global_batch)`` (the formula behind its "TFLOP/s/GPU" log line) divided by the world size, as
    Megatron does. Recomputed only when the batch shape changes (batch-size ramp-up).
    """

    def __init__(self, flops_fn: Callable[..., Any] | None):
        self.flops_fn = flops_fn
        self.key: tuple | None = None
        self.value: tuple[Any, Any] = (None, None)
        self.failed = False

    def per_step(self, args: Any) -> tuple[Any, Any]:
        if args is None or self.failed:
            return None, None
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            key = (get_num_microbatches(), args.micro_batch_size, args.seq_length, _data_parallel_size(args),
                   args.world_size)
            if key != self.key:
                self.key, self.value = key, self._compute(args, *key)
        except Exception as exc:
            self.failed = True
            warnings.warn(f"steptrace: Megatron tokens/FLOPs per step unavailable ({type(exc).__name__}: {exc}; "
                          f"{_megatron_version()}); tokens/s, TFLOP/s and MFU stay empty", SteptraceWarning,
                          stacklevel=3)
            return None, None
        return self.value

    def _compute(self, args: Any, microbatches: int, mbs: int, seq: int, dp: int, world: int) -> tuple[Any, Any]:
        tokens = microbatches * mbs * seq
        flops = None
        if self.flops_fn is not None:
            flops = float(self.flops_fn(args, microbatches * mbs * dp)) / max(world, 1)
        return tokens, flops


def _data_parallel_size(args: Any) -> int:
    """The data-parallel degree Megatron's train loop multiplies the microbatch by."""
    dp = None
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            dp = parallel_state.get_data_parallel_world_size()
    except Exception:
        dp = None
    if dp is None:
        dp = args.data_parallel_size
    return int(dp) * int(getattr(args, "gtp_weight_remat_size", 1) or 1)


_throughput = _Throughput(None)


def _hook_train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    read_iteration = _arg_reader(original, "iteration") if "iteration" in (parameters(original) or ()) else None

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or steptrace.current_step() is not None:
            return original(*args, **kwargs)
        margs = _megatron_args()
        iteration = read_iteration(args, kwargs) if read_iteration is not None else None
        if iteration is None:
            iteration = getattr(margs, "curr_iteration", None)
        n = _state.take_step_number(iteration)
        tokens, flops = _throughput.per_step(margs)
        attrs = {}
        if isinstance(iteration, int):
            # Megatron's `iteration` during train_step is the count of iterations done before it;
            # it logs "iteration N+1" and saves iter_{N+1} after it.
            attrs["megatron_iteration"] = iteration + 1
        with steptrace.step(n, tokens=tokens, flops=flops, **attrs):
            return original(*args, **kwargs)

    return train_step


def _async_save_on() -> bool:
    return bool(getattr(_megatron_args(), "async_save", False))


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


def _unfinalized_async_saves(queue: Any) -> int | None:
    count = getattr(queue, "get_num_unfinalized_calls", None)
    try:
        return int(count()) if callable(count) else None
    except Exception:
        return None


def _saves_finished(left: int | None, everything: bool) -> None:
    """Report the oldest pending async saves done, now: all but ``left`` of them (all when
    ``everything`` and the count is unknown)."""
    pending = _state.pending_async
    if left is None:
        done = len(pending) if everything else 0
    else:
        done = max(0, len(pending) - left)
    finished, _state.pending_async = pending[:done], pending[done:]
    for ckpt in finished:
        ckpt.async_done()


def _timed_finalize(queue: Any) -> Callable[[], None] | None:
    """Make ``queue.maybe_finalize_async_calls`` report the saves it finalized the moment it
    returns, so their commit time ends when the write did, not after what Megatron does next in
    the same call (cleaning up deletion processes; ``terminate=True``'s worker shutdown). Returns
    the undo, or None when the queue cannot be instrumented (then the call's end is used)."""
    finalize = getattr(queue, "maybe_finalize_async_calls", None)
    if not callable(finalize):
        return None

    def maybe_finalize_async_calls(*args: Any, **kwargs: Any) -> Any:
        result = finalize(*args, **kwargs)
        _saves_finished(_unfinalized_async_saves(queue), everything=False)
        return result

    try:
        queue.maybe_finalize_async_calls = maybe_finalize_async_calls  # this instance, this call
    except Exception:
        return None

    def undo() -> None:
        try:
            if queue.__dict__.get("maybe_finalize_async_calls") is maybe_finalize_async_calls:
                del queue.maybe_finalize_async_calls
        except Exception:
            pass

    return undo


def _hook_maybe_finalize_async_save(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    read_blocking = _arg_reader(original, "blocking")

    @functools.wraps(original)
    def maybe_finalize_async_save(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or not _state.pending_async:
            return original(*args, **kwargs)  # no save of ours in flight: nothing to time
        blocking = read_blocking(args, kwargs)
        queue = getattr(module, "_async_calls_queue", None)
        unfinalized = _unfinalized_async_saves(queue)
        undo = _timed_finalize(queue) if queue is not None else None
        try:
            if blocking or unfinalized:
                # Exposed checkpoint work on the training thread: a blocking wait for the commit,
                # or the non-blocking check (a collective) and finalization of a save in flight.
                with steptrace.span("checkpoint"):
                    result = original(*args, **kwargs)
            else:
                result = original(*args, **kwargs)
        finally:
            if undo is not None:
                undo()
        _saves_finished(_unfinalized_async_saves(queue), everything=bool(blocking))
        return result

    return maybe_finalize_async_save


def _hook_load_checkpoint(original: Callable[..., Any], checkpointing: Any) -> Callable[..., Any]:
    """``load_checkpoint`` (``--load``, ``--pretrained-checkpoint``) as ``steptrace.restore()``.
    It returns ``(iteration, num_floating_point_operations_so_far)``, ``(0, 0)`` when it found no
    checkpoint (then ``get_loaded_iteration()`` is None where Megatron-LM has it)."""

    def restored_step(result: Any) -> int | None:
        iteration = int(result[0])
        if iteration == 0:
            loaded = getattr(checkpointing, "get_loaded_iteration", None)
            if not callable(loaded) or loaded() is None:
                raise NothingRestored
        return iteration

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(*args, **kwargs)
        return timed_restore(lambda: original(*args, **kwargs), restored_step)

    return load_checkpoint


# -- installation ---------------------------------------------------------------------
def _patch(module: Any, name: str, make: Callable[[Any], Any], rebind_in: tuple = ()) -> bool:
    # Megatron-LM's modules are optional (not in the megatron-core wheel): absent is not a changed API.
    return _hooks.patch(f"{module.__name__}.{name}", module, name, make, requires=_EXPECTED[name],
                        rebind_in=rebind_in, missing_ok=True)


def _import_megatron_lm(name: str) -> Any:
    """Megatron-LM module ``name``, or None. Absent (the megatron-core wheel alone) is expected and
    quiet; present but failing to import turns its hooks off with one warning saying why."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    try:
        return importlib.import_module(name)
    except Exception as exc:
        warnings.warn(f"steptrace: Megatron hooks of {name} disabled: the module exists ({spec.origin}) but "
                      f"importing it failed ({type(exc).__name__}: {exc}; {_megatron_version()}); "
                      "the run continues without them", SteptraceWarning, stacklevel=3)
        return None


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
    global _throughput
    schedules = require_megatron()
    start_steptrace(init_settings)
    if _hooks.installed():
        return installed()
    _patch(schedules, "forward_step", _hook_forward_step)
    _patch(schedules, "backward_step", _hook_backward_step)
    training = _import_megatron_lm(_TRAINING)
    _patch(schedules, "get_forward_backward_func", _hook_get_forward_backward_func,
           rebind_in=(_PIPELINE_PACKAGE,) + ((training,) if training is not None else ()))
    if training is not None:
        flops_fn = getattr(training, "num_floating_point_operations", None)
        params = parameters(flops_fn) if callable(flops_fn) else None
        if callable(flops_fn) and (params is None or params[:2] != ("args", "batch_size")):
            _hooks.disabled("num_floating_point_operations",
                            f"signature {params} does not start with ('args', 'batch_size'); FLOPs stay empty")
            flops_fn = None
        _throughput = _Throughput(flops_fn)
        _patch(training, "train_step", _hook_train_step)
        # Megatron's own OpenTelemetry export: its per-step spans join steptrace's step traces.
        from steptrace.adapters.megatron_otel import install_join

        install_join(_hooks, training, lambda: _state.next_step)
        _patch(training, "save_checkpoint_and_time", _hook_save_checkpoint_and_time)
        async_utils = _import_megatron_lm(_ASYNC_UTILS)
        if async_utils is not None:
            _patch(async_utils, "maybe_finalize_async_save",
                   lambda fn: _hook_maybe_finalize_async_save(fn, async_utils), rebind_in=(training,))
        checkpointing = _import_megatron_lm(_CHECKPOINTING)
        if checkpointing is not None:
            # training.py imported it by name: setup_model_and_optimizer calls that binding.
            _patch(checkpointing, "load_checkpoint", lambda fn: _hook_load_checkpoint(fn, checkpointing),
                   rebind_in=(training,))
    return installed()


def installed() -> list[str]:
    """``module.function`` names currently hooked."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked attribute (for tests and for runs that want the originals back)."""
    global _throughput
    _hooks.uninstall()
    _state.__init__()
    _throughput = _Throughput(None)
