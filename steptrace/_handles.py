"""The training-thread handles: step, microbatch, span and checkpoint.

Everything here runs on the user's training thread, so it only reads clocks,
records device markers (through the runtime) and hands finished units to the
resolver. Handles reach the runtime they belong to through ``rt``, typed by
:class:`HandleRuntime`: what the handles need of it, stated here, which
:class:`steptrace._runtime.Runtime` provides. This module imports neither the
runtime nor the resolver, not even for type hints, so the layers point down:
handles → resolver → runtime → API. Misuse is reported through the runtime
and never raises into the loop unless ``strict`` is on.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

from steptrace._config import ENV_PURE_PYTHON
from steptrace._devices import HOST, Backends, scalar_reader
from steptrace._errors import SteptraceWarning

_perf = time.perf_counter
#: Microbatch kinds: a forward, a full backward, and the two halves of a zero-bubble schedule's split
#: backward (the input gradient, sent on at once; the weight gradient, deferred to fill the bubble).
MICROBATCH_KINDS = ("forward", "backward", "backward_input", "backward_weight")


class ClosedSpan:
    """A host span that has ended; the resolver charges idle time to it."""

    __slots__ = ("name", "start", "end", "step", "attrs", "emit", "marker", "end_marker")

    def __init__(self, name: str, start: float, end: float, step: int | None, attrs: dict, emit: bool = True,
                 marker: Any = None, end_marker: Any = None):
        self.name = name
        self.start = start
        self.end = end
        self.step = step
        self.attrs = attrs
        self.emit = emit  # False when another record (a checkpoint) already describes it
        # (device, marker, host time before recording) of a stream marker recorded on the step's
        # stream as the span began: the device reaches it when it has drained the step's earlier
        # work, which decides the span's idle part. The resolver places and releases it.
        self.marker = marker
        # The same, recorded as the span ended (while its step was still open): the device reaches it
        # once it drained the work queued inside the span, so the span's idle part is a difference of
        # two device timestamps, whatever the placement.
        self.end_marker = end_marker


class TimedUnit:
    """Fields shared by steps and microbatches: host times and device markers.

    Defaults live on the class so that creating a handle on the training
    thread only sets what differs (this is the hot path).
    """

    host_start = 0.0
    host_end: float | None = None
    dispatch = 0.0
    #: True once a wrapped jitted call (steptrace.adapters.jax.timed) said when the device was handed
    #: the step's work: ``dispatch`` is then that moment, not inferred from the spans around it.
    dispatch_seen = False
    values: tuple | None = None
    #: resolver: a value device's pending device-clock end for ``values`` (JAX on a CUDA GPU), if any
    device_end: Any = None
    end_prepared = False  # resolver: whether the value device was asked for one (steps with values only)
    device: Any = HOST  # a Device: HOST, a ValueDevice or a StreamDevice (see _devices)
    stream: Any = None  # the stream device's stream the markers go on
    start_event: Any = None
    start_recorded_after = 0.0  # host clock read just before the start marker was (re-)recorded
    end_event: Any = None
    end_recorded_after = 0.0
    seen_complete = 0.0  # resolver: a host time at which all its markers were known complete
    seen_incomplete = 0.0  # resolver: a host time at which its end marker was still incomplete
    start_g: float | None = None  # resolver: the start marker's time on its device's timeline
    end_g: float | None = None  # resolver: the end marker's time on its device's timeline (None: not located)
    placement_uncertainty: float | None = None  # resolver: how well its end is placed on the host clock


class _Submits(Protocol):
    def submit(self, item: Any, urgent: bool = False) -> None: ...


class HandleRuntime(Protocol):
    """What a handle uses of the runtime it belongs to (:class:`steptrace._runtime.Runtime`)."""

    current: "StepHandle | None"  # the open step; handles set it on entry and exit
    last_step: int | None
    last_step_end: float  # host clock when the last step was left (the rank's position on /metrics)
    open_checkpoint: "CheckpointHandle | None"  # the save in progress, if any
    closed_spans: list[ClosedSpan]  # spans closed since the last step ended (a step's exit takes them)

    @property
    def annotate(self) -> Callable[[int], Any] | None: ...  # a framework's per-step annotation, if any
    @property
    def capture(self) -> Any: ...  # the deep capture (steptrace._capture.Capture), or None
    @property
    def backends(self) -> Backends: ...
    @property
    def resolver(self) -> _Submits: ...
    @property
    def open_spans(self) -> "list[SpanHandle]": ...
    @property
    def pending_async(self) -> "set[CheckpointHandle]": ...

    def misuse(self, message: str) -> None: ...
    def start_markers(self, unit: TimedUnit, device: Any) -> None: ...
    def end_marker(self, unit: TimedUnit) -> None: ...
    def drop_markers(self, unit: TimedUnit) -> None: ...
    def span_marker(self, step: "StepHandle") -> tuple[Any, Any, float] | None: ...
    def close_span(self, name: str, start: float, end: float, attrs: dict, emit: bool = True,
                   marker: tuple[Any, Any, float] | None = None,
                   end_marker: tuple[Any, Any, float] | None = None) -> None: ...
    def take_closed_spans(self) -> list[ClosedSpan]: ...
    def flops_enter(self, step: "StepHandle") -> None: ...  # flops="auto": its counters start
    def flops_exit(self, step: "StepHandle") -> None: ...  # ...and give its hardware FLOPs


# The compiled hot path (steptrace/_hotpath.c, optional): the step handle's hot fields and its per-step
# calls in C. Where it was not built (no C compiler at install), or with STEPTRACE_PURE_PYTHON=1 (read
# once, at import), StepHandle is a plain Python class and its methods below run alone, with the same
# behaviour at a higher cost per step (bench/bench_overhead.py).
def compiled_matching_source(module: Any, source: Path) -> Any:
    """``module`` (the compiled hot path) if it was built from ``source`` as it is now, or where the
    source is not shipped; else None, with a warning: an in-place build that failed (a compile error
    after an edit) leaves the previous binary behind, whose fields and calls may not be the Python
    classes' any more."""
    try:
        text = source.read_bytes()
    except OSError:
        return module  # an install without the source: the binary is the one it shipped
    if hashlib.sha256(text).hexdigest() == getattr(module, "SOURCE_SHA256", None):
        return module
    warnings.warn(f"steptrace: {getattr(module, '__file__', 'the C extension')} was built from another "
                  f"{source.name}; the per-step calls run in Python. Rebuild it: pip install -e .",
                  SteptraceWarning, stacklevel=2)
    return None


