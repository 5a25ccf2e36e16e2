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
    *,
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
    hidden = sum(max(0.0, min(hi, end) - max(lo, start)) for lo, hi in exposed)
    compute = max(0.0, end - start - hidden)
    return Timing(start, end, interval, compute, interval - compute)


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


class GoodputWindow:
    """Goodput over the last ``steps`` steps: Σ compute / Σ interval, in [0, 1].

    The one implementation every exporter uses (each rank's Prometheus and OTLP metrics, and
    the collector across ranks, which adds each joined step's sums over ranks). O(1) per step:
    running sums, re-added exactly once per window so float error cannot accumulate.
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
# loading data alike) is its time on its own. The rank with the most
# time on its own is the straggler, and the other ranks' median wait is what it cost the job (less
# the straggler's own wait: the collectives' own duration, which every rank pays).

#: A rank stands out when its time on its own exceeds the median of the other ranks' by at least
#: this many seconds ...
STRAGGLER_MIN_SECONDS = 0.005
#: ... and by at least this fraction of the step's median length (whichever is larger): its interval
#: where the ranks measure their wait, else its compute (what the time on its own falls back to). Below a
#: fifth of a step, one step's excess is indistinguishable from scheduling noise (measured: 4 gloo
#: ranks on 2 loaded cores, no rank slowed, reach 16 %); a rank that is persistently a little slower
#: shows in the windowed scores (StragglerScores) instead.
STRAGGLER_MIN_RATIO = 0.20


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


class Straggler(NamedTuple):
    """The rank that slowed a step: ``rank``; ``excess_seconds``: its time on its own minus the
    median of the other ranks'; ``cost_seconds``: what it cost the job, the other ranks' median wait
    in collectives minus its own wait (the collectives' own duration, which every rank pays; None
    when a rank did not measure its wait); ``threshold_seconds``: the excess it had to reach."""

    rank: int
    excess_seconds: float
    cost_seconds: float | None
    threshold_seconds: float


def straggler_threshold(step_seconds: float, min_seconds: float = STRAGGLER_MIN_SECONDS,
                        min_ratio: float = STRAGGLER_MIN_RATIO) -> float:
    """The excess of time on its own a rank needs to be named the straggler of a step whose median
    length is ``step_seconds`` (see :func:`straggler_step_seconds`)."""
    return max(min_seconds, min_ratio * max(0.0, step_seconds))


def straggler_step_seconds(interval_median: float | None, compute_median: float | None, measured: bool) -> float:
    """The step length the threshold is a fraction of: the median interval where every rank measured
    its wait (time on its own is then a part of the interval), else the median compute (the time on its
    own falls back to compute; a job idle between steps would otherwise hide a slow device)."""
    value = interval_median if measured else compute_median
    return value or 0.0


def find_straggler(ranks: dict[int, tuple[float, float | None]], step_seconds: float, *,
                   min_seconds: float = STRAGGLER_MIN_SECONDS,
                   min_ratio: float = STRAGGLER_MIN_RATIO) -> Straggler | None:
    """The straggler of one step, or None when no rank stands out.

    ``ranks``: rank -> (own seconds, collective wait seconds or None); ``step_seconds``: see
    :func:`straggler_step_seconds`. The candidate is the rank with the most time on its own (the
    lowest rank on a tie); it is named only when its excess over the median of the other ranks' time
    on its own reaches :func:`straggler_threshold`. One rank alone is never a straggler.
    """
    if len(ranks) < 2:
        return None
    rank = max(ranks, key=lambda r: (ranks[r][0], -r))
    others = [ranks[r] for r in ranks if r != rank]
    excess = ranks[rank][0] - _median([own for own, _ in others])
    threshold = straggler_threshold(step_seconds, min_seconds, min_ratio)
    if excess < threshold:
        return None
    waits = [wait for _, wait in others]
    own_wait = ranks[rank][1]
    cost = None
    if own_wait is not None and all(w is not None for w in waits):
        cost = max(0.0, _median([w for w in waits if w is not None]) - own_wait)
    return Straggler(rank, excess, cost, threshold)


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
