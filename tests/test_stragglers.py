"""Who slowed a synchronous job (issue 20): the rule that names the straggler by its time on its own,
its cost to the job, the noise threshold and the per-rank scores (steptrace._attribution), and the
same rule where each part applies it: the step record, the collector's join and metrics, the rank's
/metrics and ``steptrace report``. The real-process checks on gloo are in test_torch_distributed.py."""

from __future__ import annotations

import json

import pytest

import steptrace
from steptrace._attribution import (
    STRAGGLER_MIN_RATIO,
    STRAGGLER_MIN_SECONDS,
    StragglerScores,
    find_straggler,
    own_seconds,
    straggler_threshold,
)
from steptrace._schema import RecordBuilder
from steptrace.analysis.stragglers import straggler_sentence, straggler_steps, summarize_stragglers
from steptrace.testing import capture

# -- the rule ----------------------------------------------------------------------------------------


def test_the_straggler_is_the_rank_with_most_time_on_its_own_not_the_largest_compute():
    # Synchronous step: every rank's compute is ~66 ms; rank 2 arrived 30 ms late and barely waited.
    ranks = {0: (0.066 - 0.035, 0.035), 1: (0.0665 - 0.036, 0.036), 2: (0.0655 - 0.004, 0.004),
             3: (0.066 - 0.034, 0.034)}
    found = find_straggler(ranks, step_seconds=0.066)
    assert found is not None and found.rank == 2
    # Its cost: the others' median wait (35 ms) less its own wait (4 ms, what every rank pays).
    assert found.cost_seconds == pytest.approx(0.031)
    assert found.excess_seconds == pytest.approx(0.0615 - 0.031)
    assert found.threshold_seconds == pytest.approx(max(STRAGGLER_MIN_SECONDS, STRAGGLER_MIN_RATIO * 0.066))


def test_a_step_where_no_rank_stands_out_names_no_straggler():
    # 3 ms of noise on a 40 ms step: below 5 ms and below a fifth of the step.
    ranks = {0: (0.025, 0.010), 1: (0.028, 0.007), 2: (0.026, 0.009), 3: (0.025, 0.010)}
    assert find_straggler(ranks, step_seconds=0.040) is None
    # The same excess on a 10 ms step is more than a fifth of it, but not 5 ms: still noise.
    assert find_straggler(ranks, step_seconds=0.010) is None
    # 12 ms more than the others on a 40 ms step stands out.
    ranks[1] = (0.037, 0.0)
    assert find_straggler(ranks, step_seconds=0.040).rank == 1


def test_threshold_is_the_larger_of_the_floor_and_the_share_of_the_step():
    assert straggler_threshold(0.010) == STRAGGLER_MIN_SECONDS
    assert straggler_threshold(1.0) == pytest.approx(STRAGGLER_MIN_RATIO)
    assert straggler_threshold(1.0, min_seconds=0.0, min_ratio=0.05) == pytest.approx(0.05)


def test_without_measured_waits_the_rank_with_most_compute_is_named_and_its_cost_is_unknown():
    found = find_straggler({0: (0.1, None), 1: (0.4, None), 2: (0.1, None)}, step_seconds=0.5)
    assert found is not None and found.rank == 1 and found.cost_seconds is None
    # A rank that did measure, among ones that did not: still unknown.
    assert find_straggler({0: (0.1, 0.0), 1: (0.4, 0.0), 2: (0.1, None)}, 0.5).cost_seconds is None


def test_the_threshold_scales_with_the_interval_where_waits_are_measured_else_with_compute():
    from steptrace._attribution import straggler_step_seconds

    assert straggler_step_seconds(0.25, 0.02, measured=True) == 0.25
    # A job idle between steps (0.25 s intervals, 20 ms of compute): a device 3x slower than the
    # others (40 ms more) is no fifth of the interval, but it is of the compute it is compared on.
    assert straggler_step_seconds(0.25, 0.02, measured=False) == 0.02
    ranks = {0: (0.02, None), 1: (0.02, None), 2: (0.06, None)}
    assert find_straggler(ranks, straggler_step_seconds(0.25, 0.02, measured=False)).rank == 2
    assert find_straggler(ranks, 0.25) is None


def test_ties_go_to_the_lowest_rank_and_one_rank_is_never_a_straggler():
    assert find_straggler({3: (0.5, 0.0), 1: (0.5, 0.0), 0: (0.1, 0.4)}, 0.5).rank == 1
    assert find_straggler({0: (0.5, 0.0)}, 0.5) is None


def test_own_seconds_is_the_step_less_its_wait_and_never_negative():
    assert own_seconds(0.05, 0.02) == pytest.approx(0.03)
    assert own_seconds(0.05, None) == 0.05
    assert own_seconds(0.05, 0.09) == 0.0


