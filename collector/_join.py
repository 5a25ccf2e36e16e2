"""The cross-rank join: one ``cluster_step`` record per step from every rank's ``train.step`` span.

All ranks' spans of step ``n`` of a run share a trace id (a hash of
``(run_id, n)``, DESIGN.md §4); the join groups by ``(run_id, step)``, which is
the same thing and needs no hashing. A step is emitted

* as soon as all ranks ``0 .. world_size-1`` reported (``reason: "all_ranks"``,
  ``complete: true``); ``world_size`` is the collector's ``--world-size`` or,
  without it, the first span's ``train.world_size``;
* ``window_s`` after its first span arrived, with whatever ranks did report
  (``reason: "window"``, ``complete: false``, ``missing_ranks``);
* early when more than ``max_open_steps`` steps are open (the oldest goes,
  ``reason: "evicted"``), which bounds memory whatever the senders do;
* at :meth:`Joiner.flush` (collector shutdown, ``reason: "shutdown"``).

A span for a step that was already emitted is *late*: it becomes a ``late``
record (appended to the run's ``cluster.jsonl``, so nothing is lost) and is
counted; the emitted record is not rewritten. A second span of the same rank
for the same step (an exporter retry) is a duplicate and is dropped. Which
ranks each emitted step had is remembered for the last ``max_emitted`` steps
(as a bitmask, with the step's latest end time); ``history`` seeds that
memory per run the first time a run is seen, so a restarted collector reads
its own ``cluster.jsonl`` and does not emit a step twice.

A run resumed from a checkpoint under the same ``run_id`` executes some steps
again. A span that ended more than ``rerun_gap_s`` (60 s) after the emitted
step's latest end is taken for such a re-run, not for a late span: the step is
joined afresh and written again (the report keeps the later record). Ranks of
one step end within a step time of each other, and a resume takes longer
than a minute; host clocks more than ``rerun_gap_s`` apart would defeat this.

The straggler is the rank with the largest ``compute_seconds`` (the lowest
such rank on a tie), named only for complete steps: when a rank is missing,
it may well be the slowest one, so an incomplete step names none
(``straggler_rank: null``) and its min/median/max/skew cover the ranks that
reported. Not thread-safe: the collector calls it under its lock.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from steptrace._ids import trace_id_hex
from steptrace.collector._decode import StepSpan

__all__ = ["JoinResult", "Joiner", "cluster_record"]

#: ``reason`` values of ``cluster_step`` records.
REASONS = ("all_ranks", "window", "evicted", "shutdown")


@dataclass
class _OpenStep:
    run_id: str
    step: int
    trace_id: str
    world_size: int | None
    first_seen: float  # monotonic
    first_seen_time: float  # unix
    ranks: dict[int, StepSpan] = field(default_factory=dict)
    in_range: int = 0  # ranks reported in [0, world_size)


@dataclass
class JoinResult:
    """What one call emitted: records to write (``cluster_step`` and ``late``), and duplicates by run."""

    records: list[dict[str, Any]] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)

    def extend(self, other: "JoinResult") -> None:
        self.records += other.records
        for run, n in other.duplicates.items():
            self.duplicates[run] = self.duplicates.get(run, 0) + n


class Joiner:
    """Groups step spans by ``(run_id, step)`` and emits joined records (see the module doc)."""

    def __init__(self, *, world_size: int | None = None, window_s: float = 10.0, max_open_steps: int = 4096,
                 max_emitted: int = 65536, rerun_gap_s: float = 60.0,
                 history: Callable[[str], Iterable[tuple[int, Iterable[int], float | None]]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.world_size = world_size
        self.rerun_gap_s = rerun_gap_s
        self.window_s = window_s
        self.max_open_steps = max_open_steps
        self.max_emitted = max_emitted
        self._history = history
        self._clock = clock
        self._wall = wall_clock
        # Insertion order is arrival order of each step's first span, so expiry stops at the first young one.
        self._open: collections.OrderedDict[tuple[str, int], _OpenStep] = collections.OrderedDict()
        # (run_id, step) -> [ranks bitmask, latest end time (unix) or None]
        self._emitted: collections.OrderedDict[tuple[str, int], list] = collections.OrderedDict()
        self._runs: set[str] = set()

    @property
    def open_steps(self) -> int:
        return len(self._open)

    def add(self, spans: Iterable[StepSpan]) -> JoinResult:
        """Add step spans; returns the steps they completed (or evicted) and the late spans."""
        result = JoinResult()
        now = self._clock()
        for span in spans:
            key = (span.run_id, span.step)
            if span.run_id not in self._runs:
                self._seed(span.run_id)
            bit = 1 << span.rank
            emitted = self._emitted.get(key)
            if emitted is not None:
                mask, end = emitted
                if end is not None and span.end_time is not None and span.end_time > end + self.rerun_gap_s:
                    del self._emitted[key]  # a re-run of the step (resumed run): join it afresh
                elif mask & bit:
                    result.duplicates[span.run_id] = result.duplicates.get(span.run_id, 0) + 1
                    continue
                else:
                    emitted[0] = mask | bit
                    result.records.append(self._late(span))
                    continue
            open_step = self._open.get(key)
            if open_step is None:
                if len(self._open) >= self.max_open_steps:
                    _, oldest = self._open.popitem(last=False)
                    result.records.append(self._emit(oldest, "evicted"))
                open_step = _OpenStep(
                    run_id=span.run_id, step=span.step,
                    trace_id=span.trace_id or trace_id_hex(span.run_id, span.step),
                    world_size=self.world_size if self.world_size is not None else span.world_size,
                    first_seen=now, first_seen_time=self._wall())
                self._open[key] = open_step
            if span.rank in open_step.ranks:
                result.duplicates[span.run_id] = result.duplicates.get(span.run_id, 0) + 1
                continue
            open_step.ranks[span.rank] = span
            world = open_step.world_size
            if world is not None and span.rank < world:
                open_step.in_range += 1
                if open_step.in_range == world:
                    del self._open[key]
                    result.records.append(self._emit(open_step, "all_ranks"))
        return result

    def expire(self) -> JoinResult:
        """Emit the steps whose window has passed."""
        result = JoinResult()
        deadline = self._clock() - self.window_s
        while self._open:
            key, oldest = next(iter(self._open.items()))
            if oldest.first_seen > deadline:
                break
            del self._open[key]
            result.records.append(self._emit(oldest, "window"))
        return result

    def flush(self) -> JoinResult:
        """Emit every open step now (shutdown)."""
        result = JoinResult()
        while self._open:
            _, oldest = self._open.popitem(last=False)
            result.records.append(self._emit(oldest, "shutdown"))
        return result

    # -- internals -----------------------------------------------------------------------------

    def _seed(self, run_id: str) -> None:
        self._runs.add(run_id)
        if self._history is None:
            return
        for step, ranks, end in self._history(run_id):
            mask = 0
            for rank in ranks:
                mask |= 1 << rank
            key = (run_id, step)
            have = self._emitted.get(key)
            if have is not None:
                mask |= have[0]
                end = have[1] if end is None else end if have[1] is None else max(end, have[1])
            self._remember(key, mask, end)

    def _remember(self, key: tuple[str, int], mask: int, end: float | None) -> None:
        self._emitted[key] = [mask, end]
        self._emitted.move_to_end(key)
        while len(self._emitted) > self.max_emitted:
            self._emitted.popitem(last=False)

    def _emit(self, open_step: _OpenStep, reason: str) -> dict[str, Any]:
        mask = 0
        for rank in open_step.ranks:
            mask |= 1 << rank
        ends = [s.end_time for s in open_step.ranks.values() if s.end_time is not None]
        self._remember((open_step.run_id, open_step.step), mask, max(ends) if ends else None)
        return cluster_record(open_step.run_id, open_step.step, open_step.trace_id, open_step.world_size,
                              list(open_step.ranks.values()), reason=reason,
                              first_seen_time=open_step.first_seen_time, joined_time=self._wall(),
                              join_seconds=max(0.0, self._clock() - open_step.first_seen))

    def _late(self, span: StepSpan) -> dict[str, Any]:
        return {
            "type": "late", "run_id": span.run_id, "step": span.step,
            "trace_id": span.trace_id or trace_id_hex(span.run_id, span.step), "rank": span.rank,
            "received_time": self._wall(), "compute_seconds": span.compute_seconds,
            "interval_seconds": span.interval_seconds, "idle_seconds": span.idle_seconds, "status": span.status,
            "end_time": span.end_time, "pipeline_bubble_ratio": dict(span.bubble),
        }


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def cluster_record(run_id: str, step: int, trace_id: str, world_size: int | None, spans: list[StepSpan], *,
                   reason: str, first_seen_time: float, joined_time: float, join_seconds: float) -> dict[str, Any]:
    """The ``cluster_step`` record of one step from its ranks' spans (the schema is in the README)."""
    spans = sorted(spans, key=lambda s: s.rank)
    ranks = [s.rank for s in spans]
    reported = set(ranks)
    missing = [r for r in range(world_size) if r not in reported] if world_size is not None else []
    complete = world_size is not None and not missing
    compute = [s.compute_seconds for s in spans]
    interval = [s.interval_seconds for s in spans]
    c_min, c_median, c_max = _stats(compute)
    i_min, i_median, i_max = _stats(interval)
    straggler = None
    if complete:
        straggler = max(spans, key=lambda s: (s.compute_seconds, -s.rank)).rank
    by_stage: dict[str, list[float]] = {}
    for s in spans:
        for stage, ratio in s.bubble.items():
            by_stage.setdefault(stage, []).append(ratio)
    status: dict[str, int] = {}
    for s in spans:
        status[s.status] = status.get(s.status, 0) + 1
    ends = [s.end_time for s in spans if s.end_time is not None]
    return {
        "type": "cluster_step",
        "run_id": run_id,
        "step": step,
        "trace_id": trace_id,
        "world_size": world_size,
        "ranks_reporting": len(spans),
        "missing_ranks": missing,
        "complete": complete,
        "reason": reason,
        "first_seen_time": first_seen_time,
        "joined_time": joined_time,
        "join_seconds": join_seconds,
        "end_time": max(ends) if ends else None,
        "rank_compute_seconds": {str(s.rank): s.compute_seconds for s in spans},
        "rank_interval_seconds": {str(s.rank): s.interval_seconds for s in spans},
        "compute_min_seconds": c_min,
        "compute_median_seconds": c_median,
        "compute_max_seconds": c_max,
        "interval_min_seconds": i_min,
        "interval_median_seconds": i_median,
        "interval_max_seconds": i_max,
        "skew_seconds": c_max - c_min,
        "straggler_rank": straggler,
        "compute_sum_seconds": sum(compute),
        "interval_sum_seconds": sum(interval),
        "pipeline_bubble_ratio": {stage: sum(v) / len(v) for stage, v in sorted(by_stage.items())},
        "status": status,
    }
