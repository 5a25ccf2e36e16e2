"""The runtime: one initialised steptrace, the state the handles share on the training thread.

The handles (``_handles``) call back into it to record device markers and to
report misuse; it owns the resolver (``_resolver``) that turns finished units
into records on a background thread. Misuse is reported through
:func:`steptrace._errors.misuse` and never raises into the loop unless
``strict`` is on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from steptrace import _attribution as attribution
from steptrace import _handles
from steptrace import _loops as loops
from steptrace._config import Config
from steptrace._devices import TORCH_TENSORS, HOST, Backends
from steptrace._errors import misuse
from steptrace._handles import (
    MICROBATCH_KINDS,
    NULL_CHECKPOINT,
    NULL_MICROBATCH,
    NULL_SPAN,
    NULL_STEP,
    CheckpointHandle,
    ClosedSpan,
    MicrobatchHandle,
    SpanHandle,
    StepHandle,
    TimedUnit,
    null_span,
)
from steptrace._resolver import Resolver, RunStart
from steptrace._schema import DROP_DEVICE_MARKER_ERROR, DROP_MISUSE, RESTORE_SPAN

_perf = time.perf_counter
_get_ident = threading.get_ident
_new = object.__new__
_new_step = StepHandle.__new__  # object.__new__, or the compiled base's (which sets the handle's defaults)
_new_span = SpanHandle.__new__


def _in_body(loop: Any, caller: Any) -> bool:
    """The fast answer for a call made straight from a ``steps()`` loop's body (a span, ``wait_for``
    in it): the caller is the loop's frame, inside the body. False means: ask ``follow_loop``."""
    return caller is loop.frame and caller.f_lasti in loop.body


class _PurePython:
    """Runtime's base where the compiled hot path is not used (nothing in it)."""


# The compiled hot path (steptrace/_hotpath.c; see steptrace._handles): RuntimeBase holds the
# training-thread state its calls read (current, last_step, ...) and runs step() for a plain step.
_RuntimeBase: Any = _handles._hotpath.RuntimeBase if _handles._hotpath is not None else _PurePython