_hotpath: Any = None
if os.environ.get(ENV_PURE_PYTHON, "").strip().lower() not in ("1", "true", "yes", "on"):
    try:
        from steptrace import _hotpath  # type: ignore[attr-defined,no-redef]
    except ImportError:
        pass
    else:
        _hotpath = compiled_matching_source(_hotpath, Path(__file__).with_name("_hotpath.c"))


class _PurePython:
    """StepHandle's first base where the compiled one is not used (nothing in it)."""


_StepBase: Any = _hotpath.StepBase if _hotpath is not None else _PurePython


class StepHandle(_StepBase, TimedUnit):
    """Returned by :func:`steptrace.step`; use as a context manager, call :meth:`wait_for` inside.

    With the compiled hot path, ``StepBase`` holds the fields its calls use and makes handles with the
    defaults the class attributes here and on :class:`TimedUnit` declare (a test holds them equal), and
    its ``__enter__``, ``wait_for`` and ``__exit__`` do what the methods below do for a plain step,
    handing anything else to them (see :data:`PYTHON_STEP_METHODS`).
    """

    status = "ok"
    error: str | None = None
    spans: "list[ClosedSpan] | tuple" = ()
    open_spans: "list[ClosedSpan] | tuple" = ()
    microbatches: "list[MicrobatchHandle] | tuple" = ()
    submitted = False
    waited = False
    imperative = False  # opened by begin_step(): end_step() closes it
    #: name -> a float, or a callable the resolver calls after the step ended (see s.log)
    scalars: dict[str, Any] | None = None
    #: seconds this step waited in collectives, and how that was measured (set by an adapter,
    #: e.g. steptrace.adapters.torch_distributed; None: not measured in this step)
    collective_wait = 0.0
    collective_source: str | None = None
    #: when it waited: ``(start, end)`` on ``perf_counter`` per wait (the adapter makes the list)
    collective_windows: "list[tuple[float, float]] | tuple" = ()
    #: NCCL collectives timed on the device (steptrace.adapters.torch_distributed): objects whose
    #: ``resolve()`` the resolver calls once the step ended on the device, and how many were not timed
    device_collectives: "list[Any] | tuple" = ()
    device_collectives_dropped = 0
    _annotation: Any = None
    #: flops="auto": the runtime's FLOP counters look at this step (hardware FLOPs, with their source)
    auto_flops = False
    hardware_flops: float | None = None
    flops_source: str | None = None
    #: a step of a steptrace.steps() loop: the loop running it (a _loops.Loop), until the step ends
    loop: Any = None
    #: its body raised an exception not read yet: the resolver holds the record until it is (_loops)
    error_pending = False
    #: resolver: ``(device_start, end_seen, end_source, host_end, device_memory)`` of a value-timed step
    #: observed as it ended and finalized later with the steps after it (Resolver._observe)
    observed: tuple | None = None
    #: the first step after a ``restore`` span (set by the runtime as the step is made)
    first_after_restore = False
    #: step(n, tokens=, flops=, samples=), checked by the runtime (set on the handle only when given)
    tokens: Any = None
    flops: Any = None
    samples: Any = None

    # Made by the runtime (Runtime.step) without an __init__ call, which the hot path cannot afford:
    # it sets these three; everything else is a class default until a step sets it.
    _rt: "HandleRuntime"
    step: int
    attrs: dict

    def __enter__(self) -> "StepHandle":
        rt = self._rt
        if rt.current is not None:
            # Entering twice (or a nested step created earlier) is misuse; keep the outer step.
            rt.misuse(f"step({self.step}) entered while step({rt.current.step}) is still open; "
                      "steps cannot nest: close the outer step first")
            return self
        capture = rt.capture
        if capture is not None and (capture.pending is not None or capture.active is not None):
            capture.boundary(self.step)  # a profiler starts or stops between steps, never inside one
        rt.current = self
        annotate = rt.annotate
        if annotate is not None:
            self._annotation = annotate(self.step)
        if self.auto_flops:
            rt.flops_enter(self)
        self.host_start = self.dispatch = _perf()
        backends = rt.backends
        if backends.may_stream:
            device = backends.stream_for_unit()
            if device is not None:
                rt.start_markers(self, device)
        return self

    def wait_for(self, *values: Any) -> None:
        """Mark ``values`` (arrays, pytrees) as this step's device outputs.

        The step ends, on the device, when they are ready. The resolver waits
        for them on a background thread; this call returns at once.
        """
        rt = self._rt
        if rt.current is not self:
            rt.misuse("wait_for() called outside its step: call it inside `with steptrace.step(n) as s:`, "
                      "before the block ends")
            return
        if self.waited:
            if self.values is not None and not self.submitted:
                self.values = self.values + values  # several wait_for calls: wait for all of them
            return
        self.waited = True
        if not values:
            return
        backends = rt.backends
        device = backends.for_values(values)
        if (device is not None and device.uses_events and self.device.uses_events and device is not self.device
                and device.name == self.device.name):
            # CUDA tensors on another GPU than the markers' (a rank that never called set_device):
            # time the tensors' GPU; the end marker goes on its current stream.
            rt.drop_markers(self)
            self.device = device
            return
        if device is None or device is self.device or backends.forced_stream is not None:
            return  # the values do not say, or forced markers time every step
        if device.uses_events:
            # CUDA tensors: timed by markers (an end marker at exit even without a start marker).
            self.device = device
            return
        # A value device (JAX), or HOST for values computed synchronously (CPU tensors).
        if self.start_event is not None:
            rt.drop_markers(self)
        self.device = device
        if not backends.timed_by_values:
            backends.set_timed_by_values(True)
        if device is not HOST:
            self.values = values
            # Hand over now so the resolver starts waiting while the host runs ahead.
            self.submitted = True
            rt.resolver.submit(self, urgent=True)

    def log(self, **scalars: Any) -> None:
        """Record named scalars of this step, e.g. ``s.log(loss=loss, grad_norm=g)``.

        Device scalars (a ``jax.Array`` or CUDA tensor of one element) are read by the resolver
        after the step has ended on the device: their copy to the host starts here and nothing
        waits. Host numbers are taken as they are. Anything else is misuse (warned, dropped).
        """
        rt = self._rt
        if rt.current is not self:
            rt.misuse("log() called outside its step: call it inside `with steptrace.step(n) as s:`")
            return
        logged = self.scalars
        if logged is None:
            logged = self.scalars = {}
        for name, value in scalars.items():
            if type(value) is float:  # a host number (the common case) as scalar_reader takes it
                logged[name] = value
                continue
            reader = scalar_reader(value)
            if reader is None:
                rt.misuse(f"log({name}=...): a {type(value).__name__} is not a scalar (a number, or a device "
                          "array or tensor of one element); it is dropped")
                continue
            logged[name] = reader

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        rt = self._rt
        if rt.current is not self:
            return False
        device = self.device
        if device is not HOST and device.uses_events:
            rt.end_marker(self)
        end = _perf()
        if self.auto_flops:
            rt.flops_exit(self)
        if exc_type is not None:
            self.status = "error"
            self.error = f"{exc_type.__name__}: {exc}"
        if self._annotation is not None:
            try:
                self._annotation.__exit__(exc_type, exc, tb)
            except Exception:
                pass
        rt.current = None
        rt.last_step = self.step
        rt.last_step_end = end
        if rt.closed_spans:
            self.spans, rt.closed_spans = rt.closed_spans, []
        crossing = None
        if rt.open_spans:
            self.open_spans = [ClosedSpan(s.name, s.start, end, self.step, {}, False, s.take_marker())
                               for s in rt.open_spans]
            crossing = [s for s in rt.open_spans if s.opened_in is self and not s.crossed]
        # Published last: a device step handed over at wait_for() is finalized by the
        # resolver as soon as host_end is set, so status and spans must be in place first.
        self.host_end = end
        if not self.submitted:
            self.submitted = True
            # No wake-up (it costs the training thread microseconds): a host step's end is
            # known, and a stream step's markers carry their own device times, so neither
            # depends on when the resolver looks; it polls at its own pace.
            rt.resolver.submit(self)
        if crossing:
            # Said where it happens, once the step is recorded (strict mode raises from here).
            for span in crossing:
                span.crossed = True
            names = ", ".join(repr(span.name) for span in crossing)
            rt.misuse(f"step({self.step}) ended with span {names} begun in it still open: a span begun in a "
                      "step ends in it (end_span() before end_step()); its part after the step's end is "
                      "charged to what follows")
        return False  # never swallow the user's exception


