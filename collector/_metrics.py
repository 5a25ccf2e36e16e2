"""The collector's ``/metrics``: the cluster view of each run, and the collector's own counters.

A ``prometheus_client`` registry of its own (never the global one), served on
``--metrics-port``. Cluster series carry ``run_id``; the step number is never a
label. Gauges describing "the last step" follow the highest step number joined
so far (a step completed out of order does not move them back):

* ``steptrace_cluster_step_compute_seconds{stat}``, ``..._interval_seconds{stat}``
  (``stat`` = ``min``/``median``/``max`` over ranks), ``steptrace_cluster_step_skew_seconds``
  (max − min compute), ``steptrace_cluster_straggler_rank`` and
  ``steptrace_cluster_pipeline_bubble_ratio{stage}``: the last *complete* step (at most
  ``MAX_STAGES_PER_RUN`` stages per run; more are counted in
  ``steptrace_collector_dropped_label_values_total{label="stage"}``).
  ``steptrace_cluster_last_complete_step`` says which one.
* ``steptrace_cluster_ranks_reporting``, ``steptrace_cluster_world_size``,
  ``steptrace_cluster_last_step``: the last step emitted, complete or not.
* ``steptrace_cluster_compute_share_ratio``: Σ own compute / Σ interval over all reporting
  ranks of the last ``goodput_window_steps`` steps emitted (own compute: compute less the wait in
  collectives, where the ranks measure it). Not goodput: the collector sees no process start and
  no time outside steps (goodput is the ranks' ``steptrace_goodput_ratio``, docs/goodput.md).
* ``steptrace_cluster_step_collective_wait_seconds{stat}``: the ranks' wait in collectives in the
  last complete step (min, median, max over ranks; where they measure it).
* ``steptrace_cluster_step_exposed_communication_seconds{stat}``: the ranks' exposed communication
  in the last complete step (NCCL collectives timed on the device; min, median, max over the ranks
  that sent it).
* Stragglers (complete steps): ``steptrace_cluster_step_own_seconds{stat}`` (each rank's time on
  its own: interval minus its wait in collectives, compute where the wait is not measured),
  ``steptrace_cluster_step_straggler_cost_seconds``
  (the last complete step: what its straggler cost the job, the other ranks' median wait less its
  own; 0 when no rank stood out), ``steptrace_cluster_straggler_steps_total{rank}`` and
  ``steptrace_cluster_straggler_cost_seconds_total{rank}`` (summed over the steps it was named;
  a rank's two counters appear when it is first named, at their first value), and
  ``steptrace_cluster_straggler_cause_seconds_total{rank, cause}`` (the part of that excess a host
  cause, ``gc``/``preempted``/``data``, explains: docs/pauses.md; where the ranks run ``pauses=True``),
  ``steptrace_cluster_straggler_score{rank, kind}`` over the last ``straggler_window_steps``
  complete steps, for the ``straggler_score_ranks`` (10) lowest scores of each kind only
  (``relative``: median rank's mean time on its own / this rank's; ``individual``: this rank's
  best windowed mean / its current one; 1 is typical, lower is slower).
  ``steptrace_cluster_step_straggler_threshold_seconds``: the excess the last complete step's
  candidate had to reach (fixed bounds and the run's noise floor).
* The run's straggler, a verdict (``steptrace._attribution.StragglerPersistence``): the rank named
  in at least half of the last ``straggler_window_steps`` complete steps, if any, has
  ``steptrace_cluster_persistent_straggler_steps_ratio{rank}`` (that share),
  ``..._cost_seconds{rank}`` (its median cost over them, where the ranks measure their wait) and
  ``..._own_ratio{rank}`` (its mean time on its own over the median rank's, the window's): at most
  one rank per run, its series gone when it stops being one. The alert reads these
  (collector/alerts.yml ``SteptraceStraggler``), not a rule of its own.
* ``steptrace_cluster_capture_requests_total{state}``: the profiler captures this collector asked of
  the run's ranks when its straggler verdict changed (collector/_captures.py, docs/capture.md):
  ``issued`` (the culprit and a reference rank), ``fetched`` by the rank named, ``expired`` (never
  fetched: the rank's capture is off, a newer verdict replaced it, or the run was dropped). All three
  exist from a run's first span, at 0.

A run's series are removed when more than ``max_runs`` runs have been seen
since (least recently active first), so a stream of run ids cannot grow the
exposition without bound. Rejections are counted without ``run_id``: a
rejected request has no run anyone can trust.
"""

