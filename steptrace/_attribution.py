"""The timing model of DESIGN.md section 2: the whole of it, as pure functions.

Nothing here reads a clock or touches a thread: the training thread and the
resolver feed observed times in and get finished numbers out, which keeps the
contract unit-testable. Every rule that decides a number in a record is here.

For step ``n`` (all times on one host clock, seconds)::

    dispatch(n) = host_start(n), moved to the end of each host span that closes
                  inside the step before wait_for()          (dispatch_after_span)
    end(n)      = the device's end (CUDA event placed on the host clock, or JAX
                  outputs seen ready), else host_end(n)      (unit_end)
    prev_end    = end(n-1); for the first step host_start(0) (previous_end)
    start(n)    = max(end(n-1), dispatch(n)), or the device's own start when a
                  start marker says when the stream reached it
    interval(n) = end(n) - end(n-1)
    compute(n)  = end(n) - start(n)
    idle(n)     = interval(n) - compute(n) = the window [end(n-1), start(n)]

The idle window is split by the host spans covering it (innermost wins) and
``other`` for what no span covers (idle_segments); spans that ended before a
step's end can never cover a later window (spans_after).

Microbatches chain the same way inside their step, from the previous step's
end, and none ends after its step does (microbatch_timings). Pipeline bubble
per stage = 1 - sum(microbatch compute) / step compute (bubble_ratios).
A checkpoint's blocking time is its host span after the saved step's end
(blocking_seconds).
"""

from __future__ import annotations

import collections
import math
from typing import Iterable, NamedTuple, Protocol

OTHER = "other"


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
) -> Timing:
    """Place one unit of device work (a step or a microbatch) on the timeline.

    ``prev_end`` is when the device finished the previous unit (for the first
    step: its host start). ``device_start`` is when the device itself reached
    the unit's start marker (a CUDA event recorded at ``dispatch``, placed on
    the host clock); when given it replaces ``dispatch``: the stream reaches
    the marker once both the host has recorded it and earlier work is done.
    """
    # A host-timed unit after a device-timed one could otherwise appear to end
    # before its predecessor.
    end = max(end, prev_end)
    start = max(prev_end, dispatch if device_start is None else device_start)
    start = min(start, end)
    interval = end - prev_end
    compute = end - start
    return Timing(start, end, interval, compute, interval - compute)


def dispatch_after_span(dispatch: float, waited: bool, span_end: float) -> float | None:
    """The step's new dispatch point when a host span closes inside it at ``span_end``, or None.

    Host spans inside a step come before its device work (DESIGN §2), so the end of the last one
    that closed before ``wait_for`` is where the device work was handed over.
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


def idle_segments(window_start: float, window_end: float, spans: Iterable[Interval]) -> list[HostSpan]:
    """Split ``[window_start, window_end]`` by the spans covering it.

    At every instant the innermost covering span wins (the one that started
    last; for equal starts the shorter one). Uncovered time is ``other``.
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
        name = OTHER if best is None else best.name
        if pieces and pieces[-1].name == name and pieces[-1].end == lo:
            pieces[-1] = HostSpan(name, pieces[-1].start, hi)
        else:
            pieces.append(HostSpan(name, lo, hi))
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


def bubble_ratios(step_compute: float, microbatches: Iterable[tuple[object, float]]) -> dict[str, float]:
    """``1 - Σ microbatch compute / step compute`` per pipeline stage."""
    per_stage: dict[str, float] = {}
    for stage, compute in microbatches:
        key = "0" if stage is None else str(stage)
        per_stage[key] = per_stage.get(key, 0.0) + compute
    if step_compute <= 0:
        return {stage: 0.0 for stage in per_stage}
    return {stage: max(0.0, 1.0 - busy / step_compute) for stage, busy in per_stage.items()}


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
