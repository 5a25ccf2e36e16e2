"""orbax: a ``CheckpointManager``'s saves, their asynchronous commits and its restores, in one line.

::

    manager = steptrace.adapters.orbax.instrument(ocp.CheckpointManager(path, options=...))
    for n, batch in enumerate(loader):
        manager.save(n, args=ocp.args.StandardSave(state))   # as before: nothing else changes
        ...

Each save orbax performs becomes a ``steptrace.checkpoint(step)`` record under orbax's step number
(whichever way the trainer counts: a save before step n of the state after n steps follows step
n - 1, see ``after_step`` in docs/records.md). Its host span is the save's blocking part: from the
moment orbax decided to save to ``save()``'s return, which includes waiting for the previous save's
commit, the copy off the device and, without async checkpointing, the whole write. With async
checkpointing (orbax's default) the background commit is ``async_seconds``: it ends when orbax's
finalize thread has finished (the items committed, old steps deleted), and is never charged to a
step. A call the save policy declines (``save_interval_steps``) records nothing. ``restore()`` is a
``steptrace.restore(step)`` span (before the first step: the attempt's restore time in the job's
accounting). ``wait_until_finished()`` and ``close()`` called by you are ``checkpoint`` spans: the
training thread waiting for a commit is exposed checkpoint time.

What this relies on in orbax (``orbax/checkpoint/checkpoint_manager.py``, checked against
orbax-checkpoint 0.12.8, the version the tests run):

* ``save(step, ...)`` returns whether it saved; unless ``force``, it asks ``self.should_save(step)``
  first, so an instance attribute sees that decision (the policy is observed, never asked twice:
  it may read preemption state across hosts).
* ``save`` waits for the previous save through ``self.wait_until_finished()`` and, with an
  asynchronous checkpointer, runs ``self._finalize(step, steps_to_remove)`` on a background
  ``_FinalizeThread``, synchronously otherwise. ``_finalize`` is private: where its first parameter
  is not ``step`` (another orbax version) the commit is not timed, with one ``SteptraceWarning``
  naming the version, and saves are recorded by their blocking part only.
* ``restore(step=None)`` restores ``latest_step()``.

Only the instance is patched (its class, other managers and orbax's own modules are untouched);
:func:`uninstrument` puts it back. With steptrace off, every call goes straight to orbax.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import steptrace
from steptrace import SteptraceWarning
from steptrace.adapters._hooks import installed_version, parameters

__all__ = ["instrument", "uninstrument"]

_PATCHED = ("save", "should_save", "wait_until_finished", "restore", "_finalize")
_STATE = "_steptrace_orbax"


def orbax_version() -> str:
    version = installed_version("orbax-checkpoint")
    return f"orbax-checkpoint {version}" if version else "orbax-checkpoint (version unknown)"


class _Save:
    """One ``save()`` call on the training thread, and the checkpoint it opened (if orbax saved)."""

    __slots__ = ("step", "thread", "ckpt", "finalized_inline")

    def __init__(self, step: Any):
        self.step = step
        self.thread = threading.get_ident()
        self.ckpt: Any = None
        self.finalized_inline = False

    def open(self) -> None:
        if self.ckpt is None:
            self.ckpt = steptrace.checkpoint(int(self.step))
            self.ckpt.__enter__()


class _State:
    """What one instrumented manager keeps: its originals and the saves in flight."""

    def __init__(self, manager: Any, originals: dict[str, Any], times_commits: bool):
        self.manager = manager
        self.originals = originals
        self.times_commits = times_commits
        self.call: _Save | None = None  # the save() running now
        self.lock = threading.Lock()
        self.committing: dict[int, Any] = {}  # orbax step -> its checkpoint handle, until finalized


def instrument(manager: Any) -> Any:
    """Time ``manager``'s saves (blocking part and asynchronous commit) and restores in steptrace, and
    return it. ``manager`` is an ``orbax.checkpoint.CheckpointManager``; calling this again is a no-op.
    Works before or after ``steptrace.init()``: each call checks whether steptrace is recording."""
    if getattr(manager, _STATE, None) is not None:
        return manager
    missing = [name for name in ("save", "should_save", "wait_until_finished", "restore")
               if not callable(getattr(manager, name, None))]
    if missing:
        raise TypeError(f"steptrace.adapters.orbax.instrument() takes an orbax.checkpoint.CheckpointManager; "
                        f"{type(manager).__name__} has no {', '.join(missing)}. For another checkpointer, wrap "
                        "its save in `with steptrace.checkpoint(step, async_save=...)`")
    save_params = parameters(manager.save)
    if save_params is None or save_params[:1] != ("step",) or "force" not in save_params:
        raise TypeError(f"steptrace.adapters.orbax: {type(manager).__name__}.save{save_params} is not "
                        f"CheckpointManager.save(step, ..., force=...) as in {orbax_version()}")
    finalize = getattr(manager, "_finalize", None)
    times_commits = callable(finalize) and (parameters(finalize) or ())[:1] == ("step",)
    if not times_commits:
        warnings.warn(f"steptrace: orbax's CheckpointManager._finalize is not _finalize(step, ...) in "
                      f"{orbax_version()}: asynchronous commits are not timed, saves are recorded by their "
                      "blocking part only", SteptraceWarning, stacklevel=2)
    originals = {name: getattr(manager, name) for name in _PATCHED if hasattr(manager, name)}
    state = _State(manager, originals, times_commits)
    manager.save = _save(state)
    manager.should_save = _should_save(state)
    manager.wait_until_finished = _wait_until_finished(state)
    manager.restore = _restore(state)
    if times_commits:
        manager._finalize = _finalize(state)
    setattr(manager, _STATE, state)
    return manager


def uninstrument(manager: Any) -> None:
    """Undo :func:`instrument` on ``manager`` (its own methods again)."""
    state = getattr(manager, _STATE, None)
    if state is None:
        return
    for name in _PATCHED:
        manager.__dict__.pop(name, None)  # the instance attribute; the class's method shows again
    delattr(manager, _STATE)


def _save(state: _State) -> Any:
    original = state.originals["save"]
    params = parameters(original) or ()

    def save(step: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled() or state.call is not None:
            return original(step, *args, **kwargs)
        call = state.call = _Save(step)
        force = kwargs.get("force")
        if force is None and "force" in params and len(args) > params.index("force") - 1:
            force = args[params.index("force") - 1]
        if force:
            _open(state, call)  # orbax saves without asking the policy
        try:
            saved = original(step, *args, **kwargs)
        except BaseException as exc:
            state.call = None
            if call.ckpt is not None:
                with state.lock:
                    state.committing.pop(int(step), None)
                call.ckpt.__exit__(type(exc), exc, exc.__traceback__)
            raise
        state.call = None
        ckpt = call.ckpt
        if ckpt is not None:
            if state.times_commits and not call.finalized_inline:
                # The finalize thread was started: the commit goes on in the background (it may
                # even have ended already; the handle then submits the save at its exit).
                try:
                    ckpt.async_save = True
                except AttributeError:  # steptrace's no-op handle
                    pass
            else:
                with state.lock:
                    state.committing.pop(int(step), None)
            ckpt.__exit__(None, None, None)
        return saved

    return save


def _should_save(state: _State) -> Any:
    original = state.originals["should_save"]

    def should_save(step: Any) -> Any:
        decision = original(step)
        call = state.call
        # Only orbax's own question inside save() opens the checkpoint; yours is just answered.
        if decision and call is not None and call.ckpt is None and call.thread == threading.get_ident():
            _open(state, call)
        return decision

    return should_save


def _open(state: _State, call: _Save) -> None:
    """Orbax is saving: the checkpoint's host span starts; its commit will come to ``_finalize``."""
    call.open()
    if state.times_commits:
        with state.lock:
            state.committing[int(call.step)] = call.ckpt