def test_scores_relative_to_the_median_rank_and_to_the_ranks_own_best():
    scores = StragglerScores(2)
    scores.add({0: 0.10, 1: 0.10, 2: 0.20})
    scores.add({0: 0.10, 1: 0.10, 2: 0.20})
    relative, individual = scores.scores()[2]
    assert relative == pytest.approx(0.5) and individual == pytest.approx(1.0)
    # Rank 1 slows down to 0.3 s for two steps: half as fast as its best window, a third of the median.
    scores.add({0: 0.10, 1: 0.30, 2: 0.20})
    scores.add({0: 0.10, 1: 0.30, 2: 0.20})
    got = scores.scores()
    assert got[1] == (pytest.approx(0.2 / 0.3), pytest.approx(0.1 / 0.3))
    assert got[0] == (pytest.approx(2.0), pytest.approx(1.0))
    with pytest.raises(ValueError):
        StragglerScores(0)


# -- the step record ------------------------------------------------------------------------------------


class _Timing:
    start, end, interval_seconds, compute_seconds, idle_seconds = 1.0, 1.05, 0.06, 0.05, 0.01


def _step(builder: RecordBuilder, **kw):
    return builder.step(step=0, status="ok", error=None, backend="host", end_source="host", host_start=1.0,
                        host_end=1.05, dispatch=1.0, timing=_Timing, segments=[], breakdown={}, tokens=None,
                        samples=None, flops=None, attrs={}, bubble=None, **kw)


def test_step_record_carries_wait_own_and_source_only_where_the_wait_is_measured():
    builder = RecordBuilder(run_id="r", rank=0, world_size=2, peak_tflops=None, unix_offset=0.0)
    plain = _step(builder)
    assert "collective_wait_seconds" not in plain and "own_seconds" not in plain
    record = _step(builder, collective_wait=0.02, collective_source="ddp")
    assert record["collective_wait_seconds"] == pytest.approx(0.02)
    assert record["own_seconds"] == pytest.approx(0.06 - 0.02)  # the interval less the wait
    assert record["collective_wait_source"] == "ddp"
    # Measured but no collective in this step: 0, not absent.
    assert _step(builder, collective_source="torch.distributed")["collective_wait_seconds"] == 0.0
    # A wait longer than the step's interval cannot be: capped at what the step holds, its compute and
    # its idle time (waiting shown as waiting: test_waiting.py).
    from steptrace._attribution import HostSpan

    capped = builder.step(step=0, status="ok", error=None, backend="host", end_source="host", host_start=1.0,
                          host_end=1.05, dispatch=1.0, timing=_Timing, segments=[HostSpan("other", 0.99, 1.0)],
                          breakdown={"other": 0.01}, tokens=None, samples=None, flops=None, attrs={}, bubble=None,
                          collective_wait=0.2, collective_source="torch.distributed")
    assert capped["collective_wait_seconds"] == pytest.approx(0.06) and capped["own_seconds"] == 0.0
    assert capped["own_compute_seconds"] == 0.0 and capped["collective_wait_idle_breakdown"] == {
        "other": pytest.approx(0.01)}


def test_a_step_handle_waits_reach_the_record_through_the_resolver():
    with capture() as sink:
        for n in range(2):
            with steptrace.step(n) as s:
                if n == 1:
                    # What steptrace.adapters.torch_distributed does for a collective on this step.
                    s.collective_wait += 0.0
                    s.collective_source = "torch.distributed"
    first, second = sink.steps()
    assert "collective_wait_seconds" not in first
    assert second["collective_wait_source"] == "torch.distributed"
    assert second["own_seconds"] == pytest.approx(second["interval_seconds"])


# -- the report -----------------------------------------------------------------------------------------


def _rank_records(steps: int, slow_rank: int | None, delay: float = 0.03) -> dict[int, list[dict]]:
    records: dict[int, list[dict]] = {}
    for rank in range(4):
        for n in range(steps):
            slow = rank == slow_rank
            wait = 0.005 if slow or slow_rank is None else 0.005 + delay
            compute = 0.045 + (delay if slow_rank is not None else 0.0)
            records.setdefault(rank, []).append({
                "type": "step", "run_id": "r", "rank": rank, "world_size": 4, "step": n, "status": "ok",
                "compute_seconds": compute, "interval_seconds": compute + 0.001,
                "collective_wait_seconds": wait, "own_seconds": compute + 0.001 - wait,
                "collective_wait_source": "ddp"})
    return records


