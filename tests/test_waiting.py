"""Waiting shown as waiting, and one goodput (issue 33, items 2 and 3).

In synchronous training the fast rank waits in the all-reduce for the slow one. That wait is the
timing model's compute on CPU (the host is the device), so it used to make the waiting rank look
more productive than the rank it waited for. Each rank's step now splits into its own compute, its
wait in collectives (exposed communication) and host idle by reason, adding up to the interval; goodput
counts only the own compute, and is one figure (productive / wall from the process start) in the
report, ``--json``, ``compare``, Prometheus, OTLP and the dashboards.

The unit tests run on synthetic records (hand-checkable numbers) and on a one-rank gloo group in
process; the integration test runs two gloo ranks under torchrun with rank 1 given 25 ms of extra
compute per step (tests/distributed_scripts/gloo_waiting.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from steptrace._attribution import HostSpan, collective_wait_placement, split_step
from steptrace.analysis.goodput import job_accounting, job_goodput
from steptrace.analysis.runs import load_run
from steptrace.analysis.summary import step_split, summarize

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0


# -- the split, on synthetic numbers -------------------------------------------------------------------


def test_the_wait_is_placed_where_it_fell_compute_or_an_idle_reason():
    # A step from 10.0 to 11.0: idle "other" 10.0-10.2 (between steps), "data" 10.5-10.6 (a span),
    # compute the rest (0.7 s). It waited 10.1-10.15 (a loss all-reduce between steps), 10.55-10.6
    # (inside the data span) and 10.8-10.95 (DDP's gradient all-reduce, inside its compute).
    segments = [HostSpan("other", 10.0, 10.2), HostSpan("data", 10.5, 10.6)]
    windows = [(10.8, 10.95), (10.1, 10.15), (10.55, 10.6)]
    in_compute, in_idle = collective_wait_placement(0.25, 0.7, windows, segments)
    assert in_idle == {"other": pytest.approx(0.05), "data": pytest.approx(0.05)}
    assert in_compute == pytest.approx(0.15)
    # Overlapping windows count once; a total the windows overshoot is scaled down, never above it.
    in_compute, in_idle = collective_wait_placement(0.04, 0.7, [(10.1, 10.15), (10.12, 10.15)], segments)
    assert in_idle == {"other": pytest.approx(0.04)} and in_compute == 0.0
    # No windows (a total only): in the compute as far as it holds it, the rest in the idle time,
    # `other` first.
    in_compute, in_idle = collective_wait_placement(0.95, 0.7, [], segments)
    assert in_compute == 0.7 and in_idle == {"other": pytest.approx(0.2), "data": pytest.approx(0.05)}


def test_own_compute_wait_and_idle_by_reason_add_up_to_the_interval():
    # The split of a record the SDK writes now: 0.9 s compute of which 0.3 s waiting; 0.05 s of
    # waiting in the idle "other" time.
    split = split_step(0.9, {"other": 0.08, "data": 0.02}, 0.35, 0.6, {"other": 0.05})
    assert split.own_compute_seconds == 0.6 and split.collective_wait_seconds == 0.35
    assert split.idle_breakdown == {"other": pytest.approx(0.03), "data": 0.02}
    assert math.fsum([split.own_compute_seconds, split.collective_wait_seconds,
                      *split.idle_breakdown.values()]) == pytest.approx(1.0, abs=1e-12)
    # A record written before the split existed (a total only): inside the compute first, the rest
    # from the idle time, "other" first.
    old = split_step(0.3, {"other": 0.5, "data": 0.2}, 0.45)
    assert old.own_compute_seconds == 0.0 and old.idle_breakdown == {"other": pytest.approx(0.35), "data": 0.2}
    assert math.fsum([old.own_compute_seconds, old.collective_wait_seconds, *old.idle_breakdown.values()]) \
        == pytest.approx(1.0, abs=1e-12)
    # Not measured: all its own.
    assert split_step(0.9, {"other": 0.1}) == (0.9, 0.0, {"other": 0.1})


# -- a real wait, in process -----------------------------------------------------------------------------


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo process group (the wrappers install themselves at the first step)."""
    torch = pytest.importorskip("torch", reason="needs torch (pip install 'steptrace[torch]')")
    dist = pytest.importorskip("torch.distributed", reason="needs torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("no torch.distributed, or a process group is already initialised")
    from steptrace.adapters import torch_distributed

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield torch, torch_distributed
    finally:
        torch_distributed.untrack_collectives()
        dist.destroy_process_group()


def test_a_steps_wait_splits_off_its_compute_and_its_idle_reasons_exactly(gloo_group):
    """A collective that waits 20 ms (a sleeping one, timed by the real wrapper) between steps, inside
    a data span and in the step's own work: each wait leaves the part of the step it fell in."""
    import steptrace
    from steptrace.testing import capture

    _, torch_distributed = gloo_group
    waits = torch_distributed._timed(lambda: time.sleep(0.02))  # the wrapper every collective gets
    with capture() as sink:
        with steptrace.step(0):  # installs the wrappers, and the run measures its waits
            pass
        waits()  # between steps: the next step's idle "other"
        with steptrace.step(1):
            with steptrace.span("data"):
                waits()
            waits()  # the step's own work: compute on CPU
            time.sleep(0.01)  # compute of its own
    step = sink.steps()[1]
    wait, own, in_idle = (step["collective_wait_seconds"], step["own_compute_seconds"],
                          step["collective_wait_idle_breakdown"])
    assert step["collective_wait_source"] == "torch.distributed"
    assert set(in_idle) == {"other", "data"} and in_idle["other"] >= 0.02 and in_idle["data"] >= 0.02
    assert step["compute_seconds"] - own >= 0.02 and own >= 0.01
    # The wait is what was placed: in the compute, and in each idle reason (no more than it holds).
    assert wait == pytest.approx(step["compute_seconds"] - own + sum(in_idle.values()), abs=1e-12)
    for reason, seconds in in_idle.items():
        assert seconds <= step["idle_breakdown"][reason] + 1e-12
    split = step_split(step)
    assert math.fsum([split.own_compute_seconds, split.collective_wait_seconds, *split.idle_breakdown.values()]) \
        == pytest.approx(step["interval_seconds"], abs=1e-9)
    assert split.idle_breakdown["data"] == pytest.approx(step["idle_breakdown"]["data"] - in_idle["data"])


# -- one goodput, everywhere -------------------------------------------------------------------------------

# Two ranks of a synchronous job, 4 steps of 1 s each, every rank's process started at T0, init() at T0 + 1
# and its first step at T0 + 2; the last step ends at T0 + 6 (a wall of 6 s per rank). Rank 1 is slow;
# rank 0 waits for it: 0.3 s in its compute and 0.05 s between steps (idle "other") per step.
RANK_STEPS = {
    0: {"compute": 0.9, "own_compute": 0.6, "wait": 0.35, "wait_idle": {"other": 0.05}},
    1: {"compute": 0.9, "own_compute": 0.88, "wait": 0.02, "wait_idle": {}},
}
STEPS = 4
WALL = 6.0
PRODUCTIVE = {rank: STEPS * t["own_compute"] for rank, t in RANK_STEPS.items()}  # 2.4 and 3.52
JOB_GOODPUT = sum(PRODUCTIVE.values()) / (2 * WALL)  # 49.3 %


def synthetic_records(rank: int) -> list[dict]:
    t = RANK_STEPS[rank]
    records: list[dict] = [{"type": "attempt", "run_id": "job", "rank": rank, "attempt": 0, "world_size": 2,
                            "start_time": T0, "init_time": T0 + 1.0, "attempt_source": "default", "pid": 1,
                            "hostname": "h"}]
    for n in range(STEPS):
        start = T0 + 2.0 + n
        record = {
            "type": "step", "run_id": "job", "rank": rank, "attempt": 0, "world_size": 2, "step": n,
            "trace_id": f"{n:032x}", "status": "ok", "backend": "host", "end_source": "host",
            "host_start_time": start, "host_end_time": start + 1.0, "dispatch_time": start,
            "start_time": start, "end_time": start + 1.0,
            "interval_seconds": 1.0, "compute_seconds": t["compute"], "idle_seconds": 0.1,
            "idle_breakdown": {"other": 0.1}, "idle_segments": [["other", start, start + 0.1]],
            "tokens": None, "samples": None, "flops": None, "attrs": {},
            "collective_wait_seconds": t["wait"], "own_seconds": 1.0 - t["wait"],
            "own_compute_seconds": t["own_compute"], "collective_wait_idle_breakdown": dict(t["wait_idle"]),
            "collective_wait_source": "ddp+torch.distributed",
        }
        if n == 0:
            record.update(before_step_seconds=1.0, before_step_breakdown={"startup": 1.0})
        records.append(record)
    records.append({"type": "run", "run_id": "job", "rank": rank, "attempt": 0, "world_size": 2, "steps": STEPS,
                    "dropped": {}, "background_cpu_seconds": {}})
    return records


@pytest.fixture
def synthetic_run(tmp_path):
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    for rank in RANK_STEPS:
        (run_dir / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(rank)))
    return run_dir


