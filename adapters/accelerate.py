"""Hugging Face Accelerate: drop-in hooks that turn an Accelerate training loop into steptrace records.

::

    import steptrace
    import steptrace.adapters.accelerate

    steptrace.adapters.accelerate.install(run_id="my-run")   # before accelerator.prepare(...)

What is hooked (class attributes are replaced; no file is edited), checked against accelerate
1.15.0; the user guide is ``docs/accelerate.md``:

- **Steps: one per optimizer update.** A step opens at the first forward of a model prepared for
  training (``Accelerator.prepare_model``, ``evaluation_mode=False``; a forward pre-hook, only
  with the model in training mode and gradients enabled: an eval forward under ``torch.no_grad``
  opens nothing) or at ``Accelerator.accumulate`` entry, whichever comes first, when no step is
  open. It closes once the update is done: at the exit of the ``accumulate`` block in which
  gradients were synced and ``AcceleratedOptimizer.step`` ran, or at that ``step``'s return when it
  is called outside an ``accumulate`` block (or after it). With ``gradient_accumulation_steps=k``
  the step covers k micro-batches (``attrs["micro_batches"]``), the data fetches between them
  included. Steps are numbered from 0 on the rank; inside your own ``with steptrace.step(n)``
  (to number a resumed run's steps yourself, or give ``tokens=``) the hooks open none.
- **Data.** Iterating a prepared ``DataLoaderShard``/``DataLoaderDispatcher``: each batch fetch
  (``next``) is a ``data`` span, so the wait is the step's ``idle_breakdown["data"]``.
- **Checkpoints.** ``Accelerator.save_state`` is a ``steptrace.checkpoint`` of the last step run
  (synchronous: all of it after that step's end is ``blocking_seconds``); ``Accelerator.load_state``
  is a ``steptrace.restore()`` (the ``restore`` span; the next step is ``first_after_restore``).
  Accelerate's checkpoint holds no global step (its ``step`` is the micro-batch counter within an
  accumulation), so ``attrs["restored_step"]`` is absent.

A hook whose target's signature differs from what it reads disables itself with one
``SteptraceWarning`` naming the function and accelerate's version; the run continues without it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import steptrace
from steptrace.adapters._hooks import Hooks, installed_version, start_steptrace, timed_restore

__all__ = ["install", "installed", "uninstall"]

_hooks = Hooks("Accelerate", lambda: f"accelerate {installed_version('accelerate') or '(version unknown)'}")


def require_accelerate() -> Any:
    try:
        import accelerate
    except ImportError as exc:
        raise ImportError("steptrace's Accelerate hooks need accelerate: pip install 'steptrace[accelerate]'") from exc
    return accelerate


class _State:
    """Per-process hook state: the step the hooks opened, and where its optimizer update stands."""

    def __init__(self) -> None:
        self.next_step = 0
        self.open: Any = None  # the step handle this module opened (begin_step), or None
        self.micro_batches = 0
        self.accumulate_depth = 0
        self.updated = False  # the open step's optimizer update ran (sync_gradients was True)
        self.model_hooks: list[Any] = []  # forward pre-hook handles, removed by uninstall()


_state = _State()


def _open_step() -> None:
    """Open the next step unless one is open (ours, or the user's own)."""
    if _state.open is not None or not steptrace.enabled() or steptrace.current_step() is not None:
        return
    n = _state.next_step
    handle = steptrace.begin_step(n)
    if steptrace.current_step() is handle:
        _state.next_step = n + 1
        _state.open, _state.micro_batches, _state.updated = handle, 0, False


def _close_step(error: BaseException | None = None) -> None:
    handle, _state.open = _state.open, None
    if handle is None or steptrace.current_step() is not handle:
        return
    attrs = getattr(handle, "attrs", None)
    if isinstance(attrs, dict) and _state.micro_batches:
        attrs["micro_batches"] = _state.micro_batches
    steptrace.end_step(error=error)


def _hook_accumulate(original: Callable[..., Any]) -> Callable[..., Any]:
    # accumulate() is a @contextmanager: the hook is one too, around the original's context.
    import contextlib

    @contextlib.contextmanager
    def accumulate(self: Any, *models: Any) -> Iterator[None]:
        _open_step()
        if _state.open is not None:
            _state.micro_batches += 1
        _state.accumulate_depth += 1
        try:
            with original(self, *models):
                yield
        except BaseException as exc:
            _state.accumulate_depth -= 1
            if _state.open is not None:
                _close_step(error=exc)
            raise
        _state.accumulate_depth -= 1
        if _state.open is not None and self.sync_gradients and _state.updated and _state.accumulate_depth == 0:
            _close_step()

    return accumulate


def _hook_optimizer_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, closure: Any = None) -> Any:
        result = original(self, closure)
        if _state.open is not None and self.gradient_state.sync_gradients:
            _state.updated = True
            if _state.accumulate_depth == 0:
                _close_step()
        return result

    return step


