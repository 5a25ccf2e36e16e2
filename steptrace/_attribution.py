"""The timing model of DESIGN.md section 2, as pure functions.

Nothing here reads a clock or touches a thread: the resolver feeds observed
times in and gets finished numbers out, which keeps the contract unit-testable.

For step ``n`` (all times on one host clock, seconds)::

    start(n)    = max(end(n-1), dispatch(n))
    interval(n) = end(n) - end(n-1)        # first step: end(0) - host_start(0)
    compute(n)  = end(n) - start(n)
    idle(n)     = interval(n) - compute(n) = the window [end(n-1), start(n)]

The idle window is split by the host spans covering it (innermost wins) and
``other`` for what no span covers.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

OTHER = "other"


class HostSpan(NamedTuple):
    """A host-side interval the idle time can be charged to."""

    name: str
    start: float
    end: float


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


def idle_segments(window_start: float, window_end: float, spans: Iterable[HostSpan]) -> list[HostSpan]:
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
        best: HostSpan | None = None
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