def _finalize(state: _State) -> Any:
    original = state.originals["_finalize"]

    def finalize(step: Any, *args: Any, **kwargs: Any) -> Any:
        call = state.call
        if call is not None and call.thread == threading.get_ident():
            call.finalized_inline = True  # a synchronous save: part of its blocking time
            return original(step, *args, **kwargs)
        with state.lock:
            ckpt = state.committing.pop(int(step), None)
        if ckpt is None:
            return original(step, *args, **kwargs)
        try:
            return original(step, *args, **kwargs)
        except BaseException as exc:
            # The commit failed (orbax re-raises it at the next wait or save): the record says so.
            ckpt.status = "error"
            ckpt.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ckpt.async_done()

    return finalize


def _wait_until_finished(state: _State) -> Any:
    original = state.originals["wait_until_finished"]

    def wait_until_finished(*args: Any, **kwargs: Any) -> Any:
        call = state.call
        if not steptrace.enabled() or (call is not None and call.thread == threading.get_ident()):
            return original(*args, **kwargs)  # inside save(): already the save's blocking time
        with steptrace.span("checkpoint"):
            return original(*args, **kwargs)

    return wait_until_finished


def _restore(state: _State) -> Any:
    original = state.originals["restore"]

    def restore(step: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(step, *args, **kwargs)
        restored = step
        if restored is None and not args and kwargs.get("directory") is None:
            try:
                restored = state.manager.latest_step()  # what orbax restores for step=None
            except Exception:
                restored = None
        with steptrace.restore(None if restored is None else int(restored)):
            return original(step, *args, **kwargs)

    return restore
