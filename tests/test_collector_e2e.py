"""The collector end to end: a collector process and three rank processes exporting through steptrace's own
OTLP exporter, one rank slower; then the same with the collector killed and restarted mid-run.

The ranks step in lockstep like synchronous data-parallel training (every rank
starts step ``n`` at ``t0 + n * period``, as a collective would make them) and
differ only in device compute per step (``SimulatedDevice``): rank 2 computes
30 ms, the others 10 ms, so rank 2 is the straggler and the skew is ~20 ms.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="the ranks export with opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")
pytest.importorskip("prometheus_client", reason="the collector needs prometheus_client")

from collector_helpers import read_records, scrape, value, wait_for  # noqa: E402
from collector_process import CollectorProcess  # noqa: E402

pytestmark = pytest.mark.integration

RUN_ID = "e2e"
WORLD = 3
COMPUTE_S = (0.01, 0.01, 0.03)
PERIOD_S = 0.05

RANK_SCRIPT = r'''
import json, os, sys, time
import steptrace
from steptrace.testing import SimulatedDevice

rank, endpoint, run_dir, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
compute, period, max_steps = float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
steptrace.init(run_id="e2e", rank=rank, world_size=3, otlp_endpoint=endpoint, otlp_timeout_s=0.5,
               otlp_metrics_interval_s=1, jsonl=True, run_dir=run_dir)
device = SimulatedDevice()
open(os.path.join(workdir, f"ready-{rank}"), "w").close()
go = os.path.join(workdir, "go")
while not os.path.exists(go):
    time.sleep(0.01)
time.sleep(0.01)
t0 = float(open(go).read())
stop = os.path.join(workdir, "stop")
n = 0
while n < max_steps and not os.path.exists(stop):
    wait = t0 + n * period - time.time()
    if wait > 0:
        time.sleep(wait)
    with steptrace.step(n) as s:
        s.wait_for(device.run(compute))
    n += 1
steptrace.shutdown(timeout_s=5)
device.close()
print(json.dumps({"rank": rank, "steps": n, "dropped": steptrace.stats().get("dropped", {})}))
'''


def start_ranks(tmp_path: Path, endpoint: str, run_dir: Path, max_steps: int) -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), endpoint, str(run_dir), str(tmp_path),
                               str(COMPUTE_S[rank]), str(PERIOD_S), str(max_steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    # Start together once all are initialised: imports take a while on a loaded machine.
    ready = wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(WORLD))
                     or any(p.poll() is not None for p in procs), 60, 0.05)
    if not ready or any(p.poll() is not None for p in procs):
        for p in procs:
            p.kill()
        raise AssertionError("ranks did not start: " + " | ".join(p.stderr.read() for p in procs))
    (tmp_path / "go.tmp").write_text(repr(time.time() + 0.2))
    os.replace(tmp_path / "go.tmp", tmp_path / "go")
    return procs


def finish_ranks(procs: list[subprocess.Popen], *, collector_down: bool = False) -> list[dict]:
    """Each rank's summary line; every rank must have exited 0 after its whole loop."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        if not collector_down:
            assert "Traceback" not in stderr and "Failed to export" not in stderr, stderr
        # With the collector down, the SDK logs failed exports and steptrace logs the first failed
        # batch (with its traceback) before counting drops: logged, not raised.
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def rank_records(run_dir: Path, rank: int, kind: str) -> list[dict]:
    return [r for r in read_records(run_dir / RUN_ID / f"rank-{rank}.jsonl") if r.get("type") == kind]


def cluster_steps(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir / RUN_ID / "cluster.jsonl") if r.get("type") == "cluster_step"]