from __future__ import annotations

import collections
import heapq
import statistics
import threading
from collections.abc import Callable, Iterable
from typing import Any

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
except ImportError as _exc:  # pragma: no cover - exercised by users without the extra
    raise ImportError("the steptrace collector needs prometheus_client: pip install 'steptrace[prometheus]'") from _exc

from steptrace._attribution import (HOST_CAUSES, ComputeShareWindow, Straggler, StragglerPersistence,
                                     StragglerScores)
from steptrace._health import window_errors, window_throttled
from steptrace._version import __version__
from steptrace.collector._decode import INVALID_SPAN_REASONS, REJECTION_REASONS

__all__ = ["JOIN_LAG_BUCKETS_S", "ClusterMetrics"]

#: Buckets of ``steptrace_cluster_join_lag_seconds``: first span of a step to its record.
JOIN_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0, 300.0)

_STATS = ("min", "median", "max")
#: ``state`` of ``steptrace_cluster_capture_requests_total`` (collector/_captures.py).
_CAPTURE_STATES = ("issued", "fetched", "expired")
#: ``stage`` label values of ``steptrace_cluster_pipeline_bubble_ratio`` per run (the last complete step's).
MAX_STAGES_PER_RUN = 64
#: Ranks per run and kind with a ``steptrace_cluster_straggler_score`` series: the lowest scores
#: (``--straggler-score-ranks``).
DEFAULT_SCORE_RANKS = 10


class _RunState:
    __slots__ = ("health", "health_window", "last_complete", "last_step", "persistence", "persistent", "scored",
                 "scores", "stages", "straggler_ranks", "window", "cause_series", "recent_causes")

    def __init__(self, window_steps: int, straggler_window_steps: int):
        self.window = ComputeShareWindow(window_steps)
        self.scores = StragglerScores(straggler_window_steps)
        self.persistence = StragglerPersistence(straggler_window_steps)
        self.persistent: str | None = None  # the rank with persistent-straggler series
        self.last_step = -1
        self.last_complete = -1
        self.stages: set[str] = set()
        self.straggler_ranks: set[str] = set()
        self.cause_series: set[tuple[str, str]] = set()  # (rank, cause) with a straggler-cause series
        #: (rank named, its host causes) of the last complete steps with a straggler: the verdict's "why"
        self.recent_causes: collections.deque[tuple[int, tuple[str, ...]]] = collections.deque(
            maxlen=straggler_window_steps)
        self.scored: set[tuple[str, str]] = set()  # (rank, kind) with a score series
        #: per rank, its last GPU health windows: (steps sharing it, throttled 0/1 or None, errors)
        self.health: dict[int, collections.deque[tuple[float, float | None, int]]] = {}
        self.health_window = straggler_window_steps


