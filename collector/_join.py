"""The cross-rank join: one ``cluster_step`` record per step from every rank's ``train.step`` span.

All ranks' spans of step ``n`` of a run share a trace id (a hash of
``(run_id, n)``, DESIGN.md §4); the join groups by ``(run_id, step)``, which is
the same thing and needs no hashing. A step is emitted

* as soon as all ranks ``0 .. world_size-1`` reported (``reason: "all_ranks"``,
  ``complete: true``); ``world_size`` is the collector's ``--world-size`` or,
  without it, the first span's ``train.world_size``;
* ``window_s`` after its first span arrived, with whatever ranks did report
  (``reason: "window"``, ``complete: false``, ``missing_rank_count``,
  ``missing_rank_ranges`` and the first ``missing_ranks``, each bounded);
* early when more than ``max_open_steps`` steps are open (the oldest goes,
  ``reason: "evicted"``), which bounds memory whatever the senders do;
* at :meth:`Joiner.flush` (collector shutdown, ``reason: "shutdown"``).

A span for a step that was already emitted is *late*: it becomes a ``late``
record (appended to the run's ``cluster.jsonl``, so nothing is lost) and is
counted; the emitted record is not rewritten. A second span of the same rank
for the same step is a *duplicate* (an exporter retry; dropped) when it says
the same (:func:`span_fingerprint`), and a *conflict* when it does not: a
forged or confused sender. Neither version is trusted: the rank's spans go to
``conflicts`` (the collector writes them to ``conflicts.jsonl``), the rank is
left out of the step's statistics and listed in ``conflicting_ranks`` and
``missing_ranks``, so the step is incomplete and names no straggler. A forged
span can therefore hide a rank, never stand in for it.

Which ranks each emitted step had (a sorted array of ranks and one of
fingerprints: memory grows with the ranks that reported, not with their
numbers) is remembered for the last ``max_emitted`` steps *of each run*, so a
busy run cannot push another run's steps out; ``history`` seeds that memory
the first time a run is seen, so a restarted collector reads its own
``cluster.jsonl`` and does not emit a step twice.

Runs are admitted up to ``max_runs`` at a time; beyond that a new run takes
the place of the least recently active run only when that one has no open
step and was idle for ``run_idle_s``. Spans of a run not admitted are
refused (``too_many_runs``): one request naming 5,000 runs makes at most
``max_runs`` of them.

Steps are keyed by (run, attempt, step): ``train.attempt`` (0 when absent)
numbers the process starts of a run, so a step a resumed run executes again
is a new unit of its attempt, joined and written afresh (``attempt`` in the
record). A written (run, attempt, step, rank) is never replaced: whatever arrives later for
it is a duplicate (the same fingerprint), a ``late`` record (a rank the step
did not have) or a conflict (kept apart in ``conflicts``, counted), however
much later it claims to have ended. (A time gap once told a resumed run's
re-executed step from a late span; a token holder re-sending a written step
with ends an hour on then wrote a second record that stood.)

Without ``--world-size`` a run's world size is the one its first accepted
span carried; a span claiming another is refused (``world_size_mismatch``).

The straggler's candidate is the rank with the most time on its own
(``own_seconds`` = interval minus the rank's wait in collectives, where it
measures that wait; its compute otherwise), the lowest such rank on a tie. It
is named only when it stands out: its time on its own exceeds the median of
the other ranks' by at least ``max(straggler_min_seconds, straggler_min_ratio
× the step's median interval, the run's noise floor)`` (median compute where
the waits are not measured) and the others waited for it. The noise floor is
the run's own: how far the slowest of the *other* ranks stood out over the
run's last complete steps (``steptrace._attribution.StragglerRule``, one per
admitted run, fed the complete steps as they are emitted). In synchronous
training every rank's step is as long as the slowest's; only the time on
its own tells the rank that is slow from the ranks that wait for it. What it
cost the job (``straggler_cost_seconds``) is the median of the other ranks'
wait less its own (the collectives' own duration, which every rank pays). A
straggler is named only for complete steps: when a rank is missing, it may
well be the slowest one, so an incomplete step names none
(``straggler_rank: null``), its min/median/max/skew cover the ranks that
reported, and it does not enter the noise floor. Not thread-safe: the
collector calls it under its lock.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import heapq
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from steptrace._attribution import (STRAGGLER_MIN_RATIO, STRAGGLER_MIN_SECONDS, STRAGGLER_NOISE_WINDOW,
                                     StragglerRule, straggler_causes, straggler_step_seconds)
from steptrace._attribution import own_seconds as _own_seconds
from steptrace._ids import trace_id_hex
from steptrace.collector._decode import StepSpan, span_fingerprint

__all__ = ["JoinResult", "Joiner", "cluster_record"]

#: ``reason`` values of ``cluster_step`` records.
REASONS = ("all_ranks", "window", "evicted", "shutdown")

#: ``missing_ranks`` lists at most this many ranks and ``missing_rank_ranges`` this many ranges
#: (``missing_rank_count`` is exact).
MAX_MISSING_LISTED = 64
#: Stages in one record's ``pipeline_bubble_ratio`` (the first ones met, by rank).
MAX_STAGES_PER_STEP = 256
#: ``slowest_ranks`` lists this many ranks: the most time on their own first.
SLOWEST_LISTED = 10

#: A history entry: a rank, or (rank, fingerprint); a bare rank matches any span (a duplicate).
HistoryRank = int | tuple[int, int | None]
#: What ``history`` gives per written step: (step, ranks, end time) or (step, ranks, end time, attempt).
HistoryEntry = tuple[int, Iterable[HistoryRank], float | None] | tuple[int, Iterable[HistoryRank], float | None, int]


@dataclass
class _OpenStep:
    run_id: str
    step: int
    attempt: int
    trace_id: str
    world_size: int | None
    first_seen: float  # monotonic
    first_seen_time: float  # unix
    ranks: dict[int, StepSpan] = field(default_factory=dict)
    in_range: int = 0  # ranks reported in [0, world_size)
    conflicted: set[int] = field(default_factory=set)


class _Emitted:
    """The ranks an emitted step had: sorted ranks, their fingerprints (-1: any), the latest end time.

    Kept for duplicates, late spans and conflicts after the step is written, so O(ranks that
    reported) per step, for ``max_emitted`` steps per run. Compact where it can be: ranks exactly
    ``0 .. n-1`` (a complete step) are a count, not an array (``ranks`` is None); fingerprints all
    known are 4 bytes each (crc32), all unknown (seeded from a record without per-rank maps) none
    (``fingerprints`` is None). At 16,384 ranks a complete step holds 64 KiB instead of 256 KiB.
    """

    __slots__ = ("count", "end", "fingerprints", "ranks")

    def __init__(self, pairs: Iterable[tuple[int, int | None]], end: float | None):
        ordered = sorted(dict(pairs).items())
        self.count = len(ordered)
        dense = not ordered or (ordered[0][0] == 0 and ordered[-1][0] == len(ordered) - 1)
        self.ranks: array.array[int] | None = None if dense else array.array("q", (r for r, _ in ordered))
        known = [f for _, f in ordered if f is not None]
        self.fingerprints: array.array[int] | None
        if not known:
            self.fingerprints = None
        elif len(known) == len(ordered):
            self.fingerprints = array.array("I", known)
        else:
            self.fingerprints = array.array("q", (-1 if f is None else f for _, f in ordered))
        self.end = end

    def _index(self, rank: int) -> int | None:
        if self.ranks is None:
            return rank if 0 <= rank < self.count else None
        i = bisect.bisect_left(self.ranks, rank)
        return i if i < len(self.ranks) and self.ranks[i] == rank else None

    def find(self, rank: int) -> int | None:
        """The fingerprint of ``rank`` (-1: unknown), None when the rank is not in the step."""
        i = self._index(rank)
        if i is None:
            return None
        return -1 if self.fingerprints is None else self.fingerprints[i]

    def pairs(self) -> list[tuple[int, int | None]]:
        """(rank, fingerprint or None) of every rank it holds."""
        ranks = range(self.count) if self.ranks is None else self.ranks
        if self.fingerprints is None:
            return [(r, None) for r in ranks]
        return [(r, None if f == -1 else f) for r, f in zip(ranks, self.fingerprints)]

    def add(self, rank: int, fingerprint: int) -> None:
        # Rare (a late span): back to the plain arrays.
        if self.ranks is None:
            self.ranks = array.array("q", range(self.count))
        if self.fingerprints is None or self.fingerprints.typecode != "q":
            self.fingerprints = array.array("q", [-1] * self.count if self.fingerprints is None else self.fingerprints)
        i = bisect.bisect_left(self.ranks, rank)
        self.ranks.insert(i, rank)
        self.fingerprints.insert(i, fingerprint)
        self.count += 1


class _Run:
    __slots__ = ("emitted", "last_active", "open", "owner", "stragglers", "world_size")

    def __init__(self, now: float, owner: str, stragglers: StragglerRule):
        self.world_size: int | None = None  # established by the run's first span that carries one
        #: the run's straggler rule: its noise floor over the last complete steps emitted
        self.stragglers = stragglers
        #: (attempt, step) -> the ranks it was written with
        self.emitted: collections.OrderedDict[tuple[int, int], _Emitted] = collections.OrderedDict()
        self.open = 0
        self.last_active = now
        self.owner = owner


@dataclass
class JoinResult:
    """What one call emitted: records to write (``cluster_step`` and ``late``), duplicates by run, conflicts."""

    records: list[dict[str, Any]] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)
    #: ``conflict`` records (both versions of a rank's span, the first one once)
    conflicts: list[dict[str, Any]] = field(default_factory=list)
    #: spans refused because their run was not admitted (``too_many_runs``)
    refused: int = 0
    #: spans refused because their world size is not their run's (``world_size_mismatch``)
    mismatched: int = 0

    def extend(self, other: JoinResult) -> None:
        self.records += other.records
        self.conflicts += other.conflicts
        self.refused += other.refused
        self.mismatched += other.mismatched
        for run, n in other.duplicates.items():
            self.duplicates[run] = self.duplicates.get(run, 0) + n


class Joiner:
    """Groups step spans by ``(run_id, step)`` and emits joined records (see the module doc)."""

    def __init__(self, *, world_size: int | None = None, window_s: float = 10.0, max_open_steps: int = 4096,
                 max_emitted: int = 8192, max_runs: int = 64, run_idle_s: float = 300.0,
                 max_runs_per_owner: int | None = None,
                 history: Callable[[str], Iterable[HistoryEntry]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 straggler_min_seconds: float = STRAGGLER_MIN_SECONDS,
                 straggler_min_ratio: float = STRAGGLER_MIN_RATIO,
                 straggler_noise_window_steps: int = STRAGGLER_NOISE_WINDOW, per_rank: bool = False):
        self.world_size = world_size
        self.straggler_noise_window_steps = straggler_noise_window_steps
        #: keep the per-rank maps in records (``--cluster-per-rank``); otherwise aggregates only
        self.per_rank = per_rank
        self.straggler_min_seconds = straggler_min_seconds
        self.straggler_min_ratio = straggler_min_ratio
        self.window_s = window_s
        self.max_open_steps = max_open_steps
        self.max_emitted = max_emitted
        self.max_runs = max_runs
        self.run_idle_s = run_idle_s
        self.max_runs_per_owner = max_runs_per_owner
        self._owned: dict[str, int] = {}
        self._history = history
        self._clock = clock
        self._wall = wall_clock
        # Insertion order is arrival order of each step's first span, so expiry stops at the first young one.
        self._open: collections.OrderedDict[tuple[str, int], _OpenStep] = collections.OrderedDict()
        # Admitted runs, least recently active first.
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()

    @property
    def open_steps(self) -> int:
        return len(self._open)

    def open_in(self, run_id: str) -> int:
        """Open steps of ``run_id``."""
        run = self._runs.get(run_id)
        return run.open if run is not None else 0

    def open_spans(self, run_id: str) -> list[StepSpan]:
        """The spans of ``run_id``'s open steps (what a journal must keep)."""
        return [s for o in self._open.values() if o.run_id == run_id for s in o.ranks.values()]

    def seen(self, span: StepSpan) -> bool:
        """Whether the joiner holds or wrote this very span (an exporter retry: not journaled again)."""
        fingerprint = span_fingerprint(span.compute_seconds, span.interval_seconds)
        open_step = self._open.get((span.run_id, span.attempt, span.step))
        if open_step is not None:
            first = open_step.ranks.get(span.rank)
            return first is not None and \
                span_fingerprint(first.compute_seconds, first.interval_seconds) == fingerprint
        run = self._runs.get(span.run_id)
        emitted = run.emitted.get((span.attempt, span.step)) if run is not None else None
        return emitted is not None and emitted.find(span.rank) in (-1, fingerprint)

    def mismatched(self, span: StepSpan) -> bool:
        """Whether ``span`` claims a world size other than its run's (it will be refused; not journaled)."""
        run = self._runs.get(span.run_id)
        return (self.world_size is None and run is not None and run.world_size is not None
                and span.world_size is not None and span.world_size != run.world_size)

    def known(self, run_id: str) -> bool:
        """Whether ``run_id`` is admitted now (admits nothing)."""
        return run_id in self._runs

    def admitted(self, run_id: str, owner: str = "") -> bool:
        """Whether spans of ``run_id`` are taken: admits it if there is room (see the module doc)."""
        return self._admit(run_id, self._clock(), owner) is not None

    def add(self, spans: Iterable[StepSpan], owner: str = "") -> JoinResult:
        """Add step spans; returns the steps they completed (or evicted), the late spans and conflicts.

        ``owner`` (a token) admits new runs against its own quota, ``max_runs_per_owner``;
        "" (no tokens, or the one shared token) has none.
        """
        result = JoinResult()
        now = self._clock()
        for span in spans:
            run = self._admit(span.run_id, now, owner)
            if run is None:
                result.refused += 1
                continue
            run.last_active = now
            if self.world_size is None and span.world_size is not None:
                if run.world_size is None:
                    run.world_size = span.world_size
                elif span.world_size != run.world_size:
                    result.mismatched += 1
                    continue
            fingerprint = span_fingerprint(span.compute_seconds, span.interval_seconds)
            emitted = run.emitted.get((span.attempt, span.step))
            if emitted is not None:
                have = emitted.find(span.rank)
                if have is None:
                    emitted.add(span.rank, fingerprint)
                    result.records.append(self._late(span))
                elif have in (-1, fingerprint):
                    result.duplicates[span.run_id] = result.duplicates.get(span.run_id, 0) + 1
                else:
                    result.conflicts.append(self._conflict(span, "after_emit"))
                continue
            key = (span.run_id, span.attempt, span.step)
            open_step = self._open.get(key)
            if open_step is None:
                if len(self._open) >= self.max_open_steps:
                    _, oldest = self._open.popitem(last=False)
                    result.records.append(self._emit(oldest, "evicted"))
                open_step = _OpenStep(
                    run_id=span.run_id, step=span.step, attempt=span.attempt,
                    trace_id=span.trace_id or trace_id_hex(span.run_id, span.step, span.attempt),
                    world_size=self.world_size if self.world_size is not None else run.world_size,
                    first_seen=now, first_seen_time=self._wall())
                self._open[key] = open_step
                run.open += 1
            first = open_step.ranks.get(span.rank)
            if first is not None:
                if span_fingerprint(first.compute_seconds, first.interval_seconds) == fingerprint:
                    result.duplicates[span.run_id] = result.duplicates.get(span.run_id, 0) + 1
                    continue
                if span.rank not in open_step.conflicted:
                    open_step.conflicted.add(span.rank)
                    result.conflicts.append(self._conflict(first, "open"))
                result.conflicts.append(self._conflict(span, "open"))
                continue
            open_step.ranks[span.rank] = span
            world = open_step.world_size
            if world is not None and span.rank < world:
                open_step.in_range += 1
                if open_step.in_range == world:
                    del self._open[key]
                    result.records.append(self._emit(open_step, "all_ranks"))
        return result

    def expire(self, max_steps: int | None = None) -> JoinResult:
        """Emit the steps whose window has passed, at most ``max_steps`` of them (the oldest first)."""
        result = JoinResult()
        deadline = self._clock() - self.window_s
        while self._open and (max_steps is None or len(result.records) < max_steps):
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

    def _admit(self, run_id: str, now: float, owner: str = "") -> _Run | None:
        run = self._runs.get(run_id)
        if run is not None:
            self._runs.move_to_end(run_id)
            return run
        if owner and self.max_runs_per_owner is not None and self._owned.get(owner, 0) >= self.max_runs_per_owner:
            # This owner's quota is full: its own least recently active idle run may give way.
            for old_id, old in self._runs.items():
                if old.owner == owner:
                    if old.open or now - old.last_active < self.run_idle_s:
                        return None
                    self._drop(old_id)
                    break
        if len(self._runs) >= self.max_runs:
            old_id, old = next(iter(self._runs.items()))
            if old.open or now - old.last_active < self.run_idle_s:
                return None
            self._drop(old_id)
        run = self._runs[run_id] = _Run(now, owner, StragglerRule(
            self.straggler_noise_window_steps, min_seconds=self.straggler_min_seconds,
            min_ratio=self.straggler_min_ratio))
        if owner:
            self._owned[owner] = self._owned.get(owner, 0) + 1
        self._seed(run_id, run)
        return run

    def _drop(self, run_id: str) -> None:
        run = self._runs.pop(run_id)
        if run.owner:
            left = self._owned.get(run.owner, 1) - 1
            if left > 0:
                self._owned[run.owner] = left
            else:
                self._owned.pop(run.owner, None)

    def _seed(self, run_id: str, run: _Run) -> None:
        if self._history is None:
            return
        for entry in self._history(run_id):
            step, ranks, end = entry[0], entry[1], entry[2]
            unit = (entry[3] if len(entry) > 3 else 0, step)  # type: ignore[misc]
            pairs = [(r, None) if isinstance(r, int) else (r[0], r[1]) for r in ranks]
            have = run.emitted.get(unit)
            if have is not None:
                pairs += have.pairs()
                end = have.end if end is None else end if have.end is None else max(end, have.end)
            self._remember(run, unit, _Emitted(pairs, end))

    def _remember(self, run: _Run, unit: tuple[int, int], emitted: _Emitted) -> None:
        run.emitted[unit] = emitted
        run.emitted.move_to_end(unit)
        while len(run.emitted) > self.max_emitted:
            run.emitted.popitem(last=False)

    def _emit(self, open_step: _OpenStep, reason: str) -> dict[str, Any]:
        run = self._runs.get(open_step.run_id)
        spans = list(open_step.ranks.values())
        ends = [s.end_time for s in spans if s.end_time is not None]
        if run is not None:
            run.open -= 1
            pairs = [(s.rank, span_fingerprint(s.compute_seconds, s.interval_seconds)) for s in spans]
            self._remember(run, (open_step.attempt, open_step.step), _Emitted(pairs, max(ends) if ends else None))
        trusted = [s for s in spans if s.rank not in open_step.conflicted]
        return cluster_record(open_step.run_id, open_step.step, open_step.trace_id, open_step.world_size,
                              trusted, reason=reason, attempt=open_step.attempt,
                              first_seen_time=open_step.first_seen_time,
                              joined_time=self._wall(), join_seconds=max(0.0, self._clock() - open_step.first_seen),
                              conflicting_ranks=sorted(open_step.conflicted),
                              straggler_min_seconds=self.straggler_min_seconds,
                              straggler_min_ratio=self.straggler_min_ratio, per_rank=self.per_rank,
                              stragglers=run.stragglers if run is not None else None)

    def _late(self, span: StepSpan) -> dict[str, Any]:
        return {
            "type": "late", "run_id": span.run_id, "attempt": span.attempt, "step": span.step,
            "trace_id": span.trace_id or trace_id_hex(span.run_id, span.step, span.attempt), "rank": span.rank,
            "received_time": self._wall(), "compute_seconds": span.compute_seconds,
            "interval_seconds": span.interval_seconds, "idle_seconds": span.idle_seconds, "status": span.status,
            "end_time": span.end_time, "pipeline_bubble_ratio": dict(span.bubble),
            "collective_wait_seconds": span.collective_wait_seconds, "own_seconds": span.own_seconds,
        }

    def _conflict(self, span: StepSpan, when: str) -> dict[str, Any]:
        record = self._late(span)
        record["type"] = "conflict"
        record["when"] = when  # "open": neither version joined; "after_emit": the written record stands
        return record