def test_ranks_through_steptrace_exporter_are_joined_and_the_slow_rank_is_the_straggler(tmp_path):
    run_dir = tmp_path / "runs"
    collector = CollectorProcess(run_dir, WORLD, extra=("--cluster-per-rank",))
    try:
        steps = 20
        ranks = start_ranks(tmp_path, f"http://127.0.0.1:{collector.port}", run_dir, steps)
        results = finish_ranks(ranks)
        assert [r["steps"] for r in results] == [steps] * WORLD
        assert all(not any(k.startswith("sink:") for k in r["dropped"]) for r in results), results
        assert wait_for(lambda: len(cluster_steps(run_dir)) == steps, 10)
        text = scrape(collector.metrics_url)
    finally:
        assert collector.stop() == 0

    records = cluster_steps(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    assert all(r["complete"] and r["ranks_reporting"] == WORLD and r["missing_ranks"] == [] for r in records)
    assert all(r["reason"] == "all_ranks" for r in records)
    # The joined values are the ranks' own: compute and interval per rank, exactly as in their JSONL.
    for rank in range(WORLD):
        own = {r["step"]: r for r in rank_records(run_dir, rank, "step")}
        for record in records:
            assert record["rank_compute_seconds"][str(rank)] == own[record["step"]]["compute_seconds"]
            assert record["rank_interval_seconds"][str(rank)] == own[record["step"]]["interval_seconds"]
            assert record["trace_id"] == own[record["step"]]["trace_id"]
    stragglers = [r["straggler_rank"] for r in records]
    assert stragglers == [2] * steps, stragglers
    skews = sorted(r["skew_seconds"] for r in records)
    assert 0.01 < skews[len(skews) // 2] < 0.03  # 30 ms - 10 ms, give or take the simulated device's sleeps

    run = {"run_id": RUN_ID}
    assert value(text, "steptrace_cluster_straggler_rank", **run) == 2
    assert value(text, "steptrace_cluster_straggler_steps_total", rank="2", **run) == steps
    # A rank's counters appear when it is first named: no series for the ranks never named.
    assert value(text, "steptrace_cluster_straggler_steps_total", rank="0", **run) is None
    assert value(text, "steptrace_cluster_straggler_steps_total", rank="1", **run) is None
    assert value(text, "steptrace_cluster_straggler_cost_seconds_total", rank="0", **run) is None
    assert value(text, "steptrace_cluster_ranks_reporting", **run) == WORLD
    assert value(text, "steptrace_cluster_last_step", **run) == steps - 1
    assert value(text, "steptrace_cluster_steps_joined_total", **run) == steps
    assert value(text, "steptrace_cluster_incomplete_steps_total", **run) == 0
    last = records[-1]
    assert value(text, "steptrace_cluster_step_skew_seconds", **run) == pytest.approx(last["skew_seconds"])
    assert value(text, "steptrace_cluster_step_compute_seconds", stat="max", **run) == pytest.approx(
        last["compute_max_seconds"])
    assert 0 < value(text, "steptrace_cluster_compute_share_ratio", **run) < 1

    # The report shows the cluster view next to the per-rank one.
    report = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    cluster = json.loads(report.stdout)["cluster"]
    assert cluster["complete_steps"] == steps and cluster["straggler_steps"] == {"2": steps}


def test_collector_killed_and_restarted_mid_run(tmp_path):
    run_dir = tmp_path / "runs"
    first = CollectorProcess(run_dir, WORLD)
    port = first.port
    ranks = start_ranks(tmp_path, f"http://127.0.0.1:{port}", run_dir, 100_000)
    second = None
    try:
        assert wait_for(lambda: sum(r["complete"] for r in cluster_steps(run_dir)) >= 5, 20), "no steps joined"
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        joined_before = max(r["step"] for r in cluster_steps(run_dir))
        steps_at_kill = len(rank_records(run_dir, 0, "step"))

        # The ranks train on while nothing listens.
        time.sleep(1.5)
        assert all(p.poll() is None for p in ranks)
        assert len(rank_records(run_dir, 0, "step")) > steps_at_kill + 10

        restarted_at = time.time()
        deadline = time.monotonic() + 10
        while True:  # the port can take a moment to be free again
            try:
                second = CollectorProcess(run_dir, WORLD, port=port)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

        def joined_after_restart() -> list[dict]:
            return [r for r in cluster_steps(run_dir)
                    if r["complete"] and r["first_seen_time"] >= restarted_at and r["step"] > joined_before]

        assert wait_for(lambda: len(joined_after_restart()) >= 10, 20), "no steps joined after the restart"
        text = scrape(second.metrics_url)
    finally:
        (tmp_path / "stop").touch()
        try:
            results = finish_ranks(ranks, collector_down=True)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            if second is not None:
                assert second.stop() == 0

    # No rank crashed, and each counted what its exporter could not deliver while the collector was down.
    for rank, result in enumerate(results):
        [run_record] = rank_records(run_dir, rank, "run")
        assert run_record["dropped"].get("sink:otlp", 0) > 0, run_record
        assert run_record["steps"] == result["steps"]
    after = joined_after_restart()
    assert all(r["straggler_rank"] == 2 and r["ranks_reporting"] == WORLD for r in after[:10])
    assert value(text, "steptrace_cluster_last_step", run_id=RUN_ID) > joined_before
    assert value(text, "steptrace_cluster_straggler_rank", run_id=RUN_ID) == 2
    # Nothing joined twice: the restarted collector read what its predecessor wrote.
    steps = [r["step"] for r in cluster_steps(run_dir)]
    assert len(steps) == len(set(steps))
