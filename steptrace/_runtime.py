"""The training-thread side: step/span/checkpoint/microbatch handles.

Everything here runs on the user's training thread, so it only reads clocks,
records device markers and appends to the resolver's queue. Waiting, the
timing model and export happen on background threads (``_resolver``,
``_sinks``). Misuse is reported through :func:`steptrace._errors.misuse` and
never raises into the loop unless ``strict`` is on.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from steptrace._config import Config
from steptrace._devices import HOST, Backends, Device
from steptrace._errors import misuse
from steptrace._resolver import Resolver

_perf = time.perf_counter
MICROBATCH_KINDS = ("forward", "backward")


class ClosedSpan:
    """A host span that has ended; the resolver charges idle time to it."""

    __slots__ = ("name", "start", "end", "step", "attrs", "emit")

    def __init__(self, name: str, start: float, end: float, step: int | None, attrs: dict, emit: bool = True):
        self.name = name
        self.start = start
        self.end = end
        self.step = step
        self.attrs = attrs
        self.emit = emit  # False when another record (a checkpoint) already describes it


class TimedUnit:
    """Fields shared by steps and microbatches: host times and device markers.

    Defaults live on the class so that creating a handle on the training
    thread only sets what differs (this is the hot path).
    """

    host_start = 0.0
    host_end: float | None = None
    dispatch = 0.0
    values: tuple | None = None
    device: Device = HOST
    stream: Any = None  # the stream device's stream the markers go on
    start_event: Any = None
    start_recorded_after = 0.0  # host clock read just before the start marker was (re-)recorded
    end_event: Any = None
    end_recorded_after = 0.0
    seen_complete = 0.0  # resolver: a host time at which all its markers were known complete
    first_complete_seen = 0.0  # resolver: when it first found them complete (waiting for calibration)


class StepHandle(TimedUnit):
    """Returned by :func:`steptrace.step`; use as a context manager, call :meth:`wait_for` inside."""

    status = "ok"
    error: str | None = None
    spans: "list[ClosedSpan] | tuple" = ()
    open_spans: "list[ClosedSpan] | tuple" = ()
    microbatches: "list[MicrobatchHandle] | tuple" = ()
    submitted = False
    waited = False
    _annotation: Any = None

    def __init__(self, rt: "Runtime", n: int, tokens: Any, flops: Any, samples: Any, attrs: dict):
        self._rt = rt
        self.step = n
        self.tokens = tokens
        self.flops = flops
        self.samples = samples
        self.attrs = attrs

    def __enter__(self) -> "StepHandle":
        rt = self._rt
        if rt.current is not None:
            # Entering twice (or a nested step created earlier) is misuse; keep the outer step.
            rt.misuse(f"step({self.step}) entered while step({rt.current.step}) is still open; "
                      "steps cannot nest: close the outer step first")
            return self
        rt.current = self
        if rt.annotate is not None:
            self._annotation = rt.annotate(self.step)
        self.host_start = self.dispatch = _perf()
        device = rt.backends.stream_for_unit()
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
        backends.timed_by_values = True
        if device is not HOST:
            self.values = values
            # Hand over now so the resolver starts waiting while the host runs ahead.
            self.submitted = True
            rt.resolver.submit(self, urgent=True)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        rt = self._rt
        if rt.current is not self:
            return False
        if self.device.uses_events:
            rt.end_marker(self)
        end = _perf()
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
        if rt.closed_spans:
            self.spans = rt.take_closed_spans()
        if rt.open_spans:
            self.open_spans = [ClosedSpan(s.name, s.start, end, None, {}, False) for s in rt.open_spans]
        # Published last: a device step handed over at wait_for() is finalized by the
        # resolver as soon as host_end is set, so status and spans must be in place first.
        self.host_end = end
        if not self.submitted:
            self.submitted = True
            # No wake-up (it costs the training thread microseconds): a host step's end is
            # known, and a stream step's markers carry their own device times, so neither
            # depends on when the resolver looks; it polls at its own pace.
            rt.resolver.submit(self)
        return False  # never swallow the user's exception


class MicrobatchHandle(TimedUnit):
    """One pipeline microbatch inside a step; device-timed like a step."""

    def __init__(self, rt: "Runtime", step: StepHandle, index: Any, stage: Any, chunk: Any, kind: str):
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

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self.device.uses_events:
            self._rt.end_marker(self)
        self.host_end = _perf()
        step = self._step
        if step.microbatches:
            step.microbatches.append(self)
        else:
            step.microbatches = [self]
        return False


class SpanHandle:
    """A named host span (``data``, ``eval``, ...); idle time it covers is charged to its name."""

    __slots__ = ("_rt", "name", "attrs", "start")

    def __init__(self, rt: "Runtime", name: str, attrs: dict):
        self._rt = rt
        self.name = name
        self.attrs = attrs
        self.start = 0.0

    def __enter__(self) -> "SpanHandle":
        self.start = _perf()
        self._rt.open_spans.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        rt = self._rt
        end = _perf()
        try:
            rt.open_spans.remove(self)
        except ValueError:
            pass
        rt.close_span(self.name, self.start, end, self.attrs)
        return False


class CheckpointHandle:
    """Returned by :func:`steptrace.checkpoint`; the save's host span, tied to the step it saves.

    For an asynchronous save, create it with ``async_save=True`` and call
    :meth:`async_done` (or :meth:`track` a future) when the background commit
    finishes: that time is reported as ``async_seconds`` and never charged to a step.
    """

    __slots__ = ("_rt", "step", "host_start", "host_end", "async_save", "async_end", "status", "error", "_lock")

    def __init__(self, rt: "Runtime", step: int, async_save: bool):
        self._rt = rt
        self.step = step
        self.async_save = async_save
        self.host_start = 0.0
        self.host_end: float | None = None
        self.async_end: float | None = None
        self.status = "ok"
        self.error: str | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CheckpointHandle":
        self.host_start = _perf()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        rt = self._rt
        self.host_end = _perf()
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


class Runtime:
    """One initialised steptrace: configuration, the training-thread state and the background threads."""

    def __init__(self, config: Config, resolver: Resolver, backends: Backends):
        self.config = config
        self.strict = config.strict
        self.resolver = resolver
        self.backends = backends
        self.current: StepHandle | None = None
        self.last_step: int | None = None
        self.open_spans: list[SpanHandle] = []
        self.closed_spans: list[ClosedSpan] = []
        self.pending_async: set[CheckpointHandle] = set()
        self.train_thread: int | None = None
        self.annotate: Callable[[int], Any] | None = None
        self._setup_done = False
        self._device_errors = 0
        self.active = True

    # -- helpers used by the handles -------------------------------------------------
    def misuse(self, message: str) -> None:
        self.resolver.count_drop("misuse")
        misuse(message, strict=self.strict, stacklevel=4)

    def device_failed(self, exc: Exception) -> None:
        """A marker could not be recorded: that unit falls back to host timing (counted, warned once)."""
        self._device_errors += 1
        self.resolver.count_drop("device_marker_error")
        if self._device_errors == 1:
            misuse(f"steptrace could not record a device marker ({exc!r}); such steps fall back to host "
                   "timing", strict=False, stacklevel=5)

    def start_markers(self, unit: TimedUnit, device: Any) -> None:
        """Record ``unit``'s start marker on ``device``'s current stream (training thread)."""
        try:
            stream = device.current_stream()
            if stream is None:
                return  # a graph capture is in progress: no marker may go on this stream
            unit.start_event = device.record(stream)
        except Exception as exc:  # a broken backend must not kill training
            self.device_failed(exc)
            return
        unit.device = device
        unit.stream = stream
        unit.start_recorded_after = unit.host_start

    def end_marker(self, unit: TimedUnit) -> None:
        """Record ``unit``'s end marker; without one the unit is host-timed."""
        device = unit.device
        try:
            stream = unit.stream
            if stream is None:
                stream = unit.stream = device.current_stream()
            if stream is not None:
                unit.end_recorded_after = _perf()
                unit.end_event = device.record(stream)
        except Exception as exc:
            self.device_failed(exc)
        if unit.end_event is None:
            self.drop_markers(unit)
            unit.device = HOST

    def drop_markers(self, unit: TimedUnit) -> None:
        """Give back markers a unit will not be timed by (its values decided another device)."""
        device = unit.device
        for marker in (unit.start_event, unit.end_event):
            if marker is not None:
                try:
                    device.release(marker)
                except Exception:
                    pass
        unit.start_event = unit.end_event = unit.stream = None

    def close_span(self, name: str, start: float, end: float, attrs: dict, emit: bool = True) -> None:
        current = self.current
        self.closed_spans.append(ClosedSpan(name, start, end, None if current is None else current.step, attrs, emit))
        if current is not None and not current.waited and end > current.dispatch:
            # DESIGN §2: host spans inside a step come before its device work, so the
            # end of the last one is the step's dispatch point: the start marker moves there.
            current.dispatch = end
            if current.start_event is not None:
                try:
                    current.device.record(current.stream, current.start_event)
                    current.start_recorded_after = end
                except Exception as exc:
                    self.device_failed(exc)

    def take_closed_spans(self) -> list[ClosedSpan]:
        closed, self.closed_spans = self.closed_spans, []
        return closed

    # -- public API ------------------------------------------------------------------
    def step(self, n: int, *, tokens: Any = None, flops: Any = None, samples: Any = None, **attrs: Any) -> Any:
        """Time training step ``n`` (a context manager; see :func:`steptrace.step`)."""
        if not self.active:
            return NULL_STEP  # a reference kept across shutdown() records nothing
        if not self._setup_done:
            self._first_step_setup()
        if self.current is not None:
            self.misuse(f"step({n}) called inside step({self.current.step}): steps cannot nest. "
                        "Use steptrace.span() or steptrace.microbatch() for work inside a step")
            return NULL_STEP
        if type(n) is not int:
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                self.misuse(f"step number must be an int, got {n!r}: pass the loop counter")
                return NULL_STEP
            n = n.__index__()
        if self.last_step is not None and n <= self.last_step:
            self.misuse(f"step({n}) after step({self.last_step}): step numbers must increase. "
                        "After restoring a checkpoint, continue from the restored step number + 1")
            return NULL_STEP
        if tokens is not None and type(tokens) is not int:
            tokens = self._number("tokens", tokens)
        elif tokens is not None and tokens < 0:
            tokens = self._number("tokens", tokens)
        if flops is not None:
            flops = self._number("flops", flops)
        if samples is not None:
            samples = self._number("samples", samples)
        return StepHandle(self, n, tokens, flops, samples, attrs)

    def _number(self, field: str, value: Any) -> float | int | None:
        # Only plain numbers: float() on a device array would synchronise the device.
        if isinstance(value, (int, float)) and not isinstance(value, bool) or type(value).__module__ == "numpy":
            try:
                number = value.item() if hasattr(value, "item") else value
            except Exception:
                number = None
            if isinstance(number, (int, float)) and number >= 0:
                return number
        self.misuse(f"{field}={value!r} is not a non-negative number; the value is dropped. "
                    f"Pass a Python int/float per step (not a device array, which would force a sync)")
        return None

    def span(self, name: str, **attrs: Any) -> Any:
        """Time a host span (see :func:`steptrace.span`)."""
        if not self.active:
            return NULL_SPAN
        if not isinstance(name, str) or not name:
            self.misuse(f"span name must be a non-empty string, got {name!r}")
            return NULL_SPAN
        return SpanHandle(self, name, attrs)

    def checkpoint(self, step: int, *, async_save: bool = False) -> Any:
        """Time a checkpoint save (see :func:`steptrace.checkpoint`)."""
        if not self.active:
            return NULL_CHECKPOINT
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            self.misuse(f"checkpoint step must be an int, got {step!r}: pass the step being saved")
            return NULL_CHECKPOINT
        return CheckpointHandle(self, step.__index__(), bool(async_save))

    def microbatch(self, index: Any, *, stage: Any = None, chunk: Any = None, kind: str = "forward") -> Any:
        """Time a pipeline microbatch (see :func:`steptrace.microbatch`)."""
        if not self.active:
            return NULL_MICROBATCH
        if kind not in MICROBATCH_KINDS:
            self.misuse(f"microbatch kind={kind!r} is unknown; use 'forward' or 'backward'")
            return NULL_MICROBATCH
        current = self.current
        if current is None:
            self.misuse("microbatch() called outside a step: open `with steptrace.step(n):` around "
                        "the pipeline schedule")
            return NULL_MICROBATCH
        return MicrobatchHandle(self, current, index, stage, chunk, kind)

    def current_step(self) -> StepHandle | None:
        return self.current

    def _first_step_setup(self) -> None:
        """Decide, once, what depends on frameworks the user imported after init()."""
        self._setup_done = True
        # The thread that runs the steps; compile events from other threads are not its idle time.
        self.train_thread = threading.get_ident()
        annotators = []
        if "jax" in sys.modules and self.config.backend in ("auto", "jax"):
            from steptrace.adapters import jax as jax_adapter

            jax_adapter.install_compile_listener(self)
            if self.config.annotate:
                annotators.append(jax_adapter.step_annotator())
        if "torch" in sys.modules and self.config.annotate and self.config.backend in ("auto", "torch"):
            from steptrace.adapters import torch as torch_adapter

            annotators.append(torch_adapter.step_annotator())
        if len(annotators) == 1:
            self.annotate = annotators[0]
        elif annotators:
            self.annotate = _AllAnnotations(annotators)

    def flush(self, timeout_s: float | None) -> bool:
        closed = self.take_closed_spans()
        return self.resolver.flush(closed, timeout_s)

    def shutdown(self, timeout_s: float) -> bool:
        self.active = False
        if self.current is not None:
            self.misuse(f"shutdown() while step({self.current.step}) is open; it is recorded as an error")
            step = self.current
            step.__exit__(RuntimeError, RuntimeError("steptrace.shutdown() inside the step"), None)
        for ckpt in list(self.pending_async):
            ckpt.status = "incomplete"
            ckpt._submit()
        return self.resolver.shutdown(self.take_closed_spans(), timeout_s)


class _AllAnnotations:
    """Both frameworks imported: open each one's step annotation, close them in reverse."""

    __slots__ = ("_annotators", "_opened")

    def __init__(self, annotators: list[Callable[[int], Any]]):
        self._annotators = annotators
        self._opened: list[Any] = []

    def __call__(self, n: int) -> Any:
        opened = [a for a in (annotate(n) for annotate in self._annotators) if a is not None]
        if not opened:
            return None
        combined = _AllAnnotations(self._annotators)
        combined._opened = opened
        return combined

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for annotation in reversed(self._opened):
            annotation.__exit__(exc_type, exc, tb)


# -- no-op objects: disabled steptrace, or a misused call --------------------------------
class _NullContext:
    """Does nothing, fast. Shared singletons; safe to re-enter."""

    __slots__ = ()

    def __enter__(self) -> "_NullContext":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return False

    def wait_for(self, *values: Any) -> None:
        return None

    def async_done(self) -> None:
        return None

    def track(self, future: Any) -> None:
        return None


NULL_STEP = _NullContext()
NULL_SPAN = NULL_STEP
NULL_CHECKPOINT = NULL_STEP
NULL_MICROBATCH = NULL_STEP