_MicrobatchBase: Any = _hotpath.MicrobatchBase if _hotpath is not None else _PurePython


class MicrobatchHandle(_MicrobatchBase, TimedUnit):
    """One pipeline microbatch inside a step; device-timed like a step."""

    def __init__(self, rt: "HandleRuntime", step: StepHandle, index: Any, stage: Any, chunk: Any, kind: str):
        self._rt = rt
        self._step = step
        self.index = index
        self.stage = stage
        self.chunk = chunk
        self.kind = kind

    def __enter__(self) -> "MicrobatchHandle":
        self.host_start = self.dispatch = _perf()
        rt = self._rt
        step_device = self._step.device
        device = step_device if step_device.uses_events else rt.backends.stream_for_unit()
        if device is not None:
            rt.start_markers(self, device)
        return self

    def wait_for(self, *values: Any) -> None:
        """The microbatch's device work ends when ``values`` are ready (JAX)."""
        if not values:
            return
        backends = self._rt.backends
        device = backends.for_values(values)
        if device is None or device.uses_events or backends.forced_stream is not None:
            return
        if self.start_event is not None:
            self._rt.drop_markers(self)
        self.device = device
        if device is not HOST:
            self.values = values

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self.device.uses_events:
            self._rt.end_marker(self)
        self.host_end = _perf()
        step = self._step
        if isinstance(step.microbatches, list):
            step.microbatches.append(self)
        else:
            step.microbatches = [self]
        return False