def test_report_joins_rank_files_and_says_who_cost_the_job_how_much_in_one_line():
    steps = straggler_steps(_rank_records(20, slow_rank=2))
    assert len(steps) == 20 and {s["straggler_rank"] for s in steps} == {2}
    summary = summarize_stragglers(steps)
    assert summary["top"] == "2" and summary["ranks"]["2"]["cost_median_seconds"] == pytest.approx(0.03)
    # 30 ms of a 76 ms step.
    assert straggler_sentence(summary) == "rank 2 cost the job 30 ms per step, 39 % of its step time " \
                                          "(named in 100 % of 20 steps)"
    quiet = summarize_stragglers(straggler_steps(_rank_records(20, slow_rank=None)))
    assert quiet["top"] is None and straggler_sentence(quiet) == "no rank stood out in 20 steps joined across ranks"


def test_report_skips_steps_a_rank_is_missing_or_failed():
    records = _rank_records(3, slow_rank=2)
    records[1] = records[1][:2]
    records[3][0]["status"] = "error"
    assert [s["step"] for s in straggler_steps(records)] == [1]


def test_steptrace_report_prints_the_straggler_line_and_json(tmp_path, capsys):
    from steptrace.analysis.report import main

    run = tmp_path / "r"
    run.mkdir()
    for rank, records in _rank_records(10, slow_rank=2).items():
        (run / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(run)]) == 0
    assert "rank 2 cost the job 30 ms per step" in capsys.readouterr().out.replace("\n", " ")
    assert main([str(run), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["stragglers"]["top"] == "2"
    assert payload["stragglers"]["sentence"].startswith("rank 2 cost the job 30 ms per step")


# -- the collector ----------------------------------------------------------------------------------------


def test_collector_joins_own_time_names_the_straggler_and_its_cost():
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    from collector_helpers import request, step_span
    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner

    joiner = Joiner(world_size=4, per_rank=True)
    spans = []
    for rank in range(4):
        wait = 0.004 if rank == 2 else 0.034
        spans.append(step_span(step=7, rank=rank, compute=0.066, interval=0.067, world_size=4,
                               **{"train.collective_wait_seconds": wait, "train.own_seconds": 0.066 - wait}))
    extracted = extract_steps(request(*spans))
    # The interval (67 ms) less the wait.
    assert [s.own_seconds for s in extracted.steps] == pytest.approx([0.033, 0.033, 0.063, 0.033])
    (record,) = joiner.add(extracted.steps).records
    assert record["straggler_rank"] == 2
    assert record["straggler_cost_seconds"] == pytest.approx(0.030)
    assert record["skew_seconds"] == 0.0  # what the old rule saw: nothing
    assert record["rank_collective_wait_seconds"]["2"] == pytest.approx(0.004)
    assert record["own_max_seconds"] == pytest.approx(0.063)
    assert record["straggler_threshold_seconds"] == pytest.approx(0.2 * 0.067)

    # Equal compute and no measured waits: no rank stands out.
    (quiet,) = Joiner(world_size=2).add(extract_steps(request(
        step_span(step=1, rank=0, compute=0.066, interval=0.067, world_size=2),
        step_span(step=1, rank=1, compute=0.0665, interval=0.067, world_size=2))).steps).records
    assert quiet["straggler_rank"] is None and quiet["straggler_cost_seconds"] is None


def test_a_sender_cannot_claim_more_wait_than_compute():
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    from collector_helpers import request, step_span
    from steptrace.collector._decode import extract_steps

    (span,) = extract_steps(request(step_span(compute=0.05, interval=0.2, **{"train.collective_wait_seconds": 9.0,
                                                                             "train.own_seconds": 7.0}))).steps
    assert span.collective_wait_seconds == 0.2 and span.own_seconds == 0.0


def test_cluster_metrics_publish_cost_own_time_and_scores():
    pytest.importorskip("prometheus_client", reason="the collector needs steptrace[prometheus]")
    from prometheus_client import generate_latest

    from collector_helpers import value
    from steptrace.collector._join import cluster_record
    from steptrace.collector._decode import StepSpan
    from steptrace.collector._metrics import ClusterMetrics

    metrics = ClusterMetrics(straggler_window_steps=4)
    for step in range(3):
        spans = [StepSpan(run_id="r", step=step, rank=rank, world_size=3, trace_id="", compute_seconds=0.066,
                          interval_seconds=0.067, collective_wait_seconds=wait,
                          own_seconds=own_seconds(0.067, wait))
                 for rank, wait in ((0, 0.034), (1, 0.035), (2, 0.004))]
        metrics.publish([cluster_record("r", step, "", 3, spans, reason="all_ranks", first_seen_time=0.0,
                                        joined_time=0.0, join_seconds=0.0)])
    text = generate_latest(metrics.registry).decode()
    run = {"run_id": "r"}
    assert value(text, "steptrace_cluster_straggler_rank", **run) == 2
    assert value(text, "steptrace_cluster_step_straggler_cost_seconds", **run) == pytest.approx(0.0305)
    assert value(text, "steptrace_cluster_straggler_cost_seconds_total", rank="2", **run) == pytest.approx(3 * 0.0305)
    assert value(text, "steptrace_cluster_straggler_cost_seconds_total", rank="0", **run) is None  # never named
    assert value(text, "steptrace_cluster_straggler_steps_total", rank="0", **run) is None
    assert value(text, "steptrace_cluster_step_own_seconds", stat="max", **run) == pytest.approx(0.063)
    assert value(text, "steptrace_cluster_straggler_score", rank="2", kind="relative", **run) == \
        pytest.approx(0.033 / 0.063)  # the median rank (of 0.033, 0.032, 0.063) over rank 2
    assert value(text, "steptrace_cluster_straggler_score", rank="0", kind="individual", **run) == pytest.approx(1.0)
    # A later step where no rank stands out: the gauge says so (-1) and the cost is 0.
    quiet = [StepSpan(run_id="r", step=3, rank=rank, world_size=3, trace_id="", compute_seconds=0.066,
                      interval_seconds=0.067, collective_wait_seconds=0.01, own_seconds=0.056) for rank in range(3)]
    metrics.publish([cluster_record("r", 3, "", 3, quiet, reason="all_ranks", first_seen_time=0.0, joined_time=0.0,
                                    join_seconds=0.0)])
    text = generate_latest(metrics.registry).decode()
    assert value(text, "steptrace_cluster_straggler_rank", **run) == -1
    assert value(text, "steptrace_cluster_step_straggler_cost_seconds", **run) == 0


# -- each rank's /metrics ---------------------------------------------------------------------------------


def test_rank_metrics_count_wait_and_own_seconds():
    pytest.importorskip("prometheus_client", reason="needs steptrace[prometheus]")
    from prometheus_client import generate_latest

    from collector_helpers import value
    from steptrace.prometheus import PrometheusSink

    sink = PrometheusSink(0, run_id="r", rank=1)
    try:
        base = {"type": "step", "run_id": "r", "rank": 1, "step": 0, "status": "ok", "interval_seconds": 0.07,
                "compute_seconds": 0.066, "collective_wait_seconds": 0.03, "own_seconds": 0.036}
        sink.export([base, {**base, "step": 1}, {**base, "step": 2, "collective_wait_seconds": None,
                                                 "own_seconds": None}])
        text = generate_latest(sink._metrics).decode()
        labels = {"run_id": "r", "rank": "1"}
        assert value(text, "steptrace_step_collective_wait_seconds_total", **labels) == pytest.approx(0.06)
        assert value(text, "steptrace_step_own_seconds_total", **labels) == pytest.approx(0.072)
    finally:
        sink.shutdown(1)


def test_cluster_metrics_expose_the_lowest_scores_only():
    """Score series for the k lowest scores of each kind, not one per rank (k = --straggler-score-ranks)."""
    pytest.importorskip("prometheus_client", reason="the collector needs steptrace[prometheus]")
    from prometheus_client import generate_latest

    from collector_helpers import samples
    from steptrace.collector._decode import StepSpan
    from steptrace.collector._join import cluster_record
    from steptrace.collector._metrics import ClusterMetrics

    metrics = ClusterMetrics(straggler_window_steps=4, straggler_score_ranks=3)

    def publish(step: int, slow: dict[int, float]) -> dict[str, set[str]]:
        spans = [StepSpan(run_id="r", step=step, rank=rank, world_size=30, trace_id="", compute_seconds=0.05,
                          interval_seconds=0.1 + slow.get(rank, 0.0), collective_wait_seconds=0.01,
                          own_seconds=own_seconds(0.1 + slow.get(rank, 0.0), 0.01)) for rank in range(30)]
        metrics.publish([cluster_record("r", step, "", 30, spans, reason="all_ranks", first_seen_time=0.0,
                                        joined_time=0.0, join_seconds=0.0)])
        shown: dict[str, set[str]] = {}
        for (name, labels), _ in samples(generate_latest(metrics.registry).decode()).items():
            if name == "steptrace_cluster_straggler_score":
                labels = dict(labels)
                shown.setdefault(labels["kind"], set()).add(labels["rank"])
        return shown

    shown = publish(0, {7: 0.05, 11: 0.04, 20: 0.03, 3: 0.02})
    assert shown["relative"] == {"7", "11", "20"} and len(shown["individual"]) == 3
    for step in range(1, 5):  # rank 7 recovers, rank 3 stays slow: 7 leaves the relative top 3
        shown = publish(step, {11: 0.04, 20: 0.03, 3: 0.02})
    assert shown["relative"] == {"11", "20", "3"}