def test_the_job_goodput_is_own_compute_over_every_ranks_wall_from_the_process_start(synthetic_run):
    run = load_run(synthetic_run)
    job = job_goodput(run.records_by_rank)
    assert job["goodput"] == pytest.approx(JOB_GOODPUT)
    assert job["total_seconds"] == pytest.approx(2 * WALL) and job["productive_seconds"] == pytest.approx(5.92)
    # The rank that waits is not the more productive one.
    assert job["ranks"][0]["goodput"] == pytest.approx(2.4 / WALL)
    assert job["ranks"][0]["goodput"] < job["ranks"][1]["goodput"]
    # Every second in one place: the wait is its own bucket, start-up holds process start -> init().
    for accounting in (job, *job["ranks"].values()):
        assert accounting["productive_seconds"] + sum(accounting["badput"].values()) == pytest.approx(
            accounting["total_seconds"], abs=1e-9)
    assert job["ranks"][0]["badput"]["collective_wait"] == pytest.approx(STEPS * 0.35)
    assert job["ranks"][0]["badput"]["other"] == pytest.approx(STEPS * 0.05)
    assert job["ranks"][0]["badput"]["startup"] == pytest.approx(2.0)  # 1 s before init(), 1 s after
    # The step records' own view: own compute + wait + idle by reason = the intervals.
    summary = summarize(run.steps(0))
    assert summary["own_compute_seconds"] + summary["collective_wait_seconds"] + summary["idle_seconds"] \
        == pytest.approx(STEPS * 1.0)