_SpanBase: Any = _hotpath.SpanBase if _hotpath is not None else object


class SpanHandle(_SpanBase):
    """A named host span (``data``, ``eval``, ...); idle time it covers is charged to its name.

    A context manager, the span of :func:`steptrace.begin_span` (``imperative``), or a decorator.
    Defaults live on the class (as :class:`TimedUnit`'s): making one on the training thread sets
    only what differs (``Runtime.span``, the hot path, skips even the ``__init__`` call).
    """

    start = 0.0
    marker: Any = None  # (device, marker, host time) recorded on the step's stream as it began
    opened_in: "StepHandle | None" = None  # the step open as it began (None: between steps)
    imperative = False  # begun by begin_span(): end_span() ends it
    crossed = False  # a step boundary inside it was reported already

    def __init__(self, rt: "HandleRuntime", name: str, attrs: dict):
        self._rt = rt
        self.name = name
        self.attrs = attrs

    def __enter__(self) -> "SpanHandle":
        rt = self._rt
        self.start = _perf()
        current = self.opened_in = rt.current
        if current is not None and current.start_event is not None:
            # Inside an event-timed step: the device's own timeline says when it ran out of work.
            self.marker = rt.span_marker(current)
        rt.open_spans.append(self)
        return self

    def take_marker(self) -> Any:
        """Hand the span's marker over (once: a marker is released by whoever holds it)."""
        marker, self.marker = self.marker, None
        return marker

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        rt = self._rt
        end = _perf()
        open_spans = rt.open_spans
        if open_spans and open_spans[-1] is self:
            open_spans.pop()  # the innermost: spans end in the reverse order they began
        else:
            try:
                open_spans.remove(self)
            except ValueError:
                pass
        marker = self.marker
        end_marker = None
        if marker is not None:
            self.marker = None  # handed over (see take_marker)
            current = rt.current
            if current is not None and current.device is marker[0]:
                end_marker = rt.span_marker(current)
        rt.close_span(self.name, self.start, end, self.attrs, True, marker, end_marker)
        current = rt.current
        if current is not self.opened_in and not self.crossed and current is not None:
            self._crossed_into(current)
        return False

    def _crossed_into(self, current: "StepHandle") -> None:
        # Begun between steps (or in an earlier step, which its end reported), ended in this one.
        # Recorded all the same; said here, where it happens.
        self.crossed = True
        self._rt.misuse(f"span {self.name!r} begun {_where(self.opened_in)} ended inside step({current.step}): "
                        f"a span begun outside a step ends outside it (end_span() before begin_step()) and one "
                        "begun in a step ends in it")

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``@steptrace.span("eval")``: every call of ``fn`` is a span of this name."""
        return span_decorator(self.name, self.attrs, fn)


def _where(step: "StepHandle | None") -> str:
    return "between steps" if step is None else f"in step({step.step})"


#: ``steptrace.span`` of the run current at each call (set by the API module as it is imported; the
#: handles cannot import the layer above them). A decorated function opens its span through it each
#: time it is called, so a function decorated at import, before init(), is timed by the run started
#: later, and one decorated while steptrace is off costs a no-op span per call.
def _no_api_span(name: str, **attrs: Any) -> Any:
    return NULL_SPAN


current_span: Callable[..., Any] = _no_api_span


def span_decorator(name: str, attrs: dict, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that each call is a span ``name``; a clear error at decoration for what
    cannot be timed that way."""
    if not callable(fn):
        raise TypeError(f"steptrace.span({name!r}) used as a decorator needs a function, got {fn!r}")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        # Their bodies run when the result is awaited or iterated, after the call has returned.
        raise TypeError(f"steptrace.span({name!r}) decorates plain functions; {fn.__qualname__} is a "
                        "coroutine or generator function, whose body runs after the call returns: use "
                        "`with steptrace.span(...)` inside it")

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with current_span(name, **attrs):
            return fn(*args, **kwargs)

    return timed


