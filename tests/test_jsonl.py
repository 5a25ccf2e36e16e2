"""The embedded default sink: one JSON record per line, surviving a crash of the process."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import steptrace


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_records_land_in_run_dir_run_id_rank_file(tmp_path):
    steptrace.init(run_dir=str(tmp_path), run_id="r1", rank=1, world_size=2)
    for n in range(3):
        with steptrace.step(n, tokens=10):
            with steptrace.span("data"):
                pass
    with steptrace.checkpoint(2):
        pass
    steptrace.shutdown()
    records = read_lines(tmp_path / "r1" / "rank-1.jsonl")
    assert [r["type"] for r in records] == ["attempt", "metadata"] + ["span", "step"] * 3 + ["checkpoint", "run"]
    step = records[3]
    assert (step["run_id"], step["rank"], step["world_size"], step["step"]) == ("r1", 1, 2, 0)
    for key in ("start_time", "end_time", "interval_seconds", "compute_seconds", "idle_seconds",
                "idle_breakdown", "tokens", "flops", "tokens_per_second", "tflops_per_second", "status"):
        assert key in step
    assert abs(step["end_time"] - time.time()) < 60  # unix seconds


def test_resumed_run_appends_after_a_torn_line(tmp_path):
    path = tmp_path / "r" / "rank-0.jsonl"
    path.parent.mkdir()
    path.write_text('{"type":"step","step":0}\n{"type":"st')  # a crash mid-write
    steptrace.init(run_dir=str(tmp_path), run_id="r")
    with steptrace.step(1):
        pass
    steptrace.shutdown()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"type":"st'
    assert [json.loads(line)["type"] for line in lines[2:4]] == ["attempt", "metadata"]
    assert json.loads(lines[4])["step"] == 1


CRASHING_TRAINER = textwrap.dedent("""
    import sys, time, steptrace
    from steptrace.testing import SimulatedDevice
    device = SimulatedDevice()
    steptrace.init(run_dir=sys.argv[1], run_id="crash")
    n = 0
    while True:
        with steptrace.step(n) as s:
            s.wait_for(device.run(0.005))
        n += 1
        if n == 20:
            print("twenty", flush=True)
""")


def test_completed_steps_survive_a_killed_training_process(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(CRASHING_TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "twenty"
        path = tmp_path / "crash" / "rank-0.jsonl"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until some steps are resolved and written
            if path.exists() and path.read_text().count("\n") >= 10:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no flush: a hard crash
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    lines = path.read_text().split("\n")
    complete = [json.loads(line) for line in lines[:-1]]  # everything before the last newline parses
    steps = [r["step"] for r in complete if r["type"] == "step"]
    assert len(steps) >= 10
    assert steps == list(range(len(steps)))  # in order, none missing
    assert [r["type"] for r in complete[:2]] == ["attempt", "metadata"]
    assert all(r["status"] == "ok" and r["compute_seconds"] > 0 for r in complete[2:])