class Runtime(_RuntimeBase):
    """One initialised steptrace: configuration, the training-thread state and the background threads."""

    def __init__(self, config: Config, resolver: Resolver, backends: Backends):
        self.config = config
        self.strict = config.strict
        self.auto_flops = config.flops == "auto"
        self.resolver = resolver
        self.backends = backends
        self.current: StepHandle | None = None
        self.last_step: int | None = None
        self.last_step_end = 0.0  # host clock when the last step was left (where the thread has been since)
        self.open_spans: list[SpanHandle] = []
        self.open_checkpoint: CheckpointHandle | None = None
        self.closed_spans: list[ClosedSpan] = []
        #: A ``restore`` span closed between steps: the next step is the first after a restore
        #: (its record says so; its one-off cost is separated in the analysis, docs/goodput.md).
        self.restored = False
        #: auto_flops or restored: the next step is more than a number (one test in step())
        self._step_extras = self.auto_flops
        self.pending_async: set[CheckpointHandle] = set()
        self.train_thread: int | None = None
        #: The thread that called init(): the training thread until the first step says otherwise.
        self.init_thread = threading.get_ident()
        self.annotate: Callable[[int], Any] | None = None
        self.annotate_enabled: Callable[[], bool] | None = None
        self._setup_done = False
        self._device_errors = 0
        self.active = True
        #: active and set up: step() and span() take their fast path (one test instead of two)
        self._hot = False
        #: The process this run belongs to: a forked child's copy never finalizes it (see forked()).
        self.pid = os.getpid()
        #: A steps() step whose body raised, its exception not read yet (see follow_loop()).
        self.unsettled: StepHandle | None = None
        #: flops="auto": what counts hardware FLOPs (set up at the first such step; see _devices)
        self.flop_counters: list[Any] | None = None
        self._auto_steps = 0
        self._auto_counted = False
        self.stall_watch: Any = None
        if config.stall_watch:
            from steptrace._stall import StallWatch

            self.stall_watch = StallWatch(position=self.position, train_thread=lambda: self.train_thread,
                                          emit=resolver.emit_now, build=resolver.records,
                                          unix_offset=resolver.unix_offset, factor=config.stall_factor,
                                          min_s=config.stall_min_s)
            resolver.on_step_interval = self.stall_watch.step_finalized
        #: GPU health (steptrace/_health.py): its sampler starts at the first step, once the GPU is known.
        self.health: Any = None
        #: Host pauses (steptrace/_pauses.py): watched from the first step, on the thread that runs it.
        self.pauses: Any = None
        #: Deep capture (steptrace/_capture.py): armed by a trigger, run at step boundaries.
        self.capture: Any = None
        if config.capture:
            from steptrace._capture import Capture

            self.capture = Capture(
                directory=os.path.join(config.run_dir, config.run_id, "captures", f"rank-{config.rank}"),
                triggers=config.capture, profiler=config.capture_profiler, steps=config.capture_steps,
                cooldown_steps=config.capture_cooldown_steps, max_captures=config.capture_max,
                max_bytes=config.capture_max_bytes, window_steps=config.capture_window_steps,
                slow_factor=config.capture_slow_factor, slow_mad=config.capture_slow_mad,
                emit=resolver.emit_now, build=resolver.records,
                span=lambda name, start, end: self.close_span(name, start, end, {}),
                spike_scalar=config.capture_spike_scalar, collector_url=config.otlp_endpoint,
                headers=config.otlp_headers, poll_s=config.capture_poll_s)
            resolver.on_step_finalized = self.capture.step_finalized
            if self.stall_watch is not None and "stall" in config.capture:
                watch_emit, capture = self.stall_watch._emit, self.capture

                def emit_and_arm(records: list[dict[str, Any]]) -> None:
                    watch_emit(records)
                    for record in records:
                        if record.get("type") == "stall":
                            capture.stalled(record["step"], record["open_seconds"])

                self.stall_watch._emit = emit_and_arm

    # -- helpers used by the handles -------------------------------------------------
    def misuse(self, message: str) -> None:
        self.resolver.count_drop(DROP_MISUSE)
        # Reached from the public calls through one to four of steptrace's frames (a bad count via
        # _number, begin_step via step, a steps() loop, the module-level log()): a fixed stacklevel
        # is right for one depth only, so the warning goes to the first frame outside steptrace.
        misuse(message, strict=self.strict, stacklevel=None)

    def device_failed(self, exc: Exception) -> None:
        """A marker could not be recorded: that unit falls back to host timing (counted, warned once)."""
        self._device_errors += 1
        self.resolver.count_drop(DROP_DEVICE_MARKER_ERROR)
        if self._device_errors == 1:
            misuse(f"steptrace could not record a device marker ({exc!r}); such steps fall back to host "
                   "timing", strict=False, stacklevel=5)

    def start_markers(self, unit: TimedUnit, device: Any) -> None:
        """Record ``unit``'s start marker on ``device``'s current stream (training thread)."""
        try:
            stream = device.current_stream()
            if stream is None:
                return  # a graph capture is in progress: no marker may go on this stream
            # A backend of several GPUs (torch) names the GPU of the stream: the unit is timed there.
            device = getattr(stream, "steptrace_device", device)
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
            self.host_timed(unit)

    def host_timed(self, unit: TimedUnit) -> None:
        """``unit`` lost its end marker: it gives back its markers and is timed by the host clock."""
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

    def span_marker(self, step: StepHandle) -> tuple[Any, Any, float] | None:
        """Record a marker on ``step``'s stream as a host span begins or ends inside it (training thread):
        ``(device, marker, host time read before recording)``, or None (none may be recorded now: a
        CUDA graph is being captured)."""
        device = step.device
        recorded_after = _perf()
        try:
            marker = device.record(step.stream)
        except Exception as exc:
            self.device_failed(exc)
            return None
        return None if marker is None else (device, marker, recorded_after)

    def close_span(self, name: str, start: float, end: float, attrs: dict, emit: bool = True,
                   marker: tuple[Any, Any, float] | None = None,
                   end_marker: tuple[Any, Any, float] | None = None) -> None:
        if self.unsettled is not None:
            self.follow_loop(depth=3)  # a span's exit during an exception's unwinding sees the exception
        current = self.current
        closed = _new(ClosedSpan)  # every slot set here: ClosedSpan(...) without its __init__ call
        closed.name = name
        closed.start = start
        closed.end = end
        closed.step = None if current is None else current.step
        closed.attrs = attrs
        closed.emit = emit
        closed.marker = marker
        closed.end_marker = end_marker
        self.closed_spans.append(closed)
        if current is None:
            if name == RESTORE_SPAN and attrs.get("restored") is not False:  # False: nothing was restored
                self.restored = self._step_extras = True
            return
        # Only a value device (JAX) uses this: it shows its work at wait_for(), so a span closing
        # before that precedes the work. Host and stream devices know when the device drained.
        # A dispatch the jitted call itself reported (dispatched()) is not inferred.
        if current.dispatch_seen:
            return
        moved = attribution.dispatch_after_span(current.dispatch, current.waited, end)
        if moved is not None:
            current.dispatch = moved

    def dispatched(self) -> None:
        """A jitted call wrapped by :func:`steptrace.adapters.jax.timed` returned on the training thread:
        the device has been handed that work. The first such call in a step is the step's dispatch
        point (its device work cannot start earlier); outside a step, or on another thread, nothing."""
        step = self.current
        if step is None or step.dispatch_seen or threading.get_ident() != self.train_thread:
            return
        if not self.active or self.pid != os.getpid():  # shut down, or a forked child's copy
            return
        step.dispatch = time.perf_counter()
        step.dispatch_seen = True

    def flops_enter(self, step: StepHandle) -> None:
        """A flops="auto" step opens: its counters start (training thread; a failure is never the loop's)."""
        counters = self.flop_counters
        if counters is None:
            counters = self.flop_counters = self.backends.flop_counters(self)
        for counter in counters:
            try:
                counter.enter(step)
            except Exception:
                pass

    def flops_exit(self, step: StepHandle) -> None:
        """A flops="auto" step closes: every counter stops; the first that knows gives the step's
        hardware FLOPs and their source."""
        for counter in self.flop_counters or ():
            try:
                flops = counter.exit(step)
            except Exception:
                continue
            if flops is not None and step.hardware_flops is None:
                step.hardware_flops, step.flops_source = flops, counter.source
                self._auto_counted = True
        self._auto_steps += 1
        if self._auto_steps == 3 and not self._auto_counted:
            misuse("flops='auto': no hardware FLOPs after 3 steps. JAX: the step's program must be compiled "
                   "inside a step (steptrace reads XLA's cost analysis as it compiles), not in a warm-up "
                   "call before the loop; PyTorch: its operators run inside the step. Pass "
                   "step(n, flops=<model FLOPs>) otherwise (docs/flops.md)", strict=False, stacklevel=5)

    def take_closed_spans(self) -> list[ClosedSpan]:
        closed, self.closed_spans = self.closed_spans, []
        return closed

    # -- steptrace.steps() loops (see _loops) ------------------------------------------
    def follow_loop(self, new_step: bool = False, depth: int = 2, start: Any = None) -> None:
        """At a steptrace call: end the open ``steps()`` step if its loop was left (``break``, ``return``,
        an exception) while a variable still holds the generator, which closes nothing, and read the
        exception of a step whose body raised, if it can be read now. Only on the loop's thread: no
        other thread can say where the loop is. ``new_step``: the call opens a step; ``start`` the
        frame of steptrace's caller, else ``depth``: how many frames up it is (2: the caller of the
        method that calls this)."""
        here = _get_ident()
        current = self.current
        loop = None if current is None else current.loop
        if current is not None and loop is not None and loop.thread == here:
            if start is None:
                try:
                    start = sys._getframe(depth)
                except ValueError:
                    start = sys._getframe()
            # The common case first, inline (spans inside the body cost this on every call): the
            # loop's frame is up the caller's stack, inside the body.
            consumer, frame = loop.frame, start
            while frame is not None and frame is not consumer:
                frame = frame.f_back
            if frame is None or consumer.f_lasti not in loop.body:
                verdict = loops.position(loop, start, new_step=new_step)
                if verdict != loops.RUNNING:
                    self.end_loop_step(current, verdict)
        unsettled = self.unsettled
        if unsettled is not None and (unsettled.loop is None or unsettled.loop.thread == here):
            self.unsettled = None
            loops.settle(unsettled, on_loop_thread=True, give_up=True)

    def end_loop_step(self, step: StepHandle, verdict: str) -> None:
        """End ``step`` of a ``steps()`` loop that was left (``verdict``: ``LEFT`` or ``RAISED``), now,
        on the loop's thread. An exception that left the body makes it an error step, as in
        ``with step()``; one that cannot be read yet leaves its text to be read (``unsettled``)."""
        if self.current is not step:
            return
        loop = step.loop
        exc = loops.exception_of(loop, on_loop_thread=True) if loop is not None else None
        if exc is not None:
            loops.release(loop)
            step.loop = None
            step.__exit__(type(exc), exc, exc.__traceback__)
        elif verdict == loops.RAISED and loop is not None:
            step.status, step.error, step.error_pending = "error", loops.unread_error(loop), True
            self.unsettled = step  # its loop is released once the exception's text is settled
            step.__exit__(None, None, None)
        else:
            loops.release(loop)
            step.loop = None
            step.__exit__(None, None, None)

    def _settle_now(self) -> None:
        """flush() and shutdown(): a pending error text is read now or never (records must go out)."""
        unsettled, self.unsettled = self.unsettled, None
        if unsettled is not None:
            loop = unsettled.loop
            loops.settle(unsettled, on_loop_thread=loop is not None and loop.thread == threading.get_ident(),
                         give_up=True)

    # -- public API ------------------------------------------------------------------
    def step(self, n: int, **attrs: Any) -> Any:
        """Time training step ``n`` (a context manager; see :func:`steptrace.step`): ``tokens``,
        ``flops`` and ``samples`` are read out of ``attrs``, the rest are the step's attrs.

        The hot path (``steptrace.step`` is bound to this method): keyword-only parameters with
        defaults cost a lookup each per call even when not passed, so they come out of ``attrs``
        only when there are any; everything rare (the first step, a ``steps()`` loop to follow,
        misuse, counts to check) is behind one test each."""
        if attrs:
            tokens = attrs.pop("tokens", None)
            flops = attrs.pop("flops", None)
            samples = attrs.pop("samples", None)
        else:
            tokens = flops = samples = None
        if not self._hot or self.current is not None or self.unsettled is not None:
            refusal = self._step_refusal(n)
            if refusal is not None:
                if refusal:
                    self.misuse(refusal)
                return NULL_STEP
        if type(n) is not int:
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                self.misuse(f"step number must be an int, got {n!r}: pass the loop counter")
                return NULL_STEP
            n = n.__index__()
        last = self.last_step
        if last is not None and n <= last:
            self.misuse(f"step({n}) after step({last}): step numbers must increase. "
                        "After restoring a checkpoint, continue from the restored step number + 1")
            return NULL_STEP
        # The handle is made without StepHandle's __init__ (a Python __init__ call costs about as much
        # as the rest of this method): its defaults live on the class, these three differ per step.
        handle = _new_step(StepHandle)
        handle._rt = self
        handle.step = n
        handle.attrs = attrs
        if tokens is None and flops is None and samples is None and not self._step_extras:
            return handle
        if tokens is not None and (type(tokens) is not int or tokens < 0):
            tokens = self._number("tokens", tokens)
        auto = self.auto_flops
        if flops is not None:
            if type(flops) is str and flops == "auto":
                auto, flops = True, None
            else:
                flops = self._number("flops", flops)
        if samples is not None:
            samples = self._number("samples", samples)
        if tokens is not None:
            handle.tokens = tokens
        if flops is not None:
            handle.flops = flops
        if samples is not None:
            handle.samples = samples
        if self.restored:
            self.restored = False
            self._step_extras = self.auto_flops
            handle.first_after_restore = True
        if auto:
            handle.auto_flops = True
        return handle

    def _step_refusal(self, n: Any) -> str | None:
        """The rare checks before a step opens: the first step's setup, a ``steps()`` loop left while
        a variable holds its generator (its step ends here). None: the step opens; "": it does not
        (steptrace shut down: a reference kept across shutdown() records nothing); else the misuse
        to report (said by :meth:`step`, so the warning points at the user's line)."""
        if not self.active:
            return ""
        if not self._setup_done:
            self._first_step_setup()
        current = self.current
        if (current is not None and current.loop is not None) or self.unsettled is not None:
            self.follow_loop(new_step=True, depth=3)  # a steps() loop left while a variable holds its generator
        if self.current is not None:
            return (f"step({n}) called inside step({self.current.step}): steps cannot nest. "
                    "Use steptrace.span() or steptrace.microbatch() for work inside a step")
        return None

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
        current = self.current
        if self.active and self.unsettled is None and type(name) is str and name and (
                current is None or current.loop is None):
            # The common case, in one test; the handle made without an __init__ call (its defaults
            # live on the class), which costs as much as the rest of this method.
            span = _new_span(SpanHandle)
            span._rt = self
            span.name = name
            span.attrs = attrs
            return span
        if not self.active:
            return null_span(name, attrs)  # a reference kept across shutdown(): records nothing
        current = self.current
        if current is not None and current.loop is not None and not _in_body(current.loop, sys._getframe(1)):
            self.follow_loop()
        if self.unsettled is not None:
            self.follow_loop()
        if not isinstance(name, str) or not name:
            self.misuse(f"span name must be a non-empty string, got {name!r}")
            return NULL_SPAN
        return SpanHandle(self, name, attrs)

    def checkpoint(self, step: int, *, async_save: bool = False) -> Any:
        """Time a checkpoint save (see :func:`steptrace.checkpoint`)."""
        if not self.active:
            return NULL_CHECKPOINT
        current = self.current
        if current is not None and current.loop is not None and not _in_body(current.loop, sys._getframe(1)):
            self.follow_loop()
        if self.unsettled is not None:
            self.follow_loop()
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            self.misuse(f"checkpoint step must be an int, got {step!r}: pass the step being saved")
            return NULL_CHECKPOINT
        return CheckpointHandle(self, step.__index__(), bool(async_save))

    def microbatch(self, index: Any, *, stage: Any = None, chunk: Any = None, kind: str = "forward") -> Any:
        """Time a pipeline microbatch (see :func:`steptrace.microbatch`)."""
        if not self.active:
            return NULL_MICROBATCH
        if kind not in MICROBATCH_KINDS:
            self.misuse(f"microbatch kind={kind!r} is unknown; use one of {', '.join(MICROBATCH_KINDS)}")
            return NULL_MICROBATCH
        current = self.current
        if current is not None and current.loop is not None and not _in_body(current.loop, sys._getframe(1)):
            self.follow_loop()
            current = self.current
        if self.unsettled is not None:
            self.follow_loop()
        if current is None:
            self.misuse("microbatch() called outside a step: open `with steptrace.step(n):` around "
                        "the pipeline schedule")
            return NULL_MICROBATCH
        return MicrobatchHandle(self, current, index, stage, chunk, kind)

    def begin_step(self, n: int, *, tokens: Any = None, flops: Any = None, samples: Any = None,
                   **attrs: Any) -> Any:
        """Open step ``n`` without a ``with`` block (see :func:`steptrace.begin_step`)."""
        current = self.current
        if current is not None and current.loop is not None and self.active:
            self.follow_loop(new_step=True)
        if self.current is not None:
            self.misuse(f"begin_step({n}) while step({self.current.step}) is open: call "
                        "steptrace.end_step() first (steps cannot nest)")
            return NULL_STEP
        handle = self.step(n, tokens=tokens, flops=flops, samples=samples, **attrs)
        if handle is not NULL_STEP:
            handle.__enter__()
            handle.imperative = True
        return handle

    def end_step(self, wait_for: Any = None, error: BaseException | None = None) -> None:
        """Close the step :meth:`begin_step` opened (see :func:`steptrace.end_step`)."""
        current = self.current
        if current is None:
            self.misuse("end_step() without an open step: call steptrace.begin_step(n) first")
            return
        if not current.imperative:
            self.misuse(f"end_step() while step({current.step}) is a `with` block: it ends when the block does")
            return
        if wait_for is not None:
            current.wait_for(wait_for)
        current.loop = None  # a steps() step: its loop's frame is not kept past the step
        if error is None:
            current.__exit__(None, None, None)
        else:
            current.__exit__(type(error), error, error.__traceback__)

    def begin_span(self, name: str, **attrs: Any) -> Any:
        """Open a span without a ``with`` block (see :func:`steptrace.begin_span`)."""
        if not self.active:
            return null_span(name, attrs)
        current = self.current
        if current is not None and current.loop is not None and not _in_body(current.loop, sys._getframe(1)):
            self.follow_loop()
        if self.unsettled is not None:
            self.follow_loop()
        if not isinstance(name, str) or not name:
            self.misuse(f"span name must be a non-empty string, got {name!r}")
            return NULL_SPAN
        handle = SpanHandle(self, name, attrs)
        handle.__enter__()
        handle.imperative = True
        return handle

    def end_span(self, name: str | None = None) -> None:
        """Close the innermost span :meth:`begin_span` opened (see :func:`steptrace.end_span`)."""
        current = self.current
        if current is not None and current.loop is not None and not _in_body(current.loop, sys._getframe(1)):
            self.follow_loop()
        if self.unsettled is not None:
            self.follow_loop()
        if not self.open_spans:
            self.misuse("end_span() without an open span: call steptrace.begin_span(name) first")
            return
        innermost = self.open_spans[-1]
        if not innermost.imperative:
            self.misuse(f"end_span() while span {innermost.name!r} is a `with` block: it ends when the block does")
            return
        if name is not None and name != innermost.name:
            self.misuse(f"end_span({name!r}) while span {innermost.name!r}, begun after it, is open: spans end "
                        "in the reverse order they began")
            return
        innermost.__exit__(None, None, None)

    def current_step(self, depth: int = 1) -> StepHandle | None:
        """The open step (after a ``steps()`` loop left with its generator held has ended its step);
        ``depth``: how many frames up steptrace's caller is (1: this method's caller)."""
        current = self.current
        if current is not None and current.loop is not None:
            try:
                caller = sys._getframe(depth)
            except ValueError:
                caller = sys._getframe()
            if not _in_body(current.loop, caller):
                self.follow_loop(start=caller)
                current = self.current
        if self.unsettled is not None:
            self.follow_loop()
            current = self.current
        return current

    def position(self) -> tuple[int, bool, float, str | None] | None:
        """Where the training thread is now, read from another thread (a ``/metrics`` scrape).

        ``(step, in_step, seconds, span)``: the step open now (``in_step``) or, between steps,
        the last one entered; the seconds since that step was entered, or since it was left;
        the innermost host span or checkpoint opened since then and open now (None when none
        is). None before the
        first step: start-up and compilation are not a stall. Only reads attributes the
        training thread sets, so it neither locks nor slows that thread; a value read while
        the thread moves on describes a moment ago, never a torn step.
        """
        now = _perf()
        current = self.current
        if current is not None:
            step, in_step = current.step, True
            # host_start is set just after `current` (0.0 in between): that step opened just now.
            since = current.host_start or now
        elif self.last_step is not None:
            step, in_step, since = self.last_step, False, self.last_step_end
        else:
            return None
        # The innermost span or checkpoint opened since that boundary: one opened before it
        # (a span around the whole loop) encloses the step and says nothing about where it is.
        span, opened = None, since
        try:
            innermost = self.open_spans[-1] if self.open_spans else None
        except IndexError:  # closed between the test and the read
            innermost = None
        if innermost is not None and innermost.start >= opened:
            span, opened = innermost.name, innermost.start
        checkpoint = self.open_checkpoint
        if checkpoint is not None and checkpoint.host_start >= opened:
            span = "checkpoint"
        return step, in_step, max(0.0, now - since), span

    def _first_step_setup(self) -> None:
        """Decide, once, what depends on frameworks the user imported after init()."""
        self._setup_done = True
        self._hot = self.active
        # The thread that runs the steps; compile events from other threads are not its idle time.
        self.train_thread = threading.get_ident()
        self.annotate = self.backends.framework_hooks(self, self.config.backend, self.config.annotate)
        # Its cheap check, where it has one (annotate(n) returns None while it says False): the compiled
        # step calls that instead of annotate itself.
        self.annotate_enabled = getattr(self.annotate, "enabled", None)
        # The GPU this rank's steps are timed on, chosen here on the training thread (the resolver's own
        # current device is 0 whatever the rank's is): the run's device kind, so its peak FLOP/s.
        cuda_index = self.backends.cuda_index()
        self.resolver.submit(RunStart(_perf(), dict(self.config.tags), cuda_index=cuda_index))
        if self.config.health == "nvml":
            self._start_health(cuda_index)
        if self.config.pauses:
            self._start_pauses()

    def _start_pauses(self) -> None:
        """Host pauses (steptrace/_pauses.py): the collections of this thread, the one running the steps, and
        its scheduler counters, which the resolver reads as it finalizes each step."""
        from steptrace._pauses import HostPauses

        pauses = HostPauses(_handles._hotpath)
        try:
            pauses.start()
        except Exception as exc:
            misuse(f"steptrace could not watch host pauses ({exc}); steps are recorded without them",
                   strict=False, stacklevel=6)
            pauses.close()
            return
        self.pauses = pauses
        self.resolver.pauses = pauses

    def _start_health(self, cuda_index: int | None) -> None:
        """The health sampler of the GPU this rank is timed on (its own thread reads NVML); a failure
        is said once and never the loop's."""
        from steptrace import _health

        uuid = None
        if cuda_index is not None and self.config.health_device is None:
            from steptrace.adapters.torch import nvml_uuid

            uuid = nvml_uuid(cuda_index)
        try:
            self.health = _health.start(self.config, uuid, self.resolver.unix_offset)
        except Exception as exc:
            misuse(f"steptrace could not start GPU health sampling ({exc}); steps are recorded without it",
                   strict=False, stacklevel=6)
            return
        self.resolver.health = self.health

    def flush(self, timeout_s: float | None) -> bool:
        if os.getpid() != self.pid:
            self.forked()  # a child forked without the at-fork hook: no resolver thread to wait for
            return True
        current = self.current
        if current is not None and current.loop is not None:
            self.follow_loop()
        self._settle_now()
        closed = self.take_closed_spans()
        return self.resolver.flush(closed, timeout_s)

    def forked(self) -> None:
        """In a child made by ``os.fork()``: this copy of the parent's run records nothing and never
        finalizes it. The child has the parent's memory but only the forking thread: no resolver, no
        sink threads; its queues and open files are copies of the parent's. Finalizing it would wait
        for those threads (the whole shutdown timeout) and write a second ``run`` record into the
        parent's file while the parent still trains. Handles the child still holds (it forked inside
        a step) close as no-ops, and anything they hand over is discarded."""
        self.active = self._hot = False
        self.current = None
        self.open_checkpoint = None
        self.open_spans.clear()
        self.closed_spans.clear()
        self.pending_async.clear()
        if self.health is not None:
            self.health.forked()
        if self.pauses is not None:
            self.pauses.close()  # the child's collections are not the parent's training thread's
            self.pauses = self.resolver.pauses = None
        self.resolver.forked()

    def shutdown(self, timeout_s: float) -> bool:
        if os.getpid() != self.pid:
            self.forked()
            return True
        current = self.current
        if current is not None and current.loop is not None:
            self.follow_loop()  # the program ended after leaving a loop whose generator a variable holds
        self._settle_now()
        self.active = self._hot = False
        if self.stall_watch is not None:
            self.stall_watch.close()
        if self.capture is not None and self.current is None:
            # A trace still running covers the steps up to here. Its write (on the capture's writer thread)
            # may use half the shutdown's time; the records get the rest.
            waited = time.perf_counter()
            self.capture.close(self.last_step, timeout_s / 2)
            timeout_s = max(0.0, timeout_s - (time.perf_counter() - waited))
        self.backends.framework_teardown(self)
        if self.current is not None:
            self.misuse(f"shutdown() while step({self.current.step}) is open; it is recorded as an error")
            step = self.current
            loops.release(step.loop)
            step.loop = None
            step.__exit__(RuntimeError, RuntimeError("steptrace.shutdown() inside the step"), None)
            if self.capture is not None:
                waited = time.perf_counter()
                self.capture.close(self.last_step, timeout_s / 2)
                timeout_s = max(0.0, timeout_s - (time.perf_counter() - waited))
        for ckpt in list(self.pending_async):
            ckpt.status = "incomplete"
            ckpt._submit()
        complete = self.resolver.shutdown(self.take_closed_spans(), timeout_s)
        if self.health is not None:
            self.health.close()  # after the last step took its window
        if self.pauses is not None:
            self.pauses.close()  # after the last step took its pauses
        return complete


