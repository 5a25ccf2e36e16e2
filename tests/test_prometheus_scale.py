"""bench/prometheus_scale.py's code path at 256 ranks: a real Prometheus, the shipped rules and alerts,
every dashboard query (issue 28, "a Prometheus budget").

256 synthetic ranks serve what a real pipeline rank serves (captured from a real /metrics), and a
real collector's series; Prometheus scrapes and evaluates every second (the shipped 15 s / 30 s
would make the test wait minutes; the bench uses them). Asserted: every rule group evaluates, with
no failed rule; every dashboard query, as Grafana sends it with the variables at their defaults,
succeeds within the default --query.max-samples, returns data where the synthetic job has it, and
names at most top-k + bottom-k + the pinned ranks: a query with one series per rank would name
256. The 1,024 and 4,096-rank figures are the bench's (bench/RESULTS.md); no timing is asserted.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RANKS = 256


def bench_module():
    spec = importlib.util.spec_from_file_location("prometheus_scale", ROOT / "bench" / "prometheus_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured():
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` server binary is not installed (Debian package `prometheus`; "
                    ".ci/run installs it)")
    bench = bench_module()
    template = bench.RankTemplate(bench.capture("pipeline"))
    result = bench.measure("pipeline", RANKS, template, dashboards=ROOT / "collector" / "dashboards",
                           evaluations=2, scrape="1s", evaluation="1s", rule_interval="1s", binary=binary,
                           log=lambda *a: None)
    return bench, template, result


def test_every_rank_is_scraped_with_what_a_real_rank_serves(measured):
    _, template, result = measured
    assert result["series_per_rank"] == template.series
    assert template.series <= 60   # the pipeline rank's budget (tests/test_prometheus.py)
    assert result["series_total"] >= RANKS * template.series


def test_every_rule_group_evaluates_without_failures(measured):
    _, _, result = measured
    groups = result["groups"]
    assert {"steptrace-steps", "steptrace-microbatches"} <= set(groups), groups
    for name, group in groups.items():
        assert group["evaluations"] >= 3, (name, group)
        assert group.get("failures", 0) == 0, (name, group)


def test_every_dashboard_query_stays_under_max_samples_and_names_few_ranks(measured):
    bench, _, result = measured
    queries = result["queries"]
    assert len(queries) > 50, len(queries)
    failed = [(q["panel"], q["ref"], q["error"]) for q in queries if q["status"] != "success"]
    assert not failed, failed
    assert all(q["peak"] <= bench.MAX_SAMPLES for q in queries), [
        (q["panel"], q["ref"], q["peak"]) for q in queries if q["peak"] > bench.MAX_SAMPLES]
    # One series per rank would name all 256; top-k + bottom-k + the pinned rank name at most 11.
    wide = [(q["panel"], q["ref"], q["ranks"]) for q in queries if q["ranks"] > bench.MAX_RANKS_PER_QUERY]
    assert not wide, wide
    # Data flowed through the rules to the panels: empty are only the panels of what went wrong
    # (drops, failed steps, rejected requests), which the synthetic job never does.
    # The pinned rank's straggler scores (target B) may be empty too: the collector serves score
    # series for the 10 lowest scores of each kind only, which rank 0 of an even job need not be.
    # The ranks' capture panels are empty too: the captured rank runs with deep capture off (the
    # default), which serves no steptrace_captures_total series (docs/capture.md).
    empty = {(q["panel"], q["ref"]) for q in queries if q["series"] == 0}
    went_wrong = {("Dropped records", "A"), ("Failed steps by rank", "A"), ("Rejected requests by reason", "A")}
    pinned_scores = {("Straggler score per rank, relative", "B"), ("Straggler score per rank, individual", "B")}
    capture_off = {("Profiler captures by rank, time range", "A"), ("Profiler captures over time", "A")}
    # And the GPU health panels: the synthetic job samples no GPU health (health="nvml" is off by
    # default); tests/test_dashboards.py fills them with health windows against a live Prometheus.
    health_off = {(q["panel"], q["ref"]) for q in queries if q["panel"].startswith("GPU ")}
    assert health_off, "the training dashboard has GPU health panels"
    # And exposed communication: only NCCL collectives timed on the GPU carry it; the captured rank
    # runs on CPU (tests/test_dashboards.py's synthetic ranks fill it against a live Prometheus).
    no_nccl = {("Exposed communication per rank (5m)", ref) for ref in "ABC"}
    assert went_wrong <= empty <= went_wrong | pinned_scores | capture_off | health_off | no_nccl, empty