class CheckpointHandle:
    """Returned by :func:`steptrace.checkpoint`; the save's host span, tied to the step it saves.

    For an asynchronous save, create it with ``async_save=True`` and call
    :meth:`async_done` (or :meth:`track` a future) when the background commit
    finishes: that time is reported as ``async_seconds`` and never charged to a step.

    ``step`` is the trainer's number for the save, whichever way it counts; ``after_step`` is the
    step whose device work preceded the save (None before the first step), read as the save
    begins: its blocking time is the host time after that step's end.
    """

    __slots__ = ("_rt", "step", "after_step", "host_start", "host_end", "async_save", "async_end", "status",
                 "error", "_lock")

    def __init__(self, rt: "HandleRuntime", step: int, async_save: bool):
        self._rt = rt
        self.step = step
        self.after_step: int | None = None
        self.async_save = async_save
        self.host_start = 0.0
        self.host_end: float | None = None
        self.async_end: float | None = None
        self.status = "ok"
        self.error: str | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CheckpointHandle":
        rt = self._rt
        # Which step's end the save waits behind is where it runs, not its number: trainers call
        # the state after n steps either `n - 1` (MaxText, the hooks: saved after step n - 1) or
        # `n` (nanodo, orbax's save(step), Megatron-LM's iteration: saved before step n runs).
        # Between steps it follows the last step. Inside a step it follows that step only once the
        # step's device work was handed over (a JAX step after wait_for, as AXLearn saves); before
        # that (a save at the top of a `steps()` body) the step's work comes after the save, and on
        # a synchronous or stream backend a span inside a step is that step's idle time.
        current = rt.current
        if current is not None and current.submitted:  # inside a step only a value step is submitted
            self.after_step = current.step
        else:
            self.after_step = rt.last_step
        self.host_start = _perf()
        rt.open_checkpoint = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        rt = self._rt
        self.host_end = _perf()
        if rt.open_checkpoint is self:
            rt.open_checkpoint = None
        if exc_type is not None:
            self.status = "error"
            self.error = f"{exc_type.__name__}: {exc}"
        # The save's host time is a span too: it is what the next step's idle time waited on.
        rt.close_span("checkpoint", self.host_start, self.host_end, {"checkpoint_step": self.step}, emit=False)
        if self.async_save and exc_type is None:
            rt.pending_async.add(self)
            with self._lock:
                done = self.async_end is not None
            if done:
                self._submit()
        else:
            rt.resolver.submit(self)
        return False

    def async_done(self) -> None:
        """Call (from any thread) when the background part of the save has finished."""
        with self._lock:
            if self.async_end is not None:
                return
            self.async_end = _perf()
        if self.host_end is not None:
            self._submit()

    def track(self, future: Any) -> None:
        """Call :meth:`async_done` when ``future`` (anything with ``add_done_callback``) completes."""
        future.add_done_callback(lambda _f: self.async_done())

    def _submit(self) -> None:
        # Called from the training thread (exit) and the committing thread (async_done):
        # whichever comes second submits, exactly once.
        rt = self._rt
        with self._lock:
            if self not in rt.pending_async:
                return
            rt.pending_async.discard(self)
        rt.resolver.submit(self)