def _report(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "steptrace", "report", *args], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_report_names_one_goodput_with_its_definition_and_shows_the_wait(synthetic_run):
    text = _report(str(synthetic_run))
    headline = f"{JOB_GOODPUT * 100:.1f}%"
    # One goodput, with its parts and its definition beside it; named once.
    (line,) = [line for line in text.splitlines() if line.startswith("Goodput")]
    assert line == f"Goodput {headline} = productive 5.920 s / wall 12.000 s"
    definition = " ".join(text[text.index(line) + len(line):].split())
    assert definition.startswith("productive = own compute of the kept steps (not time waiting for other ranks in "
                                 "collectives); wall = process start to last record, every attempt; both summed "
                                 "over 2 ranks")
    assert text.count(headline) == 1
    # The wall includes process start -> init(): 6 s, not the 5 s from init().
    assert re.search(r"wall\s+6\.000 s\s+process start → last record", text)
    # Each rank's own goodput and its wait, in the per-rank table; the waiting rank is below the slow one.
    table = text[text.index("Per-rank summary"):]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                          for line in table.splitlines() if line.startswith("│"))}
    assert rows["0"][2:5] == ["6.000", "40.0%", "1.400"] and rows["1"][2:5] == ["6.000", "58.7%", "0.080"]
    # The summary shows the wait as waiting, not as compute: 1.4 s of rank 0's 6 s wall.
    assert re.search(r"waiting in collectives\s+1\.400 s\s+23\.3% of wall", text)
    assert re.search(r"productive\s+2\.400 s\s+own compute of the kept steps", text)


