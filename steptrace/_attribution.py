"""The timing model of DESIGN.md section 2: the whole of it, as pure functions.

Nothing here reads a clock or touches a thread: the training thread and the
resolver feed observed times in and get finished numbers out, which keeps the
contract unit-testable. Every rule that decides a number in a record is here.

For step ``n`` (all times on one host clock, seconds)::

    dispatch(n) = host_start(n); for a value device (JAX), which shows its work only
                  at wait_for(), the end of each host span that closes inside the
                  step before wait_for()                     (dispatch_after_span)
    end(n)      = the device's end (CUDA event placed on the host clock, or JAX
                  outputs seen ready), else host_end(n)      (unit_end)
    prev_end    = end(n-1); for the first step host_start(0) (previous_end)
    start(n)    = max(end(n-1), dispatch(n)), or the device's own start when a
                  start marker says when the stream reached it
    exposed(n)  = the parts of host spans inside the step during which the device
                  had none of the step's work left to do       (exposed_gaps)
    interval(n) = end(n) - end(n-1)
    compute(n)  = end(n) - start(n) - exposed(n)
    idle(n)     = interval(n) - compute(n) = [end(n-1), start(n)] + exposed(n)

**One rule for host spans, every backend**: a host span is idle time only for
the part during which the device had none of the step's work left to do
(``drained``: when the device finished everything handed to it before the span
began). Host work while the device is busy with the step's earlier work (the
next batch fetched right after the forward pass was dispatched) is hidden, not
idle. A synchronous backend (PyTorch on CPU) *is* its device: it is drained the
moment a span begins, so every span inside a step is idle and compute is the
step's time outside its spans. On CUDA a marker recorded on the step's stream
as the span begins is reached exactly when the device drained. A value device
(JAX) is handed the step's work at ``wait_for``: spans before it precede the
work (``dispatch``), spans after it are hidden behind it.

The idle windows are split by the host spans covering them (innermost wins)
and ``other`` for what no span covers (idle_segments); spans that ended before
a step's end can never cover a later window (spans_after). Time before the
first step is split the same way, with ``startup`` for what no span covers
(STARTUP).

Microbatches chain the same way inside their step, from the previous step's
end, and none ends after its step does (microbatch_timings). They are device
work, never host spans. Pipeline bubble per stage = 1 - sum(microbatch
compute) / the stage's pipeline window [start(n), end of its last microbatch]
(bubble_ratios); the step's time after its last microbatch (gradient
finalization, optimizer) is optimizer_seconds. A checkpoint's blocking time is
its host span after the saved step's end (blocking_seconds).
"""

from __future__ import annotations

import array
import collections
import math
from typing import Iterable, NamedTuple, Protocol

OTHER = "other"
#: What no span covers before the first step: process and framework start-up.
STARTUP = "startup"
#: The training thread's garbage collections (steptrace/_pauses.py): a host interval like a span's.
GC = "gc"


class HostSpan(NamedTuple):
    """A host-side interval the idle time can be charged to."""

    name: str
    start: float
    end: float