def _forward_pre_hook(module: Any, args: Any) -> None:
    if _state.open is None and module.training:
        import torch

        if torch.is_grad_enabled():
            _open_step()
            if _state.open is not None and _state.accumulate_depth == 0:
                _state.micro_batches += 1


def _hook_prepare_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_model(self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        prepared = original(self, model, device_placement, evaluation_mode)
        if not evaluation_mode and hasattr(prepared, "register_forward_pre_hook"):
            _state.model_hooks.append(prepared.register_forward_pre_hook(_forward_pre_hook))
        return prepared

    return prepare_model


def _hook_iter(original: Callable[..., Any]) -> Callable[..., Any]:
    def __iter__(self: Any) -> Iterator[Any]:
        batches = original(self)
        if not steptrace.enabled():
            yield from batches
            return
        while True:
            with steptrace.span("data"):
                try:
                    batch = next(batches)
                except StopIteration:
                    return
            yield batch

    return __iter__


def _hook_save_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(self, *args, **kwargs)
        step = steptrace.last_step()
        with steptrace.checkpoint(step if step is not None else 0):
            return original(self, *args, **kwargs)

    return save_state


def _hook_load_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not steptrace.enabled():
            return original(self, *args, **kwargs)
        return timed_restore(lambda: original(self, *args, **kwargs), lambda _result: None)

    return load_state


def install(**init_settings: Any) -> list[str]:
    """Install the hooks (idempotent) and return the names of the methods hooked.

    The contract of every steptrace framework hook (``steptrace.adapters._hooks``): starts
    steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless it is already running and no
    settings are given. Call it before ``accelerator.prepare(...)``: models prepared before are
    not seen (their steps then open at ``accumulate`` only). Raises ``ImportError`` naming the
    package to install when accelerate is missing.
    """
    require_accelerate()
    from accelerate import accelerator, data_loader, optimizer

    start_steptrace(init_settings)
    if _hooks.installed():
        return installed()
    acc = accelerator.Accelerator
    _hooks.patch("accelerate.Accelerator.prepare_model", acc, "prepare_model", _hook_prepare_model,
                 exact=("self", "model", "device_placement", "evaluation_mode"))
    _hooks.patch("accelerate.Accelerator.accumulate", acc, "accumulate", _hook_accumulate, exact=("self", "models"))
    _hooks.patch("accelerate.optimizer.AcceleratedOptimizer.step", optimizer.AcceleratedOptimizer, "step",
                 _hook_optimizer_step, exact=("self", "closure"))
    for cls in ("DataLoaderShard", "DataLoaderDispatcher"):
        _hooks.patch(f"accelerate.data_loader.{cls}.__iter__", data_loader, f"{cls}.__iter__", _hook_iter,
                     exact=("self",))
    _hooks.patch("accelerate.Accelerator.save_state", acc, "save_state", _hook_save_state)
    _hooks.patch("accelerate.Accelerator.load_state", acc, "load_state", _hook_load_state)
    return installed()


def installed() -> list[str]:
    """``module.Class.method`` names currently hooked."""
    return _hooks.installed()


def uninstall() -> None:
    """Restore every hooked method and remove the forward pre-hooks from prepared models."""
    _hooks.uninstall()
    for handle in _state.model_hooks:
        handle.remove()
    _state.__init__()  # type: ignore[misc]