# -- no-op objects: disabled steptrace, or a misused call --------------------------------
_NullBase: Any = _hotpath.NullBase if _hotpath is not None else object


class _NullContext(_NullBase):
    """Does nothing, fast. Shared singletons; safe to re-enter. (With the compiled hot path its methods
    but ``__call__`` are NullBase's, in C: the same answers, cheaper than a do-nothing Python ``with``.)"""

    __slots__ = ()

    def __enter__(self) -> "_NullContext":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return False

    def wait_for(self, *values: Any) -> None:
        return None

    def log(self, **scalars: Any) -> None:
        return None

    def async_done(self) -> None:
        return None

    def track(self, future: Any) -> None:
        return None

    def __call__(self, fn: Any) -> Any:
        # A span refused as misuse (warned already), used as a decorator: the function as it was.
        return fn


if _hotpath is not None:
    for _name in ("__enter__", "__exit__", "wait_for", "log", "async_done", "track"):
        delattr(_NullContext, _name)  # NullBase's show through
NULL_STEP = _NullContext()
NULL_SPAN = NULL_STEP
NULL_CHECKPOINT = NULL_STEP
NULL_MICROBATCH = NULL_STEP


class NullSpan(_NullContext):
    """A span that records nothing (before init(), or steptrace off) but keeps its name: as a
    decorator, the function's calls open the current run's span (see :data:`current_span`)."""

    __slots__ = ("name", "attrs")

    def __init__(self, name: str, attrs: dict):
        self.name = name
        self.attrs = attrs

    def __call__(self, fn: Any) -> Any:
        return span_decorator(self.name, self.attrs, fn)