def test_json_compare_prometheus_and_otlp_give_the_same_goodput(synthetic_run):
    payload = json.loads(_report(str(synthetic_run), "--json"))
    assert payload["goodput"] == pytest.approx(JOB_GOODPUT) == payload["job"]["goodput"]
    assert "wall = process start to last record" in payload["goodput_definition"]
    assert payload["per_rank"]["0"]["collective_wait_seconds"] == pytest.approx(STEPS * 0.35)
    assert payload["per_rank"]["1"]["collective_wait_seconds"] == pytest.approx(STEPS * 0.02)
    assert payload["per_rank"]["0"]["goodput"] == pytest.approx(0.4)
    assert payload["wall_seconds"] == pytest.approx(WALL) and payload["productive_seconds"] == pytest.approx(2.4)
    # Σ own compute / Σ interval is another ratio, under another name.
    assert payload["compute_share_of_steps"] == pytest.approx(2.4 / 4.0)

    from steptrace.analysis.compare import compare_runs

    rows = {row.metric: row for row in compare_runs(load_run(synthetic_run), load_run(synthetic_run))["rows"]}
    assert rows["goodput"].a == pytest.approx(JOB_GOODPUT) and "job_goodput" not in rows
    assert rows["collective_wait_mean"].a == pytest.approx(0.35)

    # Prometheus: each rank's productive / wall is its goodput; the job's is both summed over the ranks.
    pytest.importorskip("prometheus_client", reason="the Prometheus sink needs prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from steptrace.prometheus import PrometheusSink

    productive, wall = 0.0, 0.0
    for rank in RANK_STEPS:
        sink = PrometheusSink(0, run_id="job", rank=rank)
        try:
            sink.export(synthetic_records(rank))
            text = urllib.request.urlopen(sink.endpoint, timeout=5).read().decode()
        finally:
            sink.shutdown(5)
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if not s.labels.keys() - {"run_id", "rank"}}
        assert values["steptrace_productive_seconds_total"] / values["steptrace_wall_seconds_total"] == pytest.approx(
            PRODUCTIVE[rank] / WALL)
        assert values["steptrace_wall_seconds_total"] == pytest.approx(WALL)
        productive += values["steptrace_productive_seconds_total"]
        wall += values["steptrace_wall_seconds_total"]
        assert values["steptrace_step_collective_wait_seconds_total"] == pytest.approx(STEPS * RANK_STEPS[rank]["wait"])
        idle = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "steptrace_step_idle_seconds_total"}
        assert idle == {"other": pytest.approx(STEPS * (0.1 - RANK_STEPS[rank]["wait_idle"].get("other", 0.0)))}
    assert productive / wall == pytest.approx(JOB_GOODPUT)

    # OTLP: the same gauge and counters.
    pytest.importorskip("opentelemetry.sdk", reason="the OTLP exporter needs steptrace[otlp]")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from steptrace.otlp import _Metrics

    reader = InMemoryMetricReader()
    metrics = _Metrics(MeterProvider(metric_readers=[reader]), {"train.run_id": "job", "train.rank": 0})
    for record in synthetic_records(0):
        if record["type"] == "attempt":
            metrics.attempt(record)
        elif record["type"] == "step":
            metrics.record(record)
    points = {m.name: m.data.data_points[0].value for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics
              if len(m.data.data_points) == 1 and hasattr(m.data.data_points[0], "value")}
    assert points["steptrace.goodput_ratio"] == pytest.approx(0.4)
    assert points["steptrace.productive"] == pytest.approx(2.4) and points["steptrace.wall"] == pytest.approx(WALL)


