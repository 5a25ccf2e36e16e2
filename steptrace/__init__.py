"""steptrace: device-true step, checkpoint and microbatch timings for training loops.

::

    import steptrace
    steptrace.init()
    for n, batch in enumerate(loader):
        with steptrace.step(n, tokens=batch_tokens) as s:
            state, loss = train_step(state, batch)
            s.wait_for(loss)
        if n % 100 == 0:
            with steptrace.checkpoint(n):
                manager.save(n, state)

Importing steptrace imports no framework and no exporter library. Until
``init()`` is called (and after ``init(enabled=False)``) every call is a no-op.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Iterable

from steptrace import _handles
from steptrace._config import Config, resolve_config
from steptrace._errors import SteptraceWarning
from steptrace._handles import NULL_CHECKPOINT, NULL_MICROBATCH, NULL_STEP, null_span
from steptrace._runtime import Runtime
from steptrace._schema import RESTORE_SPAN
from steptrace._version import __version__ as __version__

__all__ = [
    "Config",
    "SteptraceWarning",
    "begin_span",
    "begin_step",
    "checkpoint",
    "config",
    "current_step",
    "enabled",
    "end_span",
    "end_step",
    "flush",
    "gc_every",
    "init",
    "last_step",
    "log",
    "microbatch",
    "request_capture",
    "restore",
    "shutdown",
    "span",
    "stats",
    "step",
    "steps",
    "wait_for",
]

class _Disabled:
    """The runtime before init() and when disabled: every call returns a shared no-op."""

    def __init__(self, warn_uninitialised: bool):
        self._warn = warn_uninitialised
        if not warn_uninitialised:
            # init(enabled=False): `steptrace.step` is bound to this plain function (see _install), no
            # bound method, no keyword-only defaults to fill: the call costs what a do-nothing one does.
            self.step = _off_step  # type: ignore[method-assign]

    def _noop(self) -> None:
        if self._warn:
            self._warn = False
            warnings.warn("steptrace.step() called before steptrace.init(): nothing is recorded. "
                          "Call steptrace.init() once at start-up", SteptraceWarning, stacklevel=4)

    def step(self, n: Any, *, tokens: Any = None, flops: Any = None, samples: Any = None, **attrs: Any) -> Any:
        if self._warn:
            self._noop()
        return NULL_STEP

    def begin_step(self, n: Any, *, tokens: Any = None, flops: Any = None, samples: Any = None, **attrs: Any) -> Any:
        return self.step(n)

    def end_step(self, wait_for: Any = None, error: BaseException | None = None) -> None:
        return None

    def span(self, name: Any, **attrs: Any) -> Any:
        return null_span(name, attrs)  # keeps its name: a decorator applied now times calls after init()

    def begin_span(self, name: Any, **attrs: Any) -> Any:
        return null_span(name, attrs)

    def end_span(self, name: Any = None) -> None:
        return None

    def checkpoint(self, step: Any, *, async_save: bool = False) -> Any:
        return NULL_CHECKPOINT

    def microbatch(self, index: Any, *, stage: Any = None, chunk: Any = None, kind: str = "forward") -> Any:
        return NULL_MICROBATCH

    def flush(self, timeout_s: float | None) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> bool:
        return True


def _off_step(n: Any, **attrs: Any) -> Any:
    """``steptrace.step`` while steptrace is off: accepts what the real one accepts, records nothing."""
    return NULL_STEP


if _handles._hotpath is not None:  # the same function, compiled (steptrace/_hotpath.c)
    _handles._hotpath.set_null_step(NULL_STEP)
    _off_step = _handles._hotpath.off_step  # noqa: F811


_active: Any = _Disabled(warn_uninitialised=True)
_HOT_CALLS = ("step", "span", "checkpoint", "microbatch", "begin_step", "end_step", "begin_span", "end_span")


def _install(runtime: Any) -> None:
    """Make ``runtime`` current and bind the hot calls straight to its methods.

    The module functions below delegate to the current runtime; rebinding the
    module attributes to the runtime's bound methods saves a call level on
    every ``steptrace.step(...)`` (disabled, that is most of the cost). Code
    that did ``from steptrace import step`` keeps the delegating function,
    which stays correct across init/shutdown.
    """
    global _active
    _active = runtime
    namespace = globals()
    for name in _HOT_CALLS:
        namespace[name] = getattr(runtime, name)
_active_config: Config | None = None  # not `_config`: that name is the submodule
_lock = threading.Lock()
_process_hooks_registered = False


def init(*, sinks: Iterable[Any] = (), **settings: Any) -> Config:
    """Start steptrace in this process and return the resolved configuration.

    Settings (all optional; code wins over ``STEPTRACE_*`` environment
    variables, which win over launcher variables such as ``RANK``):
    ``enabled``, ``run_dir``, ``run_id``, ``rank``, ``world_size``,
    ``local_rank``, ``backend`` (``"auto"``, ``"host"``, ``"jax"``,
    ``"torch"`` or a device object such as ``testing.SimulatedDevice``),
    ``peak_tflops`` (for MFU and HFU; else the table for the device kind), ``flops``
    (``"auto"``: every step's hardware FLOPs from the compiler), ``strict`` (misuse raises instead of warning),
    ``annotate`` (profiler annotations), ``max_queue``, ``shutdown_timeout_s``,
    ``jsonl`` (write ``<run_dir>/<run_id>/rank-<rank>.jsonl``, default on; rotated at
    ``jsonl_max_bytes``, default 256 MiB).
    ``trackers`` (``"tensorboard"``, ``"mlflow"``, ``"wandb"``, comma-separated) writes each rank's
    numbers to those trackers (``steptrace.trackers``; ``tensorboard_dir``).
    ``sinks`` adds sink objects (``export``/``force_flush``/``shutdown``, and ``bind(config)``, called
    here, where they have one).

    Bad settings raise ``ValueError`` naming the field. Calling ``init`` again
    shuts the previous run down first.
    """
    global _active_config, _process_hooks_registered
    config = resolve_config(**settings)
    sinks = list(sinks)
    for sink in sinks:
        if not all(callable(getattr(sink, m, None)) for m in ("export", "force_flush", "shutdown")):
            raise ValueError(f"sinks: {sink!r} must have export(records), force_flush(timeout_s) "
                             "and shutdown(timeout_s)")
    with _lock:
        if isinstance(_active, Runtime):
            _active.shutdown(_active.config.shutdown_timeout_s)
        _active_config = config
        if not config.enabled:
            _install(_Disabled(warn_uninitialised=False))
            return config
        from steptrace._attempts import record_attempt, settle_attempt, settle_run_id
        from steptrace._config import warn_once
        from steptrace._devices import Backends

        config, repeated = settle_run_id(config)
        if repeated:
            warn_once(repeated, stacklevel=3)
        config = _active_config = settle_attempt(config)
        backends = Backends(config.backend)
        if config.health == "nvml":
            # A setup error (no pynvml, no driver) before anything is opened; one nvmlInit per process.
            from steptrace import _health

            _health.init_nvml(_health.import_nvml())
        built = _build_sinks(config, sinks)
        record_attempt(config)  # only once the sinks started: a failed init leaves no trace
        from steptrace._resolver import Resolver

        resolver = Resolver(config, built + sinks)
        from steptrace._sinks import DropCounter

        drops = DropCounter(resolver.dropped_snapshot, [worker.name for worker in resolver.sinks])
        for sink in built + sinks:
            # Exporters that publish drop counts (steptrace_dropped_records_total) read them here.
            attach = getattr(sink, "attach_drop_counter", None)
            if callable(attach):
                attach(drops)
        runtime = Runtime(config, resolver, backends)
        backends.init_hooks(runtime, config.backend)
        for sink in built + sinks:
            # Exporters that say where the training thread is (a hung step) read it at scrape time.
            attach_position = getattr(sink, "attach_position", None)
            if callable(attach_position):
                attach_position(runtime.position)
            # The HTTP capture trigger on the rank's /metrics server arms what request_capture() arms.
            attach_capture = getattr(sink, "attach_capture", None)
            if callable(attach_capture) and runtime.capture is not None and "request" in runtime.capture.triggers:
                attach_capture(runtime.capture.request)
        _install(runtime)
        if not _process_hooks_registered:
            atexit.register(_shutdown_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _process_hooks_registered = True
    return config


def _after_fork_in_child() -> None:
    """In a child of ``os.fork()`` (``multiprocessing``'s fork start method, DataLoader workers):
    steptrace is off. The run belongs to the parent; the child's copy of it is dropped without
    finalizing (``Runtime.forked``), so the child neither waits at exit nor writes into the parent's
    files. A child that records calls ``init()`` again, into a run of its own (docs/records.md)."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    runtime = _active
    _install(_Disabled(warn_uninitialised=False))
    if isinstance(runtime, Runtime):
        runtime.forked()


def _build_sinks(config: Config, given: list[Any]) -> list[Any]:
    """The sinks the configuration asks for, and the given sinks bound to it (a tracker opens its run
    in ``bind``); on a setup error, close the ones already opened."""
    built: list[Any] = []
    try:
        for sink in given:
            bind = getattr(sink, "bind", None)
            if callable(bind):
                bind(config)
        from steptrace._config import TRACKER_PER_RANK_MAX_WORLD_SIZE, tracker_writes_here

        if config.trackers and config.tracker_ranks == "auto" and config.rank == 0 \
                and config.world_size > TRACKER_PER_RANK_MAX_WORLD_SIZE:
            from steptrace._config import warn_once

            warn_once(f"steptrace trackers: {config.world_size} ranks, past {TRACKER_PER_RANK_MAX_WORLD_SIZE}: rank 0 "
                      "alone writes its own numbers; the job's view across ranks is the collector's "
                      "(steptrace collector --trackers). tracker_ranks='all' (STEPTRACE_TRACKER_RANKS) writes every "
                      "rank's.", stacklevel=4)
        if config.trackers and tracker_writes_here(config):
            from steptrace.trackers import tracker_sink

            for name in config.trackers:
                tracker = tracker_sink(name)
                tracker.bind(config)
                built.append(tracker)
        if config.prometheus_port is not None:
            from steptrace.prometheus import PrometheusSink

            built.append(PrometheusSink.from_config(config))
        if config.otlp_endpoint is not None:
            from steptrace.otlp import OtlpSink

            built.append(OtlpSink.from_config(config))
        if config.jsonl:
            # Opened last (listed first): a network sink that fails to start, a port
            # already taken say, must not leave an empty run file behind.
            from steptrace._sinks import JsonlSink

            built.insert(0, JsonlSink(os.path.join(config.run_dir, config.run_id, f"rank-{config.rank}.jsonl"),
                                      max_bytes=config.jsonl_max_bytes))
    except BaseException:
        for sink in built + [g for g in given if callable(getattr(g, "bind", None))]:
            try:
                sink.shutdown(0.5)
            except Exception:
                pass
        raise
    return built


def step(n: int, *, tokens: int | float | None = None, flops: int | float | str | None = None,
         samples: int | float | None = None, **attrs: Any) -> Any:
    """Time training step ``n`` (a context manager). Step numbers must increase.

    ``tokens``/``samples`` processed by this rank in the step give tokens/s (from the
    interval). ``flops``: the model FLOPs of the step on this rank's device (MFU's numerator),
    or ``"auto"``: the hardware FLOPs the device executed, from the compiler (XLA cost analysis,
    torch's FLOP counter; HFU's numerator); TFLOP/s is over device compute time (docs/flops.md).
    Extra keyword arguments are recorded as ``attrs``.
    Inside the block call ``s.wait_for(outputs)`` with the step's device outputs.
    """
    return _active.step(n, tokens=tokens, flops=flops, samples=samples, **attrs)


def begin_step(n: int, *, tokens: int | float | None = None, flops: int | float | str | None = None,
               samples: int | float | None = None, **attrs: Any) -> Any:
    """Open step ``n`` without re-indenting a loop: the same step as ``with steptrace.step(n)``,
    closed by :func:`end_step`. Returns the step's handle (``.wait_for``, ``.log``). Opening a
    step while one is open is misuse (warned and counted, or raised with ``strict``)."""
    return _active.begin_step(n, tokens=tokens, flops=flops, samples=samples, **attrs)


def end_step(wait_for: Any = None, error: BaseException | None = None) -> None:
    """Close the step :func:`begin_step` opened. ``wait_for``: the step's device outputs (a value or
    a pytree), as ``s.wait_for``; ``error``: the exception that ended it (recorded as ``status:
    "error"``). Without an open step it is misuse."""
    return _active.end_step(wait_for, error)


def steps(iterable: Iterable[Any], start: int = 0, *, data: str = "data", **step_settings: Any) -> Any:
    """Iterate ``(n, item)`` over ``iterable``, each loop body timed as step ``n`` (from ``start``)
    and each ``next()`` of the iterable as a ``data`` span::

        for n, batch in steptrace.steps(loader, start=resume_step):
            loss = train_step(batch)
            steptrace.wait_for(loss)          # optional: the step's device outputs

    A step ends when the loop asks for the next item, or when it is left: at once on ``break``,
    ``return`` or an exception in the body (which makes it an error step, as in ``with step(n)``);
    if a variable still holds the generator, at the next steptrace call or when the generator is
    closed (docs/records.md). ``step_settings`` (``tokens=``, ``flops=``, ...) apply to every step.
    """
    alive: list[Any] = []
    generator = _steps(iterable, start, data, step_settings, alive)
    # A collection clears weak references before it closes the generator; close() does not.
    alive.append(weakref.ref(generator))
    return generator


def _steps(iterable: Iterable[Any], start: int, data: str, step_settings: dict[str, Any], alive: list[Any]) -> Any:
    from steptrace import _loops

    iterator = iter(iterable)
    n = start
    loop = None  # the last step's loop, reused while the same frame runs the same for loop
    while True:
        with span(data):
            try:
                item = next(iterator)
            except StopIteration:
                return
        handle: Any = begin_step(n, **step_settings)
        if handle is NULL_STEP:
            loop = None
        else:
            # The frame running the loop (the one that resumed this generator) says later where it
            # is. A step that ends other than by the loop asking for more clears the loop's frame
            # (Runtime.end_loop_step): held here, it would make a cycle with a frame holding this
            # generator, and keep that frame's variables until a full collection.
            if loop is None or not _loops.same_loop(loop, sys._getframe().f_back):
                loop = _loops.loop_of(sys._getframe().f_back)
            handle.loop = loop
        try:
            yield n, item
        except GeneratorExit:
            # The loop let go of the generator with the step open: break, return, an exception in
            # its body, close(), or a collection. Which one, _loops reads from where the loop's frame is.
            if handle is not NULL_STEP:
                verdict = _loops.closed(handle.loop, sys._getframe().f_back, collected=alive[0]() is None)
                if verdict is not None and isinstance(_active, Runtime):
                    _active.end_loop_step(handle, verdict)  # if it is still the open step
            raise
        if isinstance(_active, Runtime) and handle is not NULL_STEP and _active.current is handle:
            _active.end_step()
        n += 1


def wait_for(*values: Any) -> None:
    """``wait_for`` on the open step (the form for :func:`begin_step` and :func:`steps` loops);
    nothing when no step is open or steptrace is off."""
    runtime = _active
    handle = runtime.current_step(2) if isinstance(runtime, Runtime) else None
    if handle is not None:
        handle.wait_for(*values)


def log(**scalars: Any) -> None:
    """``log`` on the open step (see ``s.log``); nothing when no step is open or steptrace is off."""
    runtime = _active
    handle = runtime.current_step(2) if isinstance(runtime, Runtime) else None
    if handle is not None:
        handle.log(**scalars)


def restore(step: int | None = None, **attrs: Any) -> Any:
    """Time restoring a checkpoint (of ``step``) as a ``restore`` span: before the first step it is
    the attempt's restore time in the job's accounting (``steptrace report``'s badput table). The
    next step's record carries ``first_after_restore: true``. A hook that learns the step only from
    the restore sets ``attrs["restored_step"]`` on the span it entered, before it closes.

    A restore that raised restored nothing: its span still goes out (the time was spent) with
    ``attrs["error"]`` (the exception) and ``attrs["restored"] = False``, and the next step is not
    marked. The exception propagates unchanged."""
    if step is not None:
        attrs["restored_step"] = step
    handle = span(RESTORE_SPAN, **attrs)
    return _Restore(handle) if isinstance(handle, _handles.SpanHandle) else handle


class _Restore:
    """The ``with`` of :func:`restore`: the span (``as`` gives it), told when the block raised. The
    span's own ``__exit__`` (compiled on the hot path) does not look at the exception; a restore must."""

    __slots__ = ("_span",)

    def __init__(self, handle: Any):
        self._span = handle

    def __enter__(self) -> Any:
        return self._span.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        handle = self._span
        if exc_type is not None:
            attrs = handle.attrs
            attrs["restored"] = False  # nothing was restored: the next step is no first after a restore
            attrs["error"] = f"{exc_type.__name__}: {exc}"[:500]
        return bool(handle.__exit__(exc_type, exc, tb))


def span(name: str, **attrs: Any) -> Any:
    """Time a host span (``"data"``, ``"eval"``, ...). Idle device time it covers is charged to ``name``.

    A context manager (``with steptrace.span("eval"):``) or a decorator: ``@steptrace.span("eval")`` on
    ``def evaluate(): ...`` makes each call a span (decorating before ``init()`` is fine). For a block
    you do not want to re-indent, :func:`begin_span` / :func:`end_span`.
    """
    return _active.span(name, **attrs)


def _current_span(name: str, **attrs: Any) -> Any:
    return _active.span(name, **attrs)


# Decorated functions open their spans through the run current at each call.
_handles.current_span = _current_span


def begin_span(name: str, **attrs: Any) -> Any:
    """Open span ``name`` without re-indenting a block: the same span as ``with steptrace.span(name)``,
    closed by :func:`end_span`. A span begun in a step ends in that step, one begun between steps ends
    between steps (it may enclose whole steps); crossing a step boundary is misuse (warned and counted,
    or raised with ``strict``), reported where it happens."""
    return _active.begin_span(name, **attrs)


def end_span(name: str | None = None) -> None:
    """Close the innermost span :func:`begin_span` opened; ``name``, when given, must be its name.
    Without an open span, or while a ``with steptrace.span`` block opened after it is still open, it
    is misuse."""
    return _active.end_span(name)


def checkpoint(step: int, *, async_save: bool = False) -> Any:
    """Time a checkpoint save named ``step`` (your trainer's number: the state after step ``step``, or
    after ``step`` steps, saved before step ``step`` runs). Its ``blocking_seconds`` is the host time
    after the device finished the step before the save (the record's ``after_step``), which is the next
    step's idle ``checkpoint``. With ``async_save=True`` call ``.async_done()`` when the background
    commit ends."""
    return _active.checkpoint(step, async_save=async_save)


def microbatch(index: int, *, stage: int | None = None, chunk: int | None = None, kind: str = "forward") -> Any:
    """Time one pipeline microbatch inside the current step. ``kind``: ``"forward"``, ``"backward"``, or
    a zero-bubble schedule's split backward, ``"backward_input"`` and ``"backward_weight"``."""
    return _active.microbatch(index, stage=stage, chunk=chunk, kind=kind)


def flush(timeout_s: float | None = None) -> bool:
    """Block until everything recorded so far is finalized and exported. False on timeout."""
    return _active.flush(timeout_s)


def shutdown(timeout_s: float | None = None) -> bool:
    """Finalize, export and stop. Returns within ``timeout_s`` (default from config); False if
    something could not be finished in time (it is counted as dropped). Later calls are no-ops."""
    with _lock:
        runtime = _active
        _install(_Disabled(warn_uninitialised=False))
    if timeout_s is None:
        timeout_s = runtime.config.shutdown_timeout_s if isinstance(runtime, Runtime) else 0.0
    return runtime.shutdown(timeout_s)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception:
        pass


def enabled() -> bool:
    """True when steptrace is initialised and recording."""
    return isinstance(_active, Runtime)


def current_step() -> Any:
    """The step open on the training thread now (its handle: ``.step`` is the number, ``.wait_for``
    and ``.status`` as inside ``with steptrace.step(n) as s``), or None: between steps, before
    ``init()``, or when disabled. Framework hooks use this instead of steptrace's internals."""
    return _active.current_step(2) if isinstance(_active, Runtime) else None


def last_step() -> int | None:
    """The number of the most recent step entered (open or closed), or None before the first one
    or when steptrace is not recording. Hooks use it to name the step a checkpoint saves."""
    return _active.last_step if isinstance(_active, Runtime) else None


def request_capture(reason: str = "requested") -> bool:
    """Take a profiler trace of the next steps (``capture_steps`` of them, from the next step boundary),
    as the ``request`` trigger of deep capture does (docs/capture.md). Safe from any thread and from a
    signal handler. False (and nothing armed) when capture is off (``init(capture=...)``) or steptrace
    is not recording; a capture already armed or running covers this request."""
    runtime = _active
    if not isinstance(runtime, Runtime) or runtime.capture is None or "request" not in runtime.capture.triggers:
        return False
    runtime.capture.request(str(reason)[:200])
    return True


def gc_every(n: int, generation: int = 2) -> Any:
    """Coordinated garbage collection (docs/pauses.md): turns CPython's automatic collection off and returns
    a schedule to call before each step, ``sched(step)``, which collects ``generation`` at every ``n``-th
    step, on every rank at the same steps; ``sched.close()`` turns automatic collection back on. Bad
    arguments raise ``ValueError`` here, never in the loop. Works with steptrace on or off."""
    from steptrace._pauses import GcEvery

    return GcEvery(n, generation)


def config() -> Config | None:
    """The configuration of the current run (None before ``init()``)."""
    return _active_config


def stats() -> dict[str, Any]:
    """Counters of the current run: steps resolved, records emitted, records dropped by reason,
    the sinks' endpoints (e.g. ``{"prometheus": "http://127.0.0.1:9464/metrics"}``), the CPU
    seconds steptrace's background threads used (``background_cpu_seconds``, by thread: what
    they took from the GIL), and each stream device's clock calibration (``device_clock``)."""
    if not isinstance(_active, Runtime):
        return {"steps": 0, "records": 0, "dropped": {}, "endpoints": {}, "background_cpu_seconds": {},
                "device_clock": {}}
    resolver = _active.resolver
    endpoints = {}
    for worker in resolver.sinks:
        endpoint = getattr(worker.sink, "endpoint", None)
        if endpoint:
            endpoints[worker.name] = endpoint
    return {"steps": resolver.steps_resolved, "records": resolver.records_emitted,
            "dropped": resolver.dropped_snapshot(), "endpoints": endpoints,
            "background_cpu_seconds": resolver.background_cpu_seconds(), "device_clock": resolver.clock_stats()}