_null_spans: dict[Any, NullSpan] = {}


def null_span(name: Any, attrs: dict) -> NullSpan:
    """The no-op span named ``name``: shared per name (no allocation on the disabled path), at most a
    few hundred names kept."""
    if not attrs:
        try:
            span = _null_spans.get(name)
        except TypeError:  # an unhashable "name": misuse the enabled path reports
            return NullSpan(name, attrs)
        if span is not None:
            return span
    span = NullSpan(name, attrs)
    if not attrs and len(_null_spans) < 512:
        _null_spans[name] = span
    return span


#: The Python definitions of the step handle's per-step calls. With the compiled hot path they are taken
#: off the class (its compiled ones show through) and called by it for everything but a plain step.
PYTHON_STEP_METHODS: dict[str, Any] = {
    "__enter__": StepHandle.__enter__, "wait_for": StepHandle.wait_for, "__exit__": StepHandle.__exit__,
    "log": StepHandle.log,
}
#: StepHandle's class defaults that are fields of the compiled base (which sets the same values).
STEP_BASE_DEFAULTS: dict[str, Any] = {
    name: StepHandle.__dict__[name]
    for name in ("waited", "submitted", "spans", "_annotation", "auto_flops", "scalars", "loop")
}
#: The same for the microbatch handle (its fields' defaults are TimedUnit's, which the compiled base sets).
PYTHON_MICROBATCH_METHODS: dict[str, Any] = {
    "__enter__": MicrobatchHandle.__enter__, "wait_for": MicrobatchHandle.wait_for,
    "__exit__": MicrobatchHandle.__exit__,
}
#: The same for the span handle.
PYTHON_SPAN_METHODS: dict[str, Any] = {"__enter__": SpanHandle.__enter__, "__exit__": SpanHandle.__exit__}
SPAN_BASE_DEFAULTS: dict[str, Any] = {
    name: SpanHandle.__dict__[name] for name in ("start", "marker", "opened_in", "crossed")
}
if _hotpath is not None:
    for _name in (*PYTHON_STEP_METHODS, *STEP_BASE_DEFAULTS):
        delattr(StepHandle, _name)  # else they would hide the compiled base's
    for _name in (*PYTHON_SPAN_METHODS, *SPAN_BASE_DEFAULTS):
        delattr(SpanHandle, _name)
    for _name in PYTHON_MICROBATCH_METHODS:
        delattr(MicrobatchHandle, _name)