#: The Python Runtime.step and Runtime.span (the compiled ones hand everything but the plain case to them).
PYTHON_STEP = Runtime.step
PYTHON_SPAN = Runtime.span
PYTHON_MICROBATCH = Runtime.microbatch


def compiled_hot_path(enabled: bool = True) -> bool:
    """Run the per-step calls (``step()``, a step's ``__enter__``, ``wait_for``, ``__exit__``) compiled
    (``enabled``) or in Python; returns whether they now run compiled (False where the extension was not
    built, or with STEPTRACE_PURE_PYTHON=1). Either way the fields stay in the compiled base where there is
    one. For tests and benchmarks: ``import steptrace`` runs them compiled when it can."""
    if _handles._hotpath is None:
        return False
    for cls, methods in ((Runtime, {"step": PYTHON_STEP, "span": PYTHON_SPAN, "microbatch": PYTHON_MICROBATCH}),
                         (StepHandle, _handles.PYTHON_STEP_METHODS), (SpanHandle, _handles.PYTHON_SPAN_METHODS),
                         (MicrobatchHandle, _handles.PYTHON_MICROBATCH_METHODS)):
        for name, method in methods.items():
            if enabled:
                if name in cls.__dict__:
                    delattr(cls, name)  # the compiled base's shows through
            else:
                setattr(cls, name, method)
    return enabled


if _handles._hotpath is not None:
    del Runtime.step, Runtime.span, Runtime.microbatch  # the compiled base's show through
    _python, _span = _handles.PYTHON_STEP_METHODS, _handles.PYTHON_SPAN_METHODS
    _microbatch = _handles.PYTHON_MICROBATCH_METHODS
    _handles._hotpath.install(HOST, TORCH_TENSORS, StepHandle, PYTHON_STEP, _python["__enter__"], _python["wait_for"],
                              _python["__exit__"], _python["log"], SpanHandle, PYTHON_SPAN, _span["__enter__"],
                              _span["__exit__"], MicrobatchHandle, PYTHON_MICROBATCH, _microbatch["wait_for"],
                              _microbatch["__exit__"], vars(_handles))