def _stats(values: list[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    return min(values), statistics.median(values), max(values)


def with_device_waits(spans: list[StepSpan], world_size: int | None) -> list[StepSpan]:
    """The step's spans with each rank's wait in its device-timed NCCL collectives, joined across the
    ranks as ``steptrace.analysis.collectives`` joins their files: a collective's wait on a rank is its
    device duration less the shortest rank's (every rank finishes with the last transfer; no clock is
    compared across hosts). Only when every rank of the job sent the step, none measured its wait
    itself, and every collective is in every span with a duration; otherwise the spans as they are (a
    wait is never claimed from a partial view, nor from an async collective, whose duration is null)."""
    if world_size is None or len(spans) != world_size or len(spans) < 2:
        return spans
    keys: set[tuple[str, int]] | None = None
    shortest: dict[tuple[str, int], float] = {}
    for span in spans:
        collectives = span.collectives
        if span.collective_wait_seconds is not None or not collectives:
            return spans
        own_keys = set()
        for group, seq, seconds in collectives:
            if seconds is None:
                return spans
            own_keys.add((group, seq))
            shortest[(group, seq)] = min(seconds, shortest.get((group, seq), math.inf))
        if len(own_keys) != len(collectives) or (keys is not None and own_keys != keys):
            return spans  # a collective twice, or not the same collectives on every rank in this step
        keys = own_keys
    filled = []
    for span in spans:
        assert span.collectives is not None
        wait = min(math.fsum(seconds - shortest[(group, seq)] for group, seq, seconds in span.collectives
                             if seconds is not None), span.compute_seconds, span.interval_seconds)
        filled.append(dataclasses.replace(span, collective_wait_seconds=wait,
                                          own_seconds=_own_seconds(span.interval_seconds, wait),
                                          own_compute_seconds=max(0.0, span.compute_seconds - wait)))
    return filled


def cluster_record(run_id: str, step: int, trace_id: str, world_size: int | None, spans: list[StepSpan], *,
                   reason: str, first_seen_time: float, joined_time: float, join_seconds: float,
                   conflicting_ranks: list[int] | None = None, attempt: int = 0,
                   straggler_min_seconds: float = STRAGGLER_MIN_SECONDS,
                   straggler_min_ratio: float = STRAGGLER_MIN_RATIO, per_rank: bool = True,
                   stragglers: StragglerRule | None = None) -> dict[str, Any]:
    """The ``cluster_step`` record of one step from its ranks' spans (the schema is in docs/collector.md).

    ``spans`` are the trusted ones; ``conflicting_ranks`` sent two different spans and count as missing.
    ``stragglers``: the run's rule, which judges the step if it is complete (and takes it into its
    noise floor); without one, a rule with no history (the fixed bounds only) judges it.
    Without ``per_rank`` the record holds no per-rank map (``rank_*_seconds``): its size does not
    grow with the ranks but for ``slowest_ranks`` (at most :data:`SLOWEST_LISTED`); the ranks'
    time on their own is then under ``"_own"``, for the collector's scores, never written.
    """
    spans = with_device_waits(sorted(spans, key=lambda s: s.rank), world_size)
    # Missing ranks as ranges between the reported ones: the work grows with the ranks that
    # reported, not with a world size a sender claims (one span of world_size 65536 once made
    # a 65,535-entry list per step).
    ranges: list[list[int]] = []
    missing_count = 0
    if world_size is not None:
        low = 0
        for rank in sorted({s.rank for s in spans if s.rank < world_size} - set(conflicting_ranks or ())) + \
                [world_size]:
            if rank > low:
                missing_count += rank - low
                if len(ranges) < MAX_MISSING_LISTED:
                    ranges.append([low, rank - 1])
            low = rank + 1
    missing: list[int] = []
    for first, last in ranges:
        missing += range(first, min(last + 1, first + MAX_MISSING_LISTED - len(missing)))
        if len(missing) >= MAX_MISSING_LISTED:
            break
    complete = world_size is not None and missing_count == 0
    compute = [s.compute_seconds for s in spans]
    interval = [s.interval_seconds for s in spans]
    c_min, c_median, c_max = _stats(compute)
    i_min, i_median, i_max = _stats(interval)
    own = {s.rank: s.compute_seconds if s.own_seconds is None else s.own_seconds for s in spans}
    measured = bool(spans) and all(s.collective_wait_seconds is not None for s in spans)
    step_seconds = straggler_step_seconds(i_median, c_median, measured)
    o_min, o_median, o_max = _stats(list(own.values()))
    verdict = None
    if complete:
        rule = stragglers if stragglers is not None else StragglerRule(min_seconds=straggler_min_seconds,
                                                                       min_ratio=straggler_min_ratio)
        verdict = rule.judge({s.rank: (own[s.rank], s.collective_wait_seconds) for s in spans}, step_seconds)
    found = None if verdict is None else verdict.straggler
    # Why, on the host (docs/pauses.md): only where every rank measured its pauses (a rank that did not
    # would count as having none).
    causes = None
    gc_evidence = None
    if found is not None and all(s.causes is not None for s in spans):
        causes = straggler_causes({s.rank: s.causes for s in spans}, found.rank,  # type: ignore[misc]
                                  found.excess_seconds)
        culprit = next(s for s in spans if s.rank == found.rank)
        if "gc" in causes and culprit.gc_max is not None and culprit.causes is not None:
            gc_evidence = {"max_seconds": culprit.gc_max[0], "generation": culprit.gc_max[1]}
    by_stage: dict[str, list[float]] = {}
    for s in spans:
        for stage, ratio in s.bubble.items():
            if stage in by_stage or len(by_stage) < MAX_STAGES_PER_STEP:
                by_stage.setdefault(stage, []).append(ratio)
    status: dict[str, int] = {}
    for s in spans:
        status[s.status] = status.get(s.status, 0) + 1
    ends = [s.end_time for s in spans if s.end_time is not None]
    record = {
        "type": "cluster_step",
        "run_id": run_id,
        "attempt": attempt,
        "step": step,
        "trace_id": trace_id,
        "world_size": world_size,
        "ranks_reporting": len(spans),
        "missing_ranks": missing,
        "missing_rank_count": missing_count,
        "missing_rank_ranges": ranges,
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
        "skew_seconds": c_max - c_min if c_max is not None and c_min is not None else None,
        "rank_collective_wait_seconds": {str(s.rank): s.collective_wait_seconds for s in spans
                                         if s.collective_wait_seconds is not None},
        "rank_own_seconds": {str(rank): seconds for rank, seconds in own.items()},
        "own_min_seconds": o_min,
        "own_median_seconds": o_median,
        "own_max_seconds": o_max,
        "straggler_rank": None if found is None else found.rank,
        "straggler_cost_seconds": None if found is None else found.cost_seconds,
        "straggler_excess_seconds": None if found is None else found.excess_seconds,
        "straggler_threshold_seconds": None if verdict is None else verdict.threshold_seconds,
        "straggler_noise_seconds": None if verdict is None else verdict.noise_seconds,
        "straggler_causes": causes,
        "straggler_gc": gc_evidence,
        "compute_sum_seconds": sum(compute),
        "interval_sum_seconds": sum(interval),
        # Waiting shown as waiting: the ranks' own compute (the wait in collectives inside their
        # compute taken out, where they measure it) and their wait, min / median / max over ranks.
        "own_compute_sum_seconds": sum(s.compute_seconds if s.own_compute_seconds is None else s.own_compute_seconds
                                       for s in spans),
        **dict(zip(("collective_wait_min_seconds", "collective_wait_median_seconds", "collective_wait_max_seconds"),
                   _stats([s.collective_wait_seconds for s in spans if s.collective_wait_seconds is not None]))),
        # NCCL collectives timed on the device: the ranks' communication no compute overlapped (each
        # rank's own figure; the wait for peers in it needs the per-collective durations, not sent).
        **dict(zip(("exposed_communication_min_seconds", "exposed_communication_median_seconds",
                    "exposed_communication_max_seconds"),
                   _stats([s.exposed_communication_seconds for s in spans
                           if s.exposed_communication_seconds is not None]))),
        "pipeline_bubble_ratio": {stage: sum(v) / len(v) for stage, v in sorted(by_stage.items())},
        "status": status,
        "conflicting_ranks": list(conflicting_ranks or []),
        "slowest_ranks": [[rank, seconds] for rank, seconds in
                          heapq.nsmallest(SLOWEST_LISTED, own.items(), key=lambda kv: (-kv[1], kv[0]))],
    }
    health = {str(s.rank): s.health for s in spans if s.health is not None}
    if health:
        # The GPU health windows that ended in this step, by rank (health="nvml", docs/health.md): one
        # per rank per sampling period (1 s) whatever the step rate, so kept without --cluster-per-rank:
        # the straggler's GPU cause is read from them. Absent where no rank sent one.
        record["rank_health"] = health
    if not per_rank:
        for key in ("rank_compute_seconds", "rank_interval_seconds", "rank_collective_wait_seconds",
                    "rank_own_seconds"):
            del record[key]
        record["_own"] = own
    return record