class Interval(Protocol):
    """Anything with a name and a host interval: a :class:`HostSpan`, or the runtime's closed spans."""

    @property
    def name(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


class Timing(NamedTuple):
    start: float
    end: float
    interval_seconds: float
    compute_seconds: float
    idle_seconds: float


def unit_timing(
    prev_end: float,
    dispatch: float,
    end: float,
    device_start: float | None = None,
    exposed: Iterable[tuple[float, float]] = (),
) -> Timing:
    """Place one unit of device work (a step or a microbatch) on the timeline.

    ``prev_end`` is when the device finished the previous unit (for the first
    step: its host start). ``device_start`` is when the device itself reached
    the unit's start marker (a CUDA event recorded at ``dispatch``, placed on
    the host clock); when given it replaces ``dispatch``: the stream reaches
    the marker once both the host has recorded it and earlier work is done.
    ``exposed``: disjoint windows inside the unit during which the device had
    none of its work to do (:func:`exposed_gaps`); they are idle, not compute.
    """
    # A host-timed unit after a device-timed one could otherwise appear to end
    # before its predecessor.
    end = max(end, prev_end)
    start = max(prev_end, dispatch if device_start is None else device_start)
    start = min(start, end)
    interval = end - prev_end
    # (Most steps have no exposed window: no generator for them; x - 0.0 == x - 0, the same float.)
    hidden = sum(max(0.0, min(hi, end) - max(lo, start)) for lo, hi in exposed) if exposed else 0.0
    compute = max(0.0, end - start - hidden)
    return Timing(start, end, interval, compute, interval - compute)


_new_tuple = tuple.__new__


def plain_unit(prev_end: float, dispatch: float, end: float) -> tuple[Timing, tuple[HostSpan, ...], dict[str, float]]:
    """``unit_timing(prev_end, dispatch, end)`` of a step with no device start, no exposed window and no
    span that can cover its idle time, with its idle segments and breakdown: ``(timing, segments,
    breakdown)``, the same floats as :func:`unit_timing`, :func:`idle_windows`, :func:`window_segments`
    and :func:`breakdown` give it (tests/test_attribution.py checks them against each other). The
    resolver's fast path for most steps (a host or JAX step with no span, microbatch or stream marker):
    the one idle window is the wait before the start, which no span covers (``other``). Built without
    the named tuples' Python constructors (a step's record cost ~0.5 µs in them)."""
    # unit_timing's max() and min() as comparisons (what they return, NaN included; a builtin call each
    # cost more than the rest of this function).
    if prev_end > end:
        end = prev_end
    start = dispatch if dispatch > prev_end else prev_end
    if end < start:
        start = end
    interval = end - prev_end
    compute = end - start
    if not compute > 0.0:
        compute = 0.0
    timing = _new_tuple(Timing, (start, end, interval, compute, interval - compute))
    if start > prev_end:
        return timing, (_new_tuple(HostSpan, (OTHER, prev_end, start)),), {OTHER: start - prev_end}
    return timing, (), {}


def exposed_gaps(spans: Iterable[tuple[float, float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The windows of ``[start, end]`` during which the device waited on a host span, merged.

    ``spans`` are ``(span_start, span_end, drained)``: ``drained`` is when the device had
    finished all the work handed to it before the span began (the span's start itself for a
    synchronous backend; the device time of a marker recorded at the span's start on CUDA;
    infinity when the step's work was all handed over before it, as for JAX after wait_for).
    The device is idle from ``max(span_start, drained)`` to ``span_end``: nothing new reaches
    it while the host is inside the span. Work queued inside a span (a host-to-device copy in
    ``data``) therefore counts as that span's time. On CUDA the resolver passes the device time
    of the marker recorded at the span's end as ``span_end`` (and no ``span_start``), so the
    idle part is a difference of two device timestamps on one map.
    """
    windows = []
    for span_start, span_end, drained in spans:
        lo = max(span_start, drained, start)
        hi = min(span_end, end)
        if hi > lo:
            windows.append((lo, hi))
    windows.sort()
    merged: list[tuple[float, float]] = []
    for lo, hi in windows:
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def idle_windows(prev_end: float, timing: Timing, exposed: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Every window of a unit's interval in which the device was idle: before its start, then the
    exposed gaps inside it. Their lengths add up to ``timing.idle_seconds``."""
    windows = [(prev_end, timing.start)] if timing.start > prev_end else []
    windows += [(max(lo, timing.start), min(hi, timing.end)) for lo, hi in exposed
                if min(hi, timing.end) > max(lo, timing.start)]
    return windows


def dispatch_after_span(dispatch: float, waited: bool, span_end: float) -> float | None:
    """A value-device step's new dispatch point when a host span closes inside it at ``span_end``,
    or None.

    A value device (JAX) shows that it was handed the step's work only at ``wait_for``, so a span
    that closes before it is taken to precede that work. Host and stream devices ignore this:
    they know when the device drained (:func:`exposed_gaps`).
    """
    if not waited and span_end > dispatch:
        return span_end
    return None


def previous_end(prev_end: float | None, host_start: float) -> float:
    """When the device finished the unit before this step: the first step starts at its host start."""
    return host_start if prev_end is None else prev_end


def unit_end(host_end: float, device_end: float | None) -> float:
    """A unit ends when the device says it did; a synchronous (host-timed) unit at its host exit."""
    return host_end if device_end is None else device_end


def microbatch_timings(prev_end: float, step_end: float,
                       units: Iterable[tuple[float, float | None, float]]) -> list[Timing]:
    """Place a step's microbatches, each ``(dispatch, device_start, end)``, one after the other from
    ``prev_end`` (the previous step's end). A microbatch is part of its step: it cannot end after
    the step did."""
    timings = []
    for dispatch, device_start, end in units:
        t = unit_timing(prev_end=prev_end, dispatch=dispatch, end=min(end, step_end), device_start=device_start)
        prev_end = t.end
        timings.append(t)
    return timings


def spans_after(spans: Iterable[Interval], t: float) -> list:
    """The spans that can still cover an idle window after ``t`` (those ending later)."""
    return [s for s in spans if s.end > t]


def idle_segments(window_start: float, window_end: float, spans: Iterable[Interval],
                  uncovered: str = OTHER) -> list[HostSpan]:
    """Split ``[window_start, window_end]`` by the spans covering it.

    At every instant the innermost covering span wins (the one that started
    last; for equal starts the shorter one). Uncovered time is ``uncovered``.
    Adjacent pieces with the same name are merged. The pieces tile the window.
    """
    if window_end <= window_start:
        return []
    inside = [s for s in spans if s.end > window_start and s.start < window_end and s.end > s.start]
    cuts = {window_start, window_end}
    for s in inside:
        if window_start < s.start < window_end:
            cuts.add(s.start)
        if window_start < s.end < window_end:
            cuts.add(s.end)
    edges = sorted(cuts)
    pieces: list[HostSpan] = []
    for lo, hi in zip(edges, edges[1:]):
        mid = (lo + hi) / 2
        best: Interval | None = None
        for s in inside:
            if s.start <= mid < s.end and (
                best is None or s.start > best.start or (s.start == best.start and s.end < best.end)
            ):
                best = s
        name = uncovered if best is None else best.name
        if pieces and pieces[-1].name == name and pieces[-1].end == lo:
            pieces[-1] = HostSpan(name, pieces[-1].start, hi)
        else:
            pieces.append(HostSpan(name, lo, hi))
    return pieces


def window_segments(windows: Iterable[tuple[float, float]], spans: Iterable[Interval],
                    uncovered: str = OTHER) -> list[HostSpan]:
    """:func:`idle_segments` over several disjoint windows, in order; ``uncovered`` names the
    time no span covers (``other`` in a step, ``startup`` before the first one)."""
    spans = list(spans)
    if not spans:  # what idle_segments makes of each window when nothing can cover it
        return [HostSpan(uncovered, lo, hi) for lo, hi in windows if hi > lo]
    pieces: list[HostSpan] = []
    for lo, hi in windows:
        pieces += idle_segments(lo, hi, spans, uncovered)
    return pieces


def breakdown(segments: Iterable[HostSpan]) -> dict[str, float]:
    """Seconds per reason; sums to the window length."""
    totals: dict[str, float] = {}
    for seg in segments:
        totals[seg.name] = totals.get(seg.name, 0.0) + (seg.end - seg.start)
    return totals


def blocking_seconds(host_start: float, host_end: float, saved_step_end: float | None) -> float:
    """The part of a checkpoint's host span after the saved step's device work finished.

    Time before ``saved_step_end`` is the step still computing and stays in the step.
    """
    if saved_step_end is None:
        return max(0.0, host_end - host_start)
    return max(0.0, host_end - max(host_start, saved_step_end))


def bubble_ratios(step_start: float, microbatches: Iterable[tuple[object, float, float]]) -> dict[str, float]:
    """Per pipeline stage, ``1 - Σ microbatch compute / pipeline window``; ``microbatches`` are
    ``(stage, end, compute)``.

    A stage's pipeline window is ``[start(n), end of its last microbatch]``: the schedule, with its
    fill, p2p waits and drain as seen by that stage. What the step does after its last microbatch
    (gradient finalization, the optimizer update) is not pipeline time and is not bubble; it is
    :func:`optimizer_seconds`.
    """
    busy: dict[str, float] = {}
    last_end: dict[str, float] = {}
    for stage, end, compute in microbatches:
        key = "0" if stage is None else str(stage)
        busy[key] = busy.get(key, 0.0) + compute
        if end > last_end.get(key, step_start):
            last_end[key] = end
    ratios = {}
    for key, compute in busy.items():
        window = last_end.get(key, step_start) - step_start
        ratios[key] = max(0.0, 1.0 - compute / window) if window > 0 else 0.0
    return ratios


def optimizer_seconds(step_start: float, step_end: float, microbatches: Iterable[tuple[object, float, float]]) -> float:
    """The step's device time after its last microbatch ended (``(stage, end, compute)`` as for
    :func:`bubble_ratios`): gradient finalization and the optimizer update of a pipelined step."""
    last = max((end for _, end, _ in microbatches), default=step_end)
    return max(0.0, step_end - max(last, step_start))


# -- waiting shown as waiting (DESIGN.md §2, "Across ranks") ----------------------------------
#
# Where a rank measures its wait in collectives (exposed communication, in HolisticTraceAnalysis's
# sense: communication the rank could not overlap with compute of its own), its step splits into
#
#     own compute + collective wait + host idle by reason = interval
#
# The timing model's compute and idle stay as they are (device busy, device waiting on the host);
# the wait is taken out of whichever of them it fell in: on CPU (gloo) the host is the device, so
# a collective inside the step outside any span is compute time, one inside a span or between steps
# is that window's idle time.


def merged_windows(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``windows`` sorted and merged where they overlap or touch."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted((lo, hi) for lo, hi in windows if hi > lo):
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def collective_wait_placement(wait_seconds: float, compute_seconds: float,
                              windows: Iterable[tuple[float, float]],
                              segments: Iterable[Interval]) -> tuple[float, dict[str, float]]:
    """Where a step's wait in collectives fell: ``(in_compute, in_idle)``, ``in_idle`` by the reason of
    the idle segment it overlapped (``segments``: the step's idle segments, tiling its idle windows).

    ``wait_seconds`` is the measured total (at most the interval), ``windows`` when it waited (same
    clock as the segments). What no idle segment holds was inside the step's compute, up to all of
    it. ``in_compute + sum(in_idle)`` is the wait placed; it equals ``wait_seconds`` unless the
    windows disagree with it (merged past the adapter's bound, or outside the step's interval).
    """
    wait_seconds = max(0.0, wait_seconds)
    merged = merged_windows(windows)
    in_idle: dict[str, float] = {}
    if merged:
        for segment in segments:
            overlap = 0.0
            for lo, hi in merged:
                if hi <= segment.start:
                    continue
                if lo >= segment.end:
                    break
                overlap += min(hi, segment.end) - max(lo, segment.start)
            if overlap > 0:
                in_idle[segment.name] = in_idle.get(segment.name, 0.0) + overlap
    placed = math.fsum(in_idle.values())
    if placed > wait_seconds:
        scale = wait_seconds / placed
        in_idle = {reason: seconds * scale for reason, seconds in in_idle.items()}
        placed = wait_seconds
    in_compute = min(max(0.0, compute_seconds), max(0.0, wait_seconds - placed))
    rest = wait_seconds - placed - in_compute
    if rest > 0:
        # More wait than its windows and the compute hold (windows merged past the adapter's bound):
        # the rest in the idle time its windows left free, `other` first.
        free: dict[str, float] = {}
        for segment in segments:
            free[segment.name] = free.get(segment.name, 0.0) + (segment.end - segment.start)
        for reason in sorted(free, key=lambda r: r != OTHER):
            taken = min(rest, free[reason] - in_idle.get(reason, 0.0))
            if taken > 0:
                in_idle[reason] = in_idle.get(reason, 0.0) + taken
                rest -= taken
    return in_compute, in_idle


class StepSplit(NamedTuple):
    """One step as ``own_compute_seconds + collective_wait_seconds + sum(idle_breakdown) = interval``:
    ``idle_breakdown`` is the host idle by reason less the wait in collectives that fell in it."""

    own_compute_seconds: float
    collective_wait_seconds: float
    idle_breakdown: dict[str, float]


def split_step(compute_seconds: float, idle_breakdown: dict[str, float], collective_wait_seconds: float | None = None,
               own_compute_seconds: float | None = None,
               collective_wait_idle_breakdown: dict[str, float] | None = None) -> StepSplit:
    """A step record's own compute, wait in collectives and host idle by reason (see :class:`StepSplit`).

    A step that did not measure its wait (``collective_wait_seconds`` None) is all its own. A record
    written before ``own_compute_seconds`` existed had its wait inside its compute as far as that
    holds it, the rest in its idle time (``other`` first).
    """
    if not collective_wait_seconds or collective_wait_seconds <= 0:
        return StepSplit(compute_seconds, 0.0, dict(idle_breakdown))
    idle = dict(idle_breakdown)
    if own_compute_seconds is None:
        in_idle = {r: s for r, s in (collective_wait_idle_breakdown or {}).items() if s > 0}
        in_compute = min(compute_seconds, max(0.0, collective_wait_seconds - math.fsum(in_idle.values())))
        own_compute_seconds = compute_seconds - in_compute
        if collective_wait_idle_breakdown is None:
            rest = collective_wait_seconds - in_compute
            for reason in sorted(idle, key=lambda r: (r != OTHER, -idle[r])):
                if rest <= 0:
                    break
                taken = min(rest, idle[reason])
                in_idle[reason] = taken
                rest -= taken
    else:
        in_idle = {r: s for r, s in (collective_wait_idle_breakdown or {}).items() if s > 0}
    for reason, seconds in in_idle.items():
        if reason in idle:
            idle[reason] = max(0.0, idle[reason] - seconds)
    return StepSplit(own_compute_seconds, collective_wait_seconds, idle)


class GoodputTotals:
    """This process's goodput as its records arrive, for the exporters (Prometheus, OTLP): productive
    seconds (own compute of its steps) over its wall (its process start to its latest record's end).

    The same definition as ``steptrace report``'s goodput (docs/goodput.md) for one attempt: a
    process cannot know which of its steps a later attempt will throw away, nor the downtime before
    it. O(1) per record; ``wall_seconds`` only grows.
    """

    __slots__ = ("process_start", "last_end", "productive_seconds", "wall_seconds")

    def __init__(self) -> None:
        self.process_start: float | None = None
        self.last_end: float | None = None
        self.productive_seconds = 0.0
        self.wall_seconds = 0.0

    def started(self, process_start: float) -> None:
        """The process start (unix seconds, the ``attempt`` record's ``start_time``)."""
        if self.process_start is None and math.isfinite(process_start):
            self.process_start = process_start
            if self.last_end is not None:
                self.wall_seconds = max(0.0, self.last_end - process_start)

    def step(self, own_compute_seconds: float, first_entry: float | None = None) -> None:
        """A step's own compute; ``first_entry`` (its host start less the time before it) stands in
        for the process start when no ``attempt`` record came first."""
        self.productive_seconds += max(0.0, own_compute_seconds)
        if self.process_start is None and first_entry is not None:
            self.started(first_entry)

    def ended(self, end_time: float) -> float:
        """A record ended at ``end_time``: returns how much the wall grew."""
        if not math.isfinite(end_time) or (self.last_end is not None and end_time <= self.last_end):
            return 0.0
        self.last_end = end_time
        if self.process_start is None:
            return 0.0
        wall = max(self.wall_seconds, end_time - self.process_start)
        grown, self.wall_seconds = wall - self.wall_seconds, wall
        return grown

    def ratio(self) -> float | None:
        """The goodput now, or None before the wall is known."""
        if self.wall_seconds <= 0:
            return None
        return min(1.0, max(0.0, self.productive_seconds / self.wall_seconds))


class ComputeShareWindow:
    """The compute share of the last ``steps`` steps: Σ compute / Σ interval, in [0, 1].

    Not goodput (that is productive time over the wall from the process start, docs/goodput.md):
    the collector's share of the steps it joined, which adds each joined step's sums over ranks
    (the ranks' own compute where they measure their wait in collectives). O(1) per step: running
    sums, re-added exactly once per window so float error cannot accumulate.
    """

    __slots__ = ("_window", "_compute", "_interval", "_added")

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"goodput_window_steps must be an integer >= 1, got {steps!r}")
        self._window: collections.deque[tuple[float, float]] = collections.deque(maxlen=steps)
        self._compute = 0.0
        self._interval = 0.0
        self._added = 0

    @property
    def steps(self) -> int:
        return self._window.maxlen or 0

    def add(self, compute: float, interval: float) -> None:
        window = self._window
        if len(window) == window.maxlen:
            old_compute, old_interval = window[0]
            self._compute -= old_compute
            self._interval -= old_interval
        window.append((compute, interval))
        self._compute += compute
        self._interval += interval
        self._added += 1
        if self._added % self.steps == 0:
            self._compute = math.fsum(c for c, _ in window)
            self._interval = math.fsum(i for _, i in window)

    def ratio(self) -> float | None:
        """The goodput now, or None before any step with a positive interval."""
        if self._interval <= 0:
            return None
        return min(1.0, max(0.0, self._compute / self._interval))


# -- across ranks: who waited for whom (DESIGN.md §2) ------------------------------------------
#
# In synchronous training a collective makes every rank's step as long as the slowest, so per-rank
# compute cannot name the culprit. Each rank measures the time it spent waiting in collectives
# (arrival -> completion); the rest of its step (its interval: device compute and host work such as
# loading data alike) is its time on its own. The rank with the most time on its own is the step's
# candidate; what it cost the job is the other ranks' median wait (less the candidate's own wait: the
# collectives' own duration, which every rank pays).
#
# A step is a fact, a verdict is a claim (DESIGN.md §2): a candidate is named the straggler of a step
# only when it stands out by more than the run's own noise (StragglerRule), and a rank is the run's
# straggler only when it was named persistently (straggler_evidence). On a loaded machine every rank is
# now and then preempted for as long as a real straggler costs (issue 33: a healthy 2-rank job had a
# straggler named in 28 of 50 steps under a fixed fifth-of-a-step threshold, and one "cost the job
# 25 ms per step").

#: A rank stands out when its time on its own exceeds the median of the other ranks' by at least this
#: many seconds ...
STRAGGLER_MIN_SECONDS = 0.005
#: ... and this fraction of the step's median length: its interval where the ranks measure their wait,
#: else its compute (what the time on its own falls back to) ...
STRAGGLER_MIN_RATIO = 0.05
#: ... and the run's noise floor: the median plus this many robust standard deviations (1.4826 x the
#: median absolute deviation) of how far the slowest of the *other* ranks stood out in the window's
#: steps (:func:`noise_floor`). Three, Hampel's outlier rule. Measured on 4 gloo ranks on 2 cores at
#: load 6-15 (docs/collector.md): 2 named a healthy rank in up to 27 % of the steps (it was slower
#: in stretches, on a busier core), 3 in up to 18 %; a rank slowed by 25 ms of compute stays named
#: in >= 95 % of them either way.
STRAGGLER_NOISE_K = 3.0
#: Complete steps of the window the noise floor is estimated over (the last ones before the step).
STRAGGLER_NOISE_WINDOW = 100
#: The noise floor needs this many samples; with fewer (a run's first steps) only the two fixed bounds apply.
STRAGGLER_NOISE_MIN_SAMPLES = 5
#: A rank is the run's straggler (chronic, not one-off) when it was named in at least this share of the
#: complete steps considered (the run's, or the collector's last window) ...
STRAGGLER_PERSISTENT_SHARE = 0.5
#: ... and in at least this many of them.
STRAGGLER_PERSISTENT_MIN_STEPS = 3
#: Robust standard deviation from the median absolute deviation (normal consistency constant).
MAD_TO_SIGMA = 1.4826


def own_seconds(interval_seconds: float, collective_wait_seconds: float | None) -> float:
    """A rank's time on its own in a step: its interval minus its wait in collectives (never below 0).

    The interval, not the compute: a rank whose data loading (idle time, a ``data`` span) is slow
    holds the others up as much as one whose device is, and its wait is short either way. In a
    synchronous job the ranks' intervals are equal, so the rank with most time on its own is the one
    that waited least."""
    if collective_wait_seconds is None:
        return interval_seconds
    return max(0.0, interval_seconds - collective_wait_seconds)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly (numpy's default, ``inclusive``)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Straggler(NamedTuple):
    """The rank that slowed a step: ``rank``; ``excess_seconds``: its time on its own minus the
    median of the other ranks'; ``cost_seconds``: what it cost the job, the other ranks' median wait
    in collectives minus its own wait (the collectives' own duration, which every rank pays; None
    when a rank did not measure its wait); ``threshold_seconds``: the excess it had to reach;
    ``noise_seconds``: the run's noise floor in that threshold (None while unknown)."""

    rank: int
    excess_seconds: float
    cost_seconds: float | None
    threshold_seconds: float
    noise_seconds: float | None = None


class Candidate(NamedTuple):
    """A step's straggler candidate: the rank with the most time on its own (the lowest on a tie), its
    ``excess_seconds`` over the median of the others', and ``runner_up_seconds``: the same excess one
    rank down (the second most time on its own over the median of the ranks below it; None with two
    ranks), how far the slowest of the *other* ranks stood out."""

    rank: int
    excess_seconds: float
    runner_up_seconds: float | None


def step_candidate(own: dict[int, float]) -> Candidate | None:
    """The candidate of a step from its ranks' time on their own, or None with fewer than two ranks."""
    if len(own) < 2:
        return None
    rank = max(own, key=lambda r: (own[r], -r))
    ordered = sorted(own.values())
    excess = ordered[-1] - _median(ordered[:-1])
    runner_up = ordered[-2] - _median(ordered[:-2]) if len(ordered) >= 3 else None
    return Candidate(rank, excess, runner_up)


def noise_floor(history: Iterable[Candidate], rank: int, *, k: float = STRAGGLER_NOISE_K,
                min_samples: int = STRAGGLER_NOISE_MIN_SAMPLES) -> float | None:
    """The excess ``rank`` must beat to stand out from the run's noise, from earlier steps' candidates.

    The noise is what the *other* ranks do without it: per step of ``history``, how far the slowest
    rank other than ``rank`` stood out (the candidate's excess when the candidate was another rank, the
    runner-up's when it was ``rank``; with two ranks, steps ``rank`` led give no sample). The floor is
    the median of those samples plus ``k`` robust standard deviations (1.4826 x their median absolute
    deviation): a rank that is slow every step does not raise its own bar, a one-off spike moves a
    median by one sample, and the spread of the slowest of many ranks is measured, not assumed.
    None with fewer than ``min_samples`` samples.
    """
    samples = [c.excess_seconds if c.rank != rank else c.runner_up_seconds for c in history]
    values = [s for s in samples if s is not None]
    if len(values) < max(1, min_samples):
        return None
    middle = _median(values)
    spread = _median([abs(v - middle) for v in values])
    return middle + k * MAD_TO_SIGMA * spread


def straggler_threshold(step_seconds: float, min_seconds: float = STRAGGLER_MIN_SECONDS,
                        min_ratio: float = STRAGGLER_MIN_RATIO, noise_seconds: float | None = None) -> float:
    """The excess of time on its own a rank needs to be named the straggler of a step whose median
    length is ``step_seconds`` (see :func:`straggler_step_seconds`): the largest of ``min_seconds``,
    ``min_ratio`` of the step and the run's noise floor (:func:`noise_floor`, when known)."""
    return max(min_seconds, min_ratio * max(0.0, step_seconds), noise_seconds or 0.0)


def straggler_step_seconds(interval_median: float | None, compute_median: float | None, measured: bool) -> float:
    """The step length the threshold is a fraction of: the median interval where every rank measured
    its wait (time on its own is then a part of the interval), else the median compute (the time on its
    own falls back to compute; a job idle between steps would otherwise hide a slow device)."""
    value = interval_median if measured else compute_median
    return value or 0.0


def find_straggler(ranks: dict[int, tuple[float, float | None]], step_seconds: float, *,
                   noise_seconds: float | None = None,
                   min_seconds: float = STRAGGLER_MIN_SECONDS,
                   min_ratio: float = STRAGGLER_MIN_RATIO) -> Straggler | None:
    """The straggler of one step, or None when no rank stands out.

    ``ranks``: rank -> (own seconds, collective wait seconds or None); ``step_seconds``: see
    :func:`straggler_step_seconds`; ``noise_seconds``: the run's noise floor for this step's
    candidate (:class:`StragglerRule` keeps it). The candidate (:func:`step_candidate`) is named only
    when its excess reaches :func:`straggler_threshold` and, where the ranks measured their wait,
    the others waited for it (a cost above 0). One rank alone is never a straggler.
    """
    candidate = step_candidate({rank: own for rank, (own, _) in ranks.items()})
    if candidate is None:
        return None
    threshold = straggler_threshold(step_seconds, min_seconds, min_ratio, noise_seconds)
    if candidate.excess_seconds < threshold:
        return None
    waits = [wait for rank, (_, wait) in ranks.items() if rank != candidate.rank]
    own_wait = ranks[candidate.rank][1]
    cost = None
    if own_wait is not None and all(w is not None for w in waits):
        cost = _median([w for w in waits if w is not None]) - own_wait
        if cost <= 0:
            # It stood out, yet the others did not wait for it: not what held this step up.
            return None
    return Straggler(candidate.rank, candidate.excess_seconds, cost, threshold, noise_seconds)


class StragglerVerdict(NamedTuple):
    """One complete step judged by :class:`StragglerRule`: ``straggler`` (None when no rank stood
    out), the ``threshold_seconds`` its candidate had to reach and the ``noise_seconds`` in it."""

    straggler: Straggler | None
    threshold_seconds: float
    noise_seconds: float | None


class StragglerRule:
    """The straggler of each complete step of one run, judged against the run's own noise.

    Feed the run's complete steps in order (:meth:`judge`); the noise floor of each comes from the
    candidates of the last ``window_steps`` steps before it (:func:`noise_floor`). Memory is the
    window, three numbers a step, whatever the ranks. One instance per run: the collector keeps one
    per run it joins, ``steptrace report`` one while it joins the rank files (in step order), and the
    ClickHouse view computes the same over the run's rows (``steptrace.analysis.clickhouse``).
    """

    __slots__ = ("_history", "k", "min_ratio", "min_samples", "min_seconds")

    def __init__(self, window_steps: int = STRAGGLER_NOISE_WINDOW, *, min_seconds: float = STRAGGLER_MIN_SECONDS,
                 min_ratio: float = STRAGGLER_MIN_RATIO, k: float = STRAGGLER_NOISE_K,
                 min_samples: int = STRAGGLER_NOISE_MIN_SAMPLES):
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"straggler noise window must be an integer >= 1, got {window_steps!r}")
        self._history: collections.deque[Candidate] = collections.deque(maxlen=window_steps)
        self.min_seconds = min_seconds
        self.min_ratio = min_ratio
        self.k = k
        self.min_samples = min_samples

    def judge(self, ranks: dict[int, tuple[float, float | None]], step_seconds: float) -> StragglerVerdict:
        """The verdict on one complete step (``ranks`` and ``step_seconds`` as for :func:`find_straggler`),
        which then joins the window."""
        candidate = step_candidate({rank: own for rank, (own, _) in ranks.items()})
        noise = None if candidate is None else noise_floor(self._history, candidate.rank, k=self.k,
                                                           min_samples=self.min_samples)
        found = find_straggler(ranks, step_seconds, noise_seconds=noise, min_seconds=self.min_seconds,
                               min_ratio=self.min_ratio)
        if candidate is not None:
            self._history.append(candidate)
        return StragglerVerdict(found, straggler_threshold(step_seconds, self.min_seconds, self.min_ratio, noise),
                                noise)


class StragglerEvidence(NamedTuple):
    """What a rank's straggler verdict rests on, over ``complete_steps`` complete steps: ``steps`` it was
    named in and their ``share_of_steps``; the median and quartiles of its cost (None when the ranks do
    not measure their wait), the median excess, and ``threshold_median_seconds``: the bar (fixed
    bounds and noise floor) it cleared, median over its steps. ``persistent``: the run's straggler."""

    rank: int
    steps: int
    complete_steps: int
    share_of_steps: float
    cost_median_seconds: float | None
    cost_q1_seconds: float | None
    cost_q3_seconds: float | None
    excess_median_seconds: float | None
    threshold_median_seconds: float | None
    persistent: bool

    @property
    def kind(self) -> str:
        """``chronic`` (the run's straggler), ``intermittent`` or ``one-off``."""
        return "chronic" if self.persistent else "one-off" if self.steps == 1 else "intermittent"


def straggler_evidence(named: Iterable[tuple[int, float | None, float | None, float | None]], complete_steps: int, *,
                       share: float = STRAGGLER_PERSISTENT_SHARE,
                       min_steps: int = STRAGGLER_PERSISTENT_MIN_STEPS) -> dict[int, StragglerEvidence]:
    """Per rank named, its evidence (:class:`StragglerEvidence`), the most often named first (the lower
    rank on a tie).

    ``named``: one ``(rank, cost, excess, threshold)`` per step a straggler was named in, out of
    ``complete_steps`` complete steps (every one judged). A rank is persistent, the run's straggler,
    when it was named in at least ``share`` of the complete steps and at least ``min_steps`` of them:
    at most one rank can be, and a job whose noise names each rank now and then has none.
    """
    by_rank: dict[int, list[tuple[float | None, float | None, float | None]]] = {}
    for rank, step_cost, step_excess, step_threshold in named:
        by_rank.setdefault(rank, []).append((step_cost, step_excess, step_threshold))
    out: dict[int, StragglerEvidence] = {}
    for rank, rows in sorted(by_rank.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        costs = sorted(c for c, _, _ in rows if c is not None)
        excess = [e for _, e, _ in rows if e is not None]
        thresholds = [t for _, _, t in rows if t is not None]
        ratio = len(rows) / complete_steps if complete_steps else 0.0
        out[rank] = StragglerEvidence(
            rank=rank, steps=len(rows), complete_steps=complete_steps, share_of_steps=ratio,
            cost_median_seconds=_median(costs) if costs else None,
            cost_q1_seconds=_quantile(costs, 0.25) if costs else None,
            cost_q3_seconds=_quantile(costs, 0.75) if costs else None,
            excess_median_seconds=_median(excess) if excess else None,
            threshold_median_seconds=_median(thresholds) if thresholds else None,
            persistent=ratio >= share and len(rows) >= min_steps)
    return out


class StragglerPersistence:
    """The collector's run verdict: :func:`straggler_evidence` over the last ``window_steps`` complete
    steps of a run, kept as they are joined (O(window) memory, whatever the ranks)."""

    __slots__ = ("_steps",)

    def __init__(self, window_steps: int):
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"straggler window must be an integer >= 1, got {window_steps!r}")
        self._steps: collections.deque[tuple[int, float | None, float | None, float | None] | None] = \
            collections.deque(maxlen=window_steps)

    def add(self, straggler: Straggler | None) -> None:
        """One complete step's straggler (None when no rank stood out)."""
        self._steps.append(None if straggler is None else
                           (straggler.rank, straggler.cost_seconds, straggler.excess_seconds,
                            straggler.threshold_seconds))

    def evidence(self) -> dict[int, StragglerEvidence]:
        return straggler_evidence((s for s in self._steps if s is not None), len(self._steps))

    def persistent(self) -> StragglerEvidence | None:
        """The run's straggler over the window, or None."""
        return next((e for e in self.evidence().values() if e.persistent), None)


class _Window:
    """One rank's last ``steps`` values: a ring of doubles, their sum and the best mean so far."""

    __slots__ = ("best", "count", "pos", "total", "values")

    def __init__(self) -> None:
        self.values = array.array("d")
        self.pos = 0
        self.count = 0
        self.total = 0.0
        self.best = math.inf

    def add(self, seconds: float, steps: int) -> None:
        if self.count < steps:
            self.values.append(seconds)
            self.count += 1
        else:
            self.total -= self.values[self.pos]
            self.values[self.pos] = seconds
            self.pos = (self.pos + 1) % steps
        self.total += seconds
        mean = self.total / self.count
        if mean < self.best:
            self.best = mean


class StragglerScores:
    """Per-rank straggler scores over the last ``steps`` joined steps (as NVIDIA resiliency-ext does).

    Each rank's time on its own is averaged over the window; then, per rank,

    * ``relative`` = the median rank's windowed mean / this rank's: 1 is typical, 0.5 means this rank
      needs twice the median rank's time on its own (above 1: faster than the median rank);
    * ``individual`` = this rank's best windowed mean so far / its current one: 1 is as fast as it has
      ever been, lower is slower than its own best (until the window fills, the means are over the
      steps seen).

    O(1) per rank and step; scores are computed on demand (at scrape or report time). Each rank's
    window is a ring of 8-byte floats (~0.8 KB per rank at 100 steps; a deque of float objects
    took ~3.5 KB, 57 MB per run at 16,384 ranks).
    """

    __slots__ = ("_steps", "_windows")

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"straggler score window must be an integer >= 1, got {steps!r}")
        self._steps = steps
        self._windows: dict[int, _Window] = {}

    def add(self, own: dict[int, float]) -> None:
        """One step's time on its own, rank -> seconds."""
        for rank, seconds in own.items():
            window = self._windows.get(rank)
            if window is None:
                window = self._windows[rank] = _Window()
            window.add(seconds, self._steps)

    def means(self) -> dict[int, float]:
        """Each rank's mean time on its own over its window."""
        return {rank: max(0.0, w.total) / w.count for rank, w in self._windows.items() if w.count}

    def _best(self, rank: int) -> float | None:
        window = self._windows.get(rank)
        return None if window is None or window.best == math.inf else window.best

    def scores(self) -> dict[int, tuple[float | None, float | None]]:
        """rank -> (relative, individual) scores; None where undefined (a mean of zero)."""
        means = self.means()
        if not means:
            return {}
        median = _median(list(means.values()))
        out: dict[int, tuple[float | None, float | None]] = {}
        for rank, mean in means.items():
            relative = median / mean if mean > 0 else None
            best = self._best(rank)
            individual = min(1.0, best / mean) if best is not None and mean > 0 else None
            out[rank] = (relative, individual)
        return out


#: The host causes a straggler's excess is broken down by (docs/pauses.md): ``gc`` and ``data`` as charged in
#: ``idle_breakdown``, ``preempted`` from ``host_pauses.preempted_seconds`` (the run-queue wait, evidence).
HOST_CAUSES = ("gc", "preempted", "data")
#: A cause is named when the straggler had that much more of it than the other ranks' median: a quarter of
#: its excess in the step (less than that explains little of why it stood out).
CAUSE_MIN_SHARE = 0.25


def straggler_causes(by_rank: dict[int, dict[str, float | None]], rank: int,
                     excess_seconds: float | None) -> dict[str, float]:
    """Why ``rank`` stood out in a step: ``by_rank`` holds each rank's seconds per host cause
    (:data:`HOST_CAUSES`, None where it did not measure one). Per cause, the rank's seconds less the other
    ranks' median, for the causes that explain at least :data:`CAUSE_MIN_SHARE` of its excess; empty when
    none does (the cause is elsewhere: its compute). One rule for the report and the collector."""
    if not excess_seconds or rank not in by_rank:
        return {}
    mine = by_rank[rank]
    out: dict[str, float] = {}
    for cause in HOST_CAUSES:
        value = mine.get(cause)
        if value is None:
            continue
        theirs = [v for r, c in by_rank.items() if r != rank and (v := c.get(cause)) is not None]
        extra = value - (_median(theirs) if theirs else 0.0)
        if extra >= CAUSE_MIN_SHARE * excess_seconds:
            out[cause] = extra
    return out
