"""Goodput across restarts (issue 19): attempts, wasted progress, start-up and downtime.

A real job is killed after a checkpoint and resumed from it by new processes with the same run id
(2 ranks); another saves, exits cleanly and resumes. Truth is what the test injected and timed
itself: the start-up sleep, the downtime between the kill and the relaunch, the steps thrown away.
Every second lands in one bucket: productive + badput = total, exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from collector_process import collector_if_installed

from steptrace.analysis.goodput import BUCKETS, job_accounting
from steptrace.analysis.runs import kept_and_wasted, load_run

pytestmark = pytest.mark.integration

STARTUP_S = 0.3  # framework start-up injected before init()
RESTORE_S = 0.15
STEP_S = 0.02
DOWNTIME_S = 0.6
# A process start is read from /proc in clock ticks: an attempt's start is known to one tick.
TICK_S = 1 / os.sysconf("SC_CLK_TCK")

RANK_SCRIPT = r'''
import json, os, signal, sys, time
started = time.time()
run_dir, rank, last_step, kill, startup, restore_s, step_s = (
    sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "kill", float(sys.argv[5]),
    float(sys.argv[6]), float(sys.argv[7]))
time.sleep(startup)  # framework initialization before steptrace starts
import steptrace
steptrace.init(run_dir=run_dir, run_id="job", rank=rank, world_size=2)
ckpt = os.path.join(run_dir, f"ckpt-{rank}.json")
first = 0
restored = 0.0
if os.path.exists(ckpt):
    with steptrace.restore(json.load(open(ckpt))["step"]):
        t = time.time()
        time.sleep(restore_s)  # wakes late on a loaded machine: what it really took is the truth
        first = json.load(open(ckpt))["step"] + 1
        restored = time.time() - t
marks = {"started": started, "first_entry": None, "restored": restored}
for n in range(first, last_step + 1):
    t0 = time.time()
    with steptrace.step(n):
        if marks["first_entry"] is None:
            marks["first_entry"] = t0
        time.sleep(step_s)
    marks[n] = (t0, time.time())
    if n == 8 and kill:
        with steptrace.checkpoint(n):
            json.dump({"step": n}, open(ckpt, "w"))
if not kill:
    with steptrace.checkpoint(last_step):
        json.dump({"step": last_step}, open(ckpt, "w"))
    steptrace.shutdown()
    marks["exit"] = time.time()
    print(json.dumps(marks), flush=True)
else:
    steptrace.flush()
    marks["kill"] = time.time()
    print(json.dumps(marks), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no shutdown, no run record
'''


def _attempt(tmp_path: Path, run_dir: Path, last_step: int, kill: bool,
             otlp: str | None = None) -> tuple[list[float], list[dict]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPTRACE_", "OTEL_", "TORCHELASTIC", "SLURM"))}
    if otlp is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
    # Each rank's own launch time, read just before its Popen: Popen returns only once the child has
    # exec'd, so rank 1 starts a whole fork + exec after rank 0 (tens of ms on a loaded machine, where
    # one launch time for both failed rank 1's start-up and downtime checks in CI).
    launched: list[float] = []
    procs = []
    for rank in (0, 1):
        launched.append(time.time())
        procs.append(subprocess.Popen([sys.executable, str(script), str(run_dir), str(rank), str(last_step),
                                       "kill" if kill else "exit", str(STARTUP_S), str(RESTORE_S), str(STEP_S)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    marks = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == (-9 if kill else 0), err
        marks.append(json.loads(out.strip().splitlines()[-1]))
    return launched, marks


def _assert_adds_up(job: dict) -> None:
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-6)
    assert set(job["badput"]) == set(BUCKETS)


def _close(measured: float, truth: float) -> bool:
    return abs(measured - truth) <= max(0.02, 0.05 * truth)


def test_a_job_killed_after_a_checkpoint_and_resumed_is_accounted_by_attempt(tmp_path):
    run_dir = tmp_path / "runs"
    collector = collector_if_installed(run_dir, 2)
    otlp = None if collector is None else f"http://127.0.0.1:{collector.port}"
    try:
        launched_1, marks_1 = _attempt(tmp_path, run_dir, last_step=12, kill=True, otlp=otlp)
        time.sleep(DOWNTIME_S)
        launched_2, marks_2 = _attempt(tmp_path, run_dir, last_step=19, kill=False, otlp=otlp)
        if collector is not None:
            # The collector joins both attempts' steps, the redone 9-12 included, with no conflict.
            from collector_helpers import read_records, wait_for

            def joined() -> set:
                return {(r["attempt"], r["step"]) for r in read_records(run_dir / "job" / "cluster.jsonl")
                        if r.get("type") == "cluster_step" and r.get("complete")}

            expected = {(0, n) for n in range(13)} | {(1, n) for n in range(9, 20)}
            assert wait_for(lambda: joined() >= expected, 20), expected - joined()
            assert not (run_dir / "job" / "conflicts.jsonl").exists()
    finally:
        if collector is not None:
            assert collector.stop() == 0
    run = load_run(run_dir / "job")
    assert run.ranks == [0, 1]
    for rank in (0, 1):
        records = run.records_by_rank[rank]
        attempts = [r for r in records if r["type"] == "attempt"]
        # Ranks agree on the attempt number without talking: each counted its own run directory.
        assert [(a["attempt"], a["attempt_source"]) for a in attempts] == [(0, "default"), (1, "run_dir")]
        # A redone step is its own unit: another trace id, and counted once where steps are counted.
        steps = [r for r in records if r["type"] == "step"]
        redone = [r for r in steps if r["step"] in (9, 10, 11, 12)]
        assert len(redone) == 8 and len({r["trace_id"] for r in redone}) == 8
        assert [r["step"] for r in run.steps(rank)] == list(range(20))
        assert [(r["attempt"], r["step"]) for r in run.wasted_steps(rank)] == [(0, 9), (0, 10), (0, 11), (0, 12)]

        job = job_accounting(records)
        _assert_adds_up(job)
        first, second = job["attempts"]
        assert (first["status"], second["status"]) == ("crashed", "clean")
        assert (first["first_step"], first["last_step"], second["first_step"], second["last_step"]) == (0, 12, 9, 19)
        m1, m2 = marks_1[rank], marks_2[rank]
        l1, l2 = launched_1[rank], launched_2[rank]
        # Start-up: process start -> the first step's entry, less the restore (its own bucket).
        assert _close(first["badput"]["startup"], m1["first_entry"] - l1), first
        assert _close(second["badput"]["startup"], m2["first_entry"] - l2 - m2["restored"]), second
        assert m2["restored"] >= RESTORE_S and _close(second["badput"]["restore"], m2["restored"])
        assert first["badput"]["restore"] == 0.0
        # Downtime: the crashed attempt's last record (step 12's end) -> the relaunch's process start;
        # its flush and the kill fall in between.
        assert _close(job["badput"]["downtime"], l2 - m1["12"][1])
        assert job["badput"]["downtime"] >= l2 - m1["kill"]
        # Wasted progress: the steps after the checkpoint at step 8 that the crash threw away.
        assert _close(job["badput"]["wasted"], m1["12"][1] - m1["9"][0])
        assert job["wasted_steps"] == 4 and job["kept_steps"] == 20
        assert _close(job["total_seconds"], marks_2[rank]["exit"] - l1)
        assert 0 < job["goodput"] < 1


def test_a_clean_save_exit_resume_costs_downtime_and_start_up_but_no_wasted_progress(tmp_path):
    run_dir = tmp_path / "runs"
    _attempt(tmp_path, run_dir, last_step=9, kill=False)
    time.sleep(DOWNTIME_S)
    _attempt(tmp_path, run_dir, last_step=15, kill=False)
    run = load_run(run_dir / "job")
    for rank in (0, 1):
        job = job_accounting(run.records_by_rank[rank])
        _assert_adds_up(job)
        assert job["badput"]["wasted"] == 0.0 and job["wasted_steps"] == 0
        assert [a["status"] for a in job["attempts"]] == ["clean", "clean"]
        assert job["badput"]["downtime"] >= DOWNTIME_S - TICK_S
        assert [r["step"] for r in run.steps(rank)] == list(range(16))


def _step(attempt, n, start, interval, compute, **extra):
    record = {"type": "step", "attempt": attempt, "step": n, "host_start_time": start, "end_time": start + interval,
              "interval_seconds": interval, "compute_seconds": compute,
              "idle_breakdown": {"data": interval - compute} if interval > compute else {}}
    record.update(extra)
    return record


def test_the_accounting_is_exact_on_known_records():
    """Attempt 0 starts at 0 (init at 2), steps 0-3 of 1 s from 3 s (0.75 compute); it crashes after
    a checkpoint [7, 7.5]; attempt 1 starts at 10, resumes at step 2 after a 1 s restore."""
    records = [
        {"type": "attempt", "attempt": 0, "start_time": 0.0, "init_time": 2.0},
        _step(0, 0, 3.0, 1.0, 0.75, before_step_seconds=1.0, before_step_breakdown={"eval": 0.5, "startup": 0.5}),
        _step(0, 1, 4.0, 1.0, 0.75), _step(0, 2, 5.0, 1.0, 0.75), _step(0, 3, 6.0, 1.0, 0.75),
        {"type": "checkpoint", "attempt": 0, "step": 3, "start_time": 7.0, "end_time": 7.5},
        {"type": "attempt", "attempt": 1, "start_time": 10.0, "init_time": 11.0},
        _step(1, 2, 13.0, 1.0, 1.0, before_step_seconds=2.0, before_step_breakdown={"restore": 1.0, "startup": 0.5,
                                                                                    "warmup": 0.5}),
        _step(1, 3, 14.0, 1.0, 1.0),
        {"type": "run", "attempt": 1},
    ]
    kept, wasted = kept_and_wasted(records)
    assert [(r["attempt"], r["step"]) for r in kept] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert [(r["attempt"], r["step"]) for r in wasted] == [(0, 2), (0, 3)]
    job = job_accounting(records)
    assert job["total_seconds"] == 15.0
    assert job["productive_seconds"] == 0.75 * 2 + 2.0
    assert job["badput"] == {"startup": 2.0 + 0.5 + 1.0 + 0.5, "compile": 0.0, "data": 0.5, "checkpoint": 0.5,
                             "restore": 1.0, "eval": 0.5, "custom": 0.5, "other": 0.0, "collective_wait": 0.0,
                             "wasted": 2.0, "downtime": 2.5}
    assert job["custom"] == {"warmup": 0.5}
    assert job["productive_seconds"] + sum(job["badput"].values()) == job["total_seconds"]
    assert [a["status"] for a in job["attempts"]] == ["crashed", "clean"]
    # An attempt whose process start (known to a clock tick) falls before the previous attempt's last
    # record starts at that record: no downtime, and no second counted twice.
    records[6] = dict(records[6], start_time=7.49)
    job = job_accounting(records)
    assert job["badput"]["downtime"] == 0.0 and job["badput"]["startup"] == 4.0 - 1.0 + (11.0 - 7.5)
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-12)


def test_the_report_shows_the_attempts_and_the_jobs_badput(tmp_path):
    run_dir = tmp_path / "runs"
    _attempt(tmp_path, run_dir, last_step=12, kill=True)
    time.sleep(0.2)
    _attempt(tmp_path, run_dir, last_step=14, kill=False)
    env = {**os.environ, "COLUMNS": "200"}
    text = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir / "job")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert text.returncode == 0, text.stderr
    assert "Attempts (rank 0)" in text.stdout and "crashed" in text.stdout and "clean" in text.stdout
    assert "badput: wasted" in text.stdout and "badput: downtime" in text.stdout
    out = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir / "job"), "--json"],
                         capture_output=True, text=True, timeout=60, env=env)
    payload = json.loads(out.stdout)
    assert payload["steps"] == 15  # steps 0-14 once each: the redone 9-12 counted as the second attempt ran them
    job = payload["job"]
    assert [a["status"] for a in job["attempts"]] == ["crashed", "clean"] and job["wasted_steps"] == 4
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-6)


def test_the_attempt_is_on_every_exporter(tmp_path, monkeypatch):
    """Prometheus serves it as a gauge; OTLP spans of a later attempt carry it and its own trace ids."""
    pytest.importorskip("prometheus_client", reason="the Prometheus sink needs prometheus_client")
    import urllib.request

    import steptrace
    from steptrace._ids import trace_id_hex
    from steptrace.testing import MemorySink

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    sink = MemorySink()
    steptrace.init(run_dir=str(tmp_path), run_id="exp", prometheus_port=0, sinks=[sink])
    try:
        config = steptrace.config()
        assert (config.attempt, config.attempt_source) == (3, "launcher:TORCHELASTIC_RESTART_COUNT")
        with steptrace.step(0):
            pass
        steptrace.flush()
        url = steptrace.stats()["endpoints"]["prometheus"]
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        steptrace.shutdown()
    assert 'steptrace_attempt{rank="0",run_id="exp"} 3.0' in text
    (step,) = sink.steps()
    assert step["attempt"] == 3 and step["trace_id"] == trace_id_hex("exp", 0, 3) != trace_id_hex("exp", 0)


def test_compare_shows_the_jobs_goodput_when_a_side_restarted(tmp_path):
    restarted, clean = tmp_path / "restarted", tmp_path / "clean"
    _attempt(tmp_path, restarted, last_step=12, kill=True)
    time.sleep(0.2)
    _attempt(tmp_path, restarted, last_step=14, kill=False)
    _attempt(tmp_path, clean, last_step=14, kill=False)
    out = subprocess.run([sys.executable, "-m", "steptrace", "compare", str(clean / "job"), str(restarted / "job"),
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {row["metric"]: row for row in json.loads(out.stdout)["rows"]}
    assert rows["job_wasted"]["a"] == 0.0 and rows["job_wasted"]["b"] > 0
    assert rows["job_downtime"]["b"] >= 0.2 - TICK_S
    # The one goodput, across attempts: the restarted side's lost the wasted steps and the downtime.
    assert rows["goodput"]["b"] < rows["goodput"]["a"] and "job_goodput" not in rows
    assert rows["steps"]["a"] == rows["steps"]["b"] == 15  # the redone steps count once