def test_the_collector_and_the_dashboards_call_only_goodput_goodput():
    """The collector cannot see a process start: its ratio of the steps it joined is not goodput and is
    not named so; every dashboard panel that says goodput reads the goodput series."""
    pytest.importorskip("prometheus_client", reason="the collector's metrics need prometheus_client")
    from collector_helpers import request, step_span
    from prometheus_client import generate_latest

    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner
    from steptrace.collector._metrics import ClusterMetrics

    spans = [step_span(run_id="job", step=n, rank=rank, compute=t["compute"], interval=1.0, world_size=2,
                       **{"train.collective_wait_seconds": t["wait"], "train.own_compute_seconds": t["own_compute"]})
             for n in range(STEPS) for rank, t in RANK_STEPS.items()]
    records = Joiner(world_size=2).add(extract_steps(request(*spans)).steps).records
    assert [r["own_compute_sum_seconds"] for r in records] == [pytest.approx(0.6 + 0.88)] * STEPS
    assert records[-1]["collective_wait_max_seconds"] == pytest.approx(0.35)
    metrics = ClusterMetrics()
    metrics.publish(records)
    text = generate_latest(metrics.registry).decode()
    assert not [line for line in text.splitlines() if "goodput" in line and not line.startswith("#")]
    share = [line for line in text.splitlines() if line.startswith("steptrace_cluster_compute_share_ratio{")]
    assert len(share) == 1 and float(share[0].split()[-1]) == pytest.approx((0.6 + 0.88) / 2)
    assert 'steptrace_cluster_step_collective_wait_seconds{run_id="job",stat="median"}' in text

    import yaml

    groups = yaml.safe_load((REPO / "collector" / "rules.yml").read_text())["groups"]
    rules = {r.get("record"): r["expr"] for g in groups for r in g["rules"]}
    goodput_rule = rules["run_id:steptrace_goodput:ratio_rate5m"]
    assert "steptrace_productive_seconds_total" in goodput_rule and "steptrace_wall_seconds_total" in goodput_rule
    for name in ("steptrace-training.json", "steptrace-cluster.json"):
        dashboard = json.loads((REPO / "collector" / "dashboards" / name).read_text())
        for panel in [p for row in dashboard["panels"] for p in (row.get("panels") or [row])]:
            for target in panel.get("targets", []):
                if "goodput" in target.get("legendFormat", "").lower() or (
                        "goodput" in panel["title"].lower() and len(panel.get("targets", [])) == 1):
                    assert "steptrace_goodput:ratio_rate5m" in target["expr"] or (
                        "steptrace_productive_seconds_total" in target["expr"]
                        and "steptrace_wall_seconds_total" in target["expr"]), (panel["title"], target)
                assert "cluster_goodput" not in target["expr"]


# -- two gloo ranks under torchrun, one slowed ---------------------------------------------------------------

DELAY_S = 0.025
WARMUP = 5


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    pytest.importorskip("torch", reason="needs torch (pip install 'steptrace[torch]')")
    run_dir = tmp_path_factory.mktemp("torchrun")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "tests" / "distributed_scripts" / "gloo_waiting.py"), str(run_dir),
                          "--steps", "30", "--delay-s", str(DELAY_S), "--slow-rank", "1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return run_dir / "waiting"


def test_under_torchrun_the_waiting_rank_waits_the_injected_time_and_is_not_more_productive(torchrun_run):
    run = load_run(torchrun_run)
    assert run.ranks == [0, 1]
    steady = {rank: [s for s in run.steps(rank) if s["step"] >= WARMUP] for rank in run.ranks}
    wait = {rank: statistics.median(s["collective_wait_seconds"] for s in steps) for rank, steps in steady.items()}
    # Rank 0 waits for rank 1's extra 25 ms in every step. Rank 1 waits only for the collectives'
    # own duration, which every rank pays (a few ms of gloo on loopback, more on a loaded machine).
    extra = statistics.median(a["collective_wait_seconds"] - b["collective_wait_seconds"]
                              for a, b in zip(steady[0], steady[1]))
    assert extra == pytest.approx(DELAY_S, rel=0.4), wait
    assert wait[1] < 0.5 * DELAY_S < wait[0], wait
    # The wait is not rank 0's compute: its own compute is its own work, rank 1's that plus 25 ms.
    own = {rank: statistics.median(s["own_compute_seconds"] for s in steps) for rank, steps in steady.items()}
    assert own[1] - own[0] == pytest.approx(DELAY_S, rel=0.4), own
    for rank in run.ranks:
        for step in run.steps(rank):
            split = step_split(step)
            assert math.fsum([split.own_compute_seconds, split.collective_wait_seconds,
                              *split.idle_breakdown.values()]) == pytest.approx(step["interval_seconds"], abs=1e-9)
    job = job_goodput(run.records_by_rank)
    assert job["ranks"][0]["goodput"] <= job["ranks"][1]["goodput"], job["ranks"]
    # As a user reads it: one goodput line, the wait in the per-rank table and in rank 0's summary.
    text = _report(str(torchrun_run))
    assert len([line for line in text.splitlines() if "goodput" in line.lower() and "%" in line
                and not line.startswith("│")]) == 1, text
    assert "waiting in collectives" in text and "wait s" in text
    payload = json.loads(_report(str(torchrun_run), "--json"))
    assert payload["goodput"] == pytest.approx(job["goodput"])
    assert payload["per_rank"]["0"]["collective_wait_seconds"] > payload["per_rank"]["1"]["collective_wait_seconds"]
    assert job_accounting(run.records_by_rank[0])["goodput"] == pytest.approx(payload["per_rank"]["0"]["goodput"])
