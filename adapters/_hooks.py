"""The one mechanism every framework hook uses: patch a function, check its signature, undo.

A hook replaces ``owner.attribute`` (a module function or a class method) by a wrapper built from
the original. Before patching, the original's parameters are checked: a framework version whose
hooked function changed gets its hook turned off with one ``SteptraceWarning`` naming the function,
what changed and the framework's version, and training goes on unhooked. Modules that imported the
original by name (``from x import f``) can be rebound too, so they call the hook. ``uninstall()``
puts every original back, in reverse order.

Every framework's ``install(**init_settings)`` has one contract (:func:`start_steptrace`): it starts
steptrace with ``init_settings`` (and ``STEPTRACE_*``) unless steptrace is already running and no
settings are given, then installs its hooks (idempotent) and returns their names.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import warnings
from typing import Any, Callable, Iterable

import steptrace
from steptrace._errors import SteptraceWarning
from steptrace._handles import SpanHandle


def timed_restore(restore: Callable[[], Any], restored_step: Callable[[Any], int | None]) -> Any:
    """Run a framework's checkpoint restore (``restore()``) as ``steptrace.restore()``, the record
    Lightning's and HF's hooks write: a ``restore`` span (before the first step, the attempt's
    ``restore`` time in the job's accounting), ``attrs["restored_step"]`` read from what the restore
    returned (``restored_step(result)``; None: unknown). A restore that found nothing to restore
    (``restored_step`` raises :class:`NothingRestored`) keeps its span (looking for a checkpoint is
    restore time) with ``attrs["restored"] = False``, and the next step is not marked
    ``first_after_restore``. An exception in the restore propagates unchanged."""
    with steptrace.restore() as span:
        result = restore()
        attrs = getattr(span, "attrs", None) if isinstance(span, SpanHandle) else None
        if attrs is not None:
            try:
                step = restored_step(result)
            except NothingRestored:
                attrs["restored"] = False
            except Exception:  # reading the step must never fail the restore
                pass
            else:
                if step is not None:
                    attrs["restored_step"] = step
    return result


class NothingRestored(Exception):
    """Raised by a hook's ``restored_step`` when the framework found no checkpoint to restore."""


def start_steptrace(init_settings: dict[str, Any]) -> None:
    """The ``install(**init_settings)`` contract shared by every framework hook."""
    if init_settings or not steptrace.enabled():
        steptrace.init(**init_settings)


def start_steptrace_for_trainer(init_settings: dict[str, Any], *, rank: int, world_size: int) -> bool:
    """The same contract for a trainer callback, whose trainer knows the rank and world size:
    they fill in ``rank``/``world_size`` when neither the settings nor the environment give them.
    True when this call started steptrace (the callback then shuts it down at the end)."""
    if not init_settings and steptrace.enabled():
        return False
    settings = dict(init_settings)
    if world_size > 1 and not any(os.environ.get(v) for v in ("STEPTRACE_RANK", "RANK")):
        settings.setdefault("rank", rank)
        settings.setdefault("world_size", world_size)
    start_steptrace(settings)
    return True


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (package metadata), or None; named in hook warnings."""
    try:
        return importlib.metadata.version(distribution)
    except Exception:  # not installed, or broken metadata: a warning must still be written
        return None


def parameters(fn: Any) -> tuple[str, ...] | None:
    """``fn``'s parameter names, or None when they cannot be read."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


class Hooks:
    """The hooks of one framework: what is patched, and how to undo it."""

    def __init__(self, framework: str, version: Callable[[], str]):
        self.framework = framework
        self.version = version
        #: hook name -> [(owner, attribute, original)], the first entry the hook itself
        self._patched: dict[str, list[tuple[Any, str, Any]]] = {}

    def disabled(self, name: str, why: str) -> None:
        warnings.warn(f"steptrace: {self.framework} hook {name} disabled ({why}; {self.version()}); "
                      "the run continues without it", SteptraceWarning, stacklevel=4)

    def patch(self, name: str, owner: Any, attribute: str, make: Callable[[Any], Any], *,
              requires: Iterable[str] = (), exact: tuple[str, ...] | None = None,
              rebind_in: Iterable[Any] = (), missing_ok: bool = False) -> bool:
        """Replace ``owner.attribute`` (``owner`` a module, a module name or a class; ``attribute``
        may be dotted, ``"Class.method"``) by ``make(original)``.

        ``requires``: parameters the hook reads (the original must take them); ``exact``: the whole
        parameter list the hook expects. ``rebind_in``: modules (or names) that imported the
        original by name, rebound to the hook when they still hold it. ``missing_ok``: a missing
        module or attribute is an expected absence (an optional part of the framework), not a
        changed API: skip it without a warning. Returns whether the hook is installed.
        """
        if name in self._patched:
            return True
        try:
            target = importlib.import_module(owner) if isinstance(owner, str) else owner
            *path, attr = attribute.split(".")
            for part in path:
                target = getattr(target, part)
            original = inspect.getattr_static(target, attr)
        except (ImportError, AttributeError) as exc:
            if not missing_ok:
                self.disabled(name, f"not found: {exc}")
            return False
        if getattr(original, "__steptrace_hook__", False):
            return False
        params = parameters(original)
        if exact is not None and params != exact:
            self.disabled(name, f"signature {params} is not the expected {exact}")
            return False
        absent = [p for p in requires if params is None or p not in params]
        if absent:
            self.disabled(name, f"{attribute}() does not take {', '.join(absent)}")
            return False
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        wrapper.__steptrace_hook__ = True
        wrapper.__steptrace_original__ = original
        setattr(target, attr, wrapper)
        entries = [(target, attr, original)]
        for module in rebind_in:
            try:
                module = importlib.import_module(module) if isinstance(module, str) else module
            except ImportError:
                continue
            if getattr(module, attr, None) is original:
                setattr(module, attr, wrapper)
                entries.append((module, attr, original))
        self._patched[name] = entries
        return True

    def installed(self) -> list[str]:
        """Names of the hooks installed, in installation order."""
        return list(self._patched)

    def hooked(self, name: str) -> Any:
        """The hook installed as ``name`` (its wrapper), or None."""
        entries = self._patched.get(name)
        if not entries:
            return None
        target, attr, _ = entries[0]
        return inspect.getattr_static(target, attr)

    def uninstall(self) -> None:
        """Put every original back, newest first."""
        for entries in reversed(list(self._patched.values())):
            for target, attr, original in reversed(entries):
                setattr(target, attr, original)
        self._patched.clear()