class ClusterMetrics:
    """Metric families and the per-run state behind them; thread-safe."""

    def __init__(self, *, goodput_window_steps: int = 100, max_runs: int = 64,
                 open_steps: Callable[[], int] | None = None, straggler_window_steps: int = 100,
                 straggler_score_ranks: int = DEFAULT_SCORE_RANKS):
        self._window_steps = goodput_window_steps
        self._score_ranks = straggler_score_ranks
        self._straggler_window_steps = straggler_window_steps
        self._max_runs = max_runs
        # Re-entrant: a verdict (under the lock) issues capture requests, which count themselves here.
        self._lock = threading.RLock()
        self._runs: collections.OrderedDict[str, _RunState] = collections.OrderedDict()
        #: Told (run_id, culprit, reference rank or None, step, detail) when a run's straggler verdict
        #: changes to a rank (the capture requests, collector/_captures.py).
        self.on_verdict: Callable[[str, int, int | None, int, str], None] | None = None
        self.registry = reg = CollectorRegistry()
        run = ("run_id",)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, run + labels, registry=reg)

        def counter(name: str, doc: str, labels: tuple[str, ...] = run) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        self.compute = gauge("steptrace_cluster_step_compute_seconds",
                             "Device compute time of the last complete step: min, median and max over ranks.",
                             ("stat",))
        self.interval = gauge("steptrace_cluster_step_interval_seconds",
                              "Interval (wall time) of the last complete step: min, median and max over ranks.",
                              ("stat",))
        self.skew = gauge("steptrace_cluster_step_skew_seconds",
                          "Max minus min compute time over ranks in the last complete step.")
        self.straggler = gauge("steptrace_cluster_straggler_rank",
                               "The rank that slowed the last complete step: the most time on its own (compute "
                               "minus wait in collectives), standing out from the others; -1 when none did.")
        self.straggler_steps = counter("steptrace_cluster_straggler_steps",
                                       "Complete steps in which this rank was named the straggler.",
                                       run + ("rank",))
        self.collective_wait = gauge("steptrace_cluster_step_collective_wait_seconds",
                                     "Time waiting for other ranks in collectives in the last complete step "
                                     "(exposed communication): min, median and max over ranks.", ("stat",))
        self.exposed_communication = gauge(
            "steptrace_cluster_step_exposed_communication_seconds", "Communication no compute overlapped "
            "in the last complete step (NCCL collectives timed on the device: the wait for the latest "
            "peer and the transfer): min, median and max over the ranks that sent it.", ("stat",))
        self.own = gauge("steptrace_cluster_step_own_seconds",
                         "Time on its own (interval minus wait in collectives) of the last complete step: min, "
                         "median and max over ranks.", ("stat",))
        self.straggler_cost = gauge("steptrace_cluster_step_straggler_cost_seconds",
                                    "What the straggler of the last complete step cost the job: the other ranks' "
                                    "median wait in collectives less its own (0 when no rank stood out).")
        self.straggler_cost_total = counter("steptrace_cluster_straggler_cost_seconds",
                                            "Seconds this rank cost the job as the straggler (the other ranks' "
                                            "median wait less its own), summed over the steps it was named.",
                                            run + ("rank",))
        self.straggler_cause_total = counter(
            "steptrace_cluster_straggler_cause_seconds", "Seconds of this host cause (gc, preempted, data: "
            "docs/pauses.md) this rank had beyond the other ranks' median in the steps it was named the straggler "
            "with that cause, summed; where every rank measures its host pauses (pauses=True).",
            run + ("rank", "cause"))
        self.straggler_threshold = gauge("steptrace_cluster_step_straggler_threshold_seconds",
                                         "The excess of time on its own the last complete step's candidate "
                                         "needed to be named the straggler: the largest of the fixed bounds "
                                         "and the run's noise floor.")
        window = straggler_window_steps
        self.persistent_share = gauge("steptrace_cluster_persistent_straggler_steps_ratio",
                                      f"The run's straggler: the rank named the straggler in at least half of "
                                      f"the last {window} complete steps (only that rank has a series), and "
                                      f"that share.", ("rank",))
        self.persistent_cost = gauge("steptrace_cluster_persistent_straggler_cost_seconds",
                                     f"The run's straggler's median cost to the job per step it was named, over "
                                     f"the last {window} complete steps.", ("rank",))
        self.persistent_own = gauge("steptrace_cluster_persistent_straggler_own_ratio",
                                    f"The run's straggler's mean time on its own over the median rank's, over "
                                    f"the last {window} complete steps.", ("rank",))
        self.persistent_gpu_throttled = gauge(
            "steptrace_cluster_persistent_straggler_gpu_throttled_ratio",
            f"The run's straggler's GPU: the share of its steps, over its last {window} health windows, whose "
            "clocks a thermal, power, board-limit, reliability or sync-boost policy held down for >= 1 % of the "
            "window, or a slowing clocks-event reason showed (health='nvml', docs/health.md).", ("rank",))
        self.persistent_gpu_others_throttled = gauge(
            "steptrace_cluster_persistent_straggler_gpu_others_throttled_ratio",
            "The same share for the median other rank: the straggler's GPU is a cause only above it.", ("rank",))
        self.persistent_gpu_errors = gauge(
            "steptrace_cluster_persistent_straggler_gpu_errors",
            f"The run's straggler's GPU errors over its last {window} health windows: Xid events, uncorrected "
            "ECC errors, uncorrectable remapped rows, NVLink errors.", ("rank",))
        self.straggler_score = gauge("steptrace_cluster_straggler_score",
                                     "Per-rank straggler score over the last straggler_window_steps complete "
                                     "steps: relative (median rank's mean time on its own / this rank's) and "
                                     "individual (this rank's best windowed mean / its current one); lower is "
                                     "slower.", ("rank", "kind"))
        self.ranks_reporting = gauge("steptrace_cluster_ranks_reporting",
                                     "Ranks whose span of the last joined step arrived before it was emitted.")
        self.world_size = gauge("steptrace_cluster_world_size", "Ranks expected per step.")
        self.bubble = gauge("steptrace_cluster_pipeline_bubble_ratio",
                            "Pipeline bubble ratio per stage in the last complete step (mean over the stage's "
                            "ranks).", ("stage",))
        self.compute_share = gauge("steptrace_cluster_compute_share_ratio",
                                   f"Sum of own compute (compute less the wait in collectives) over sum of "
                                   f"interval, all reporting ranks, over the last {goodput_window_steps} joined "
                                   f"steps. Not goodput: no process start, no time outside steps.")
        self.last_step = gauge("steptrace_cluster_last_step", "Highest step number joined.")
        self.last_complete = gauge("steptrace_cluster_last_complete_step",
                                   "Highest step number joined with all ranks: the step the compute, interval, "
                                   "skew, straggler and bubble gauges describe.")
        self.joined = counter("steptrace_cluster_steps_joined", "Steps joined and written, complete or not.")
        self.incomplete = counter("steptrace_cluster_incomplete_steps",
                                  "Steps emitted without all ranks (window expired, evicted or shutdown).")
        self.join_lag = Histogram("steptrace_cluster_join_lag_seconds",
                                  "Time from a step's first span arriving to its joined record.", run,
                                  registry=reg, buckets=JOIN_LAG_BUCKETS_S)
        self.capture_requests = counter("steptrace_cluster_capture_requests",
                                        "Profiler captures asked of the run's ranks when its straggler verdict "
                                        "changed: issued (the culprit and a reference rank), fetched by the rank "
                                        "named, expired (never fetched: its capture is off, a newer verdict "
                                        "replaced it, or the run was dropped).", run + ("state",))
        self.received = counter("steptrace_collector_received_spans",
                                "Spans received (all kinds), by the run of the resource that sent them.")
        self.skipped = counter("steptrace_collector_skipped_spans",
                               "Spans received that the collector does not use (not train.step or train.stall*: "
                               "microbatch, compute, idle, user spans), counted in received_spans too; their "
                               "attributes are never decoded.", ())
        self.late = counter("steptrace_collector_late_spans",
                            "Step spans that arrived after their step was emitted (written as late records).")
        self.duplicates = counter("steptrace_collector_duplicate_spans",
                                  "Step spans of a rank already joined for that step (exporter retries), dropped.")
        self.conflicts = counter("steptrace_collector_conflicting_spans",
                                 "Step spans that differ from another span of the same run, step and rank "
                                 "(forged or confused senders); kept in conflicts.jsonl, neither joined.")
        self.evicted = counter("steptrace_collector_evicted_steps",
                               "Steps emitted early because too many steps were open at once.")
        self.invalid = counter("steptrace_collector_invalid_spans",
                               "train.step spans skipped for missing or unusable attributes.", ("reason",))
        self.rejected = counter("steptrace_collector_rejected_requests",
                                "Requests refused, by reason.", ("reason",))
        self.requests = counter("steptrace_collector_requests", "Export requests accepted.",
                                ("signal", "transport"))
        self.data_points = counter("steptrace_collector_received_metric_points",
                                   "Metric data points received (accepted and counted, not joined).", ())
        self.write_errors = counter("steptrace_collector_write_errors",
                                    "Records that could not be written to the run directory.", ())
        self.dropped_labels = counter("steptrace_collector_dropped_label_values",
                                      "Label values not exported because their bound was reached.", ("label",))
        self.dropped_labels.labels("stage")
        self.journal_skipped = counter("steptrace_collector_journal_skipped_lines",
                                       "Journal lines skipped at replay: torn, corrupt or not a span.", ())
        self.tracker_dropped = counter("steptrace_collector_tracker_dropped_records",
                                       "Joined steps a tracker (--trackers) did not get: its queue was full, it "
                                       "could not open the run's tracker, or a write failed.", ("tracker", "reason"))
        self.open = Gauge("steptrace_collector_open_steps", "Steps waiting for more ranks.", registry=reg)
        if open_steps is not None:
            self.open.set_function(open_steps)
        info = Gauge("steptrace_collector_info", "steptrace collector version.", ("version",), registry=reg)
        info.labels(__version__).set(1)
        # Series that exist from the start read as 0 rather than missing.
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        for reason in INVALID_SPAN_REASONS:
            self.invalid.labels(reason)
        for signal in ("traces", "metrics"):
            for transport in ("http", "grpc"):
                self.requests.labels(signal, transport)

    # -- collector events ----------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def request(self, signal: str, transport: str) -> None:
        self.requests.labels(signal, transport).inc()

    def spans_received(self, by_run: dict[str, int]) -> None:
        with self._lock:
            for run_id, count in by_run.items():
                if run_id:
                    self._touch(run_id)
                self.received.labels(run_id).inc(count)

    def invalid_spans(self, by_reason: dict[str, int]) -> None:
        for reason, count in by_reason.items():
            self.invalid.labels(reason).inc(count)

    def duplicate_spans(self, by_run: dict[str, int]) -> None:
        with self._lock:
            for run_id, count in by_run.items():
                self._touch(run_id)
                self.duplicates.labels(run_id).inc(count)

    def conflicting_spans(self, by_run: dict[str, int]) -> None:
        with self._lock:
            for run_id, count in by_run.items():
                self._touch(run_id)
                self.conflicts.labels(run_id).inc(count)

    def capture_requests_counted(self, run_id: str, state: str, n: int) -> None:
        """Capture requests of ``run_id`` that changed ``state`` (collector/_captures.py); a run no longer
        tracked (dropped past ``max_runs``) gets no series back."""
        with self._lock:
            if run_id in self._runs and state in _CAPTURE_STATES:
                self.capture_requests.labels(run_id, state).inc(n)

    def tracker_dropped_records(self, tracker: str, reason: str, count: int) -> None:
        """Joined steps a tracker did not get (called from the trackers' thread)."""
        self.tracker_dropped.labels(tracker, reason).inc(count)

    def publish(self, records: Iterable[dict[str, Any]], own: dict[int, dict[int, float]] | None = None) -> None:
        """Update the cluster series from emitted ``cluster_step`` and ``late`` records.

        ``own``: id(record) -> its ranks' time on their own, for records without ``rank_own_seconds``.
        """
        with self._lock:
            for record in records:
                run_id = record["run_id"]
                state = self._touch(run_id)
                if record["type"] == "late":
                    self.late.labels(run_id).inc()
                elif record["type"] == "cluster_step":
                    self._step(run_id, state, record, (own or {}).get(id(record)))

    def _step(self, run_id: str, state: _RunState, r: dict[str, Any], own: dict[int, float] | None) -> None:
        step = r["step"]
        self.joined.labels(run_id).inc()
        self.join_lag.labels(run_id).observe(r["join_seconds"])
        if not r["complete"]:
            self.incomplete.labels(run_id).inc()
        if r["reason"] == "evicted":
            self.evicted.labels(run_id).inc()
        state.window.add(r.get("own_compute_sum_seconds", r["compute_sum_seconds"]), r["interval_sum_seconds"])
        share = state.window.ratio()
        if share is not None:
            self.compute_share.labels(run_id).set(share)
        if step >= state.last_step:
            state.last_step = step
            self.last_step.labels(run_id).set(step)
            self.ranks_reporting.labels(run_id).set(r["ranks_reporting"])
            if r["world_size"] is not None:
                self.world_size.labels(run_id).set(r["world_size"])
        for rank, health in (r.get("rank_health") or {}).items():
            if isinstance(health, dict):
                steps = health.get("window_steps")
                weight = float(steps) if isinstance(steps, (int, float)) and steps >= 1 else 1.0
                throttled = window_throttled(health)
                state.health.setdefault(int(rank), collections.deque(maxlen=state.health_window)).append(
                    (weight, None if throttled is None else float(throttled), window_errors(health)))
        if not r["complete"]:
            return
        # A rank's straggler counters appear when it is first named (at their first value), never
        # one per rank ahead: collectors x ranks series. The rules count a series with no sample a
        # window ago from 0 (collector/alerts.yml, docs/alerts.md).
        named = r.get("straggler_rank")
        cost = r.get("straggler_cost_seconds")
        if named is not None:
            straggler = str(named)
            state.straggler_ranks.add(straggler)
            self.straggler_steps.labels(run_id, straggler).inc()
            cost_total = self.straggler_cost_total.labels(run_id, straggler)  # both appear together
            if cost is not None:
                cost_total.inc(cost)
            causes = r.get("straggler_causes")
            state.recent_causes.append((int(named), tuple(sorted(c for c in causes if c in HOST_CAUSES))
                                        if isinstance(causes, dict) else ()))
            if isinstance(causes, dict):
                for cause, seconds in causes.items():
                    if cause in HOST_CAUSES and isinstance(seconds, (int, float)) and seconds > 0:
                        state.cause_series.add((straggler, cause))  # at most ranks named x 3 causes
                        self.straggler_cause_total.labels(run_id, straggler, cause).inc(seconds)
        if own is None:
            own = {int(rank): seconds for rank, seconds in (r.get("rank_own_seconds") or {}).items()}
        state.scores.add(own)
        state.persistence.add(None if named is None else Straggler(
            named, r.get("straggler_excess_seconds") or 0.0, cost, r.get("straggler_threshold_seconds") or 0.0))
        self._persistent(run_id, state, step)
        # Only the lowest scores of each kind get a series (a bounded top-k, not one per rank); a
        # rank that leaves them loses its series.
        scores = state.scores.scores()
        shown: set[tuple[str, str]] = set()
        for index, kind in enumerate(("relative", "individual")):
            ranked = [(score[index], rank) for rank, score in scores.items() if score[index] is not None]
            for score, rank in heapq.nsmallest(self._score_ranks, ranked):
                shown.add((str(rank), kind))
                self.straggler_score.labels(run_id, str(rank), kind).set(score)
        for rank, kind in state.scored - shown:
            try:
                self.straggler_score.remove(run_id, rank, kind)
            except KeyError:
                pass
        state.scored = shown
        if step < state.last_complete:
            return
        state.last_complete = step
        self.last_complete.labels(run_id).set(step)
        for stat in _STATS:
            self.compute.labels(run_id, stat).set(r[f"compute_{stat}_seconds"])
            self.interval.labels(run_id, stat).set(r[f"interval_{stat}_seconds"])
            if r.get(f"own_{stat}_seconds") is not None:
                self.own.labels(run_id, stat).set(r[f"own_{stat}_seconds"])
            if r.get(f"collective_wait_{stat}_seconds") is not None:
                self.collective_wait.labels(run_id, stat).set(r[f"collective_wait_{stat}_seconds"])
            if r.get(f"exposed_communication_{stat}_seconds") is not None:
                self.exposed_communication.labels(run_id, stat).set(r[f"exposed_communication_{stat}_seconds"])
        self.skew.labels(run_id).set(r["skew_seconds"])
        self.straggler.labels(run_id).set(-1 if named is None else named)
        if r.get("straggler_threshold_seconds") is not None:
            self.straggler_threshold.labels(run_id).set(r["straggler_threshold_seconds"])
        self.straggler_cost.labels(run_id).set(cost or 0.0)
        # The last complete step's stages only, and at most MAX_STAGES_PER_RUN: a stage the
        # run no longer reports leaves the exposition (stage names once piled up without end).
        stages = dict(list(r["pipeline_bubble_ratio"].items())[:MAX_STAGES_PER_RUN])
        if len(r["pipeline_bubble_ratio"]) > len(stages):
            self.dropped_labels.labels("stage").inc(len(r["pipeline_bubble_ratio"]) - len(stages))
        for stage in state.stages - stages.keys():
            try:
                self.bubble.remove(run_id, stage)
            except KeyError:
                pass
        state.stages = set(stages)
        for stage, ratio in stages.items():
            self.bubble.labels(run_id, stage).set(ratio)

    def _persistent(self, run_id: str, state: _RunState, step: int) -> None:
        """The run's straggler series: the persistent rank's, no other (at most three series a run)."""
        found = state.persistence.persistent()
        rank = None if found is None else str(found.rank)
        if found is not None and rank != state.persistent and self.on_verdict is not None:
            means = state.scores.means()
            others = sorted((seconds, r) for r, seconds in means.items() if r != found.rank)
            reference = others[(len(others) - 1) // 2][1] if others else None
            cost = "" if found.cost_median_seconds is None else \
                f", median cost {found.cost_median_seconds * 1e3:.0f} ms"
            named = [causes for r, causes in state.recent_causes if r == found.rank]
            counts = collections.Counter(c for causes in named for c in causes)
            why = "" if not counts else ", host cause: " + ", ".join(
                f"{c} in {n} of {len(named)} steps it was named" for c, n in counts.most_common())
            self.on_verdict(run_id, found.rank, reference, step,
                            f"named in {found.share_of_steps * 100:.0f} % of its last {found.complete_steps} "
                            f"complete steps{cost}{why}")
        if state.persistent is not None and state.persistent != rank:
            for metric in (self.persistent_share, self.persistent_cost, self.persistent_own,
                           self.persistent_gpu_throttled, self.persistent_gpu_others_throttled,
                           self.persistent_gpu_errors):
                try:
                    metric.remove(run_id, state.persistent)
                except KeyError:
                    pass
        state.persistent = rank
        if found is None or rank is None:
            return
        self.persistent_share.labels(run_id, rank).set(found.share_of_steps)
        if found.cost_median_seconds is not None:
            self.persistent_cost.labels(run_id, rank).set(found.cost_median_seconds)
        means = state.scores.means()
        if found.rank in means:
            middle = statistics.median(means.values())
            if middle > 0:
                self.persistent_own.labels(run_id, rank).set(means[found.rank] / middle)
        self._persistent_gpu(run_id, state, found.rank)

    def _persistent_gpu(self, run_id: str, state: _RunState, straggler: int) -> None:
        """The run's straggler's GPU health beside the others' (only where its GPU is sampled)."""
        def share(windows: Iterable[tuple[float, float | None, int]]) -> float | None:
            known = [(weight, throttled) for weight, throttled, _ in windows if throttled is not None]
            total = sum(weight for weight, _ in known)
            return sum(weight * throttled for weight, throttled in known) / total if total else None

        windows = state.health.get(straggler)
        if not windows:
            return
        label = str(straggler)
        mine = share(windows)
        if mine is not None:
            self.persistent_gpu_throttled.labels(run_id, label).set(mine)
            others = [v for r, w in state.health.items() if r != straggler and (v := share(w)) is not None]
            self.persistent_gpu_others_throttled.labels(run_id, label).set(statistics.median(others) if others
                                                                            else 0.0)
        self.persistent_gpu_errors.labels(run_id, label).set(sum(errors for _, _, errors in windows))

    # -- the bound on runs ---------------------------------------------------------------------

    def _touch(self, run_id: str) -> _RunState:
        state = self._runs.get(run_id)
        if state is None:
            state = self._runs[run_id] = _RunState(self._window_steps, self._straggler_window_steps)
            # A run's counters exist from its first span, so rate() and increase() see them start at 0.
            for metric in (self.joined, self.incomplete, self.late, self.duplicates, self.evicted, self.received,
                           self.conflicts):
                metric.labels(run_id)
            for state_name in _CAPTURE_STATES:
                self.capture_requests.labels(run_id, state_name)
            while len(self._runs) > self._max_runs:
                old_id, old = self._runs.popitem(last=False)
                self._forget(old_id, old)
        else:
            self._runs.move_to_end(run_id)
        return state

    def _forget(self, run_id: str, state: _RunState) -> None:
        def remove(metric: Any, *labels: str) -> None:
            try:
                metric.remove(run_id, *labels)
            except KeyError:
                pass

        if state.persistent is not None:
            for metric in (self.persistent_share, self.persistent_cost, self.persistent_own,
                           self.persistent_gpu_throttled, self.persistent_gpu_others_throttled,
                           self.persistent_gpu_errors):
                remove(metric, state.persistent)
        for metric in (self.skew, self.straggler, self.straggler_cost, self.straggler_threshold,
                       self.ranks_reporting, self.world_size,
                       self.compute_share, self.last_step, self.last_complete, self.joined, self.incomplete,
                       self.join_lag, self.received, self.late, self.duplicates, self.evicted, self.conflicts):
            remove(metric)
        for state_name in _CAPTURE_STATES:
            remove(self.capture_requests, state_name)
        for stat in _STATS:
            remove(self.compute, stat)
            remove(self.interval, stat)
            remove(self.own, stat)
            remove(self.collective_wait, stat)
            remove(self.exposed_communication, stat)
        for stage in state.stages:
            remove(self.bubble, stage)
        for rank in state.straggler_ranks:
            remove(self.straggler_steps, rank)
            remove(self.straggler_cost_total, rank)
        for rank, cause in state.cause_series:
            remove(self.straggler_cause_total, rank, cause)
        for rank, kind in state.scored:
            remove(self.straggler_score, rank, kind)


class Exposition:
    """What ``/metrics`` serves: the registry without ``_created`` samples (they would double every counter)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterable[Any]:
        for family in self._registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


def served_registry(metrics: ClusterMetrics) -> CollectorRegistry:
    """The registry the metrics server serves."""
    served = CollectorRegistry()
    served.register(Exposition(metrics.registry))
    return served
