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
            if path.exists() and path.read_text().count("\"type\":\"step\"") >= 11:
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


# -- rotation --------------------------------------------------------------------------------
def _record(n, pad=0):
    return {"type": "step", "run_id": "r", "rank": 0, "step": n, "status": "ok", "interval_seconds": 0.1,
            "compute_seconds": 0.1, "idle_seconds": 0.0, "idle_breakdown": {}, "attrs": {"pad": "x" * pad}}


def test_rank_files_rotate_at_max_bytes_in_numbered_segments_that_keep_order(tmp_path):
    from steptrace._sinks import JsonlSink

    path = tmp_path / "r" / "rank-0.jsonl"
    sink = JsonlSink(path, max_bytes=1000)
    for n in range(30):
        sink.export([_record(2 * n, 100), _record(2 * n + 1, 100)])  # ~470 bytes a batch
    sink.shutdown(1)
    names = sorted(p.name for p in path.parent.iterdir())
    assert "rank-0.jsonl" in names and "rank-0.1.jsonl" in names
    segments = sorted(int(name.split(".")[1]) for name in names if name.count(".") == 2)
    assert segments == list(range(1, len(segments) + 1)) and sink.rotations == len(segments) >= 10
    ordered = [path.parent / f"rank-0.{k}.jsonl" for k in segments] + [path]
    assert all(0 < p.stat().st_size <= 1000 for p in ordered)  # whole batches, never past the limit
    steps = [r["step"] for p in ordered for r in read_lines(p)]
    assert steps == list(range(60))  # every record once, in write order


def test_a_batch_larger_than_max_bytes_goes_whole_into_a_file_and_zero_never_rotates(tmp_path):
    from steptrace._sinks import JsonlSink

    sink = JsonlSink(tmp_path / "rank-0.jsonl", max_bytes=200)
    sink.export([_record(0, 500)])
    sink.export([_record(1, 500)])
    sink.shutdown(1)
    assert [r["step"] for r in read_lines(tmp_path / "rank-0.1.jsonl")] == [0]
    assert [r["step"] for r in read_lines(tmp_path / "rank-0.jsonl")] == [1]
    never = JsonlSink(tmp_path / "n" / "rank-0.jsonl", max_bytes=0)
    for n in range(20):
        never.export([_record(n, 500)])
    never.shutdown(1)
    assert [p.name for p in (tmp_path / "n").iterdir()] == ["rank-0.jsonl"]


def test_a_restart_continues_the_segment_numbering(tmp_path):
    from steptrace._sinks import JsonlSink

    run = tmp_path / "r"
    for attempt in range(2):
        sink = JsonlSink(run / "rank-0.jsonl", max_bytes=600)
        for n in range(6):
            sink.export([_record(attempt * 100 + n, 200)])
        sink.shutdown(1)
    from steptrace.analysis.runs import load_run

    steps = [r["step"] for r in load_run(run).records_by_rank[0]]
    assert steps == [*range(6), *range(100, 106)]  # file order: the first attempt's records first


def test_init_rotates_at_jsonl_max_bytes_and_every_reader_follows(tmp_path, device, monkeypatch):
    """A run written in many segments reads back whole: report, timeline and compare."""
    from steptrace.analysis.compare import compare_runs
    from steptrace.analysis.runs import load_run
    from steptrace.analysis.timeline import build_trace
    from steptrace.analysis.summary import summarize

    monkeypatch.setenv("STEPTRACE_JSONL_MAX_BYTES", "4096")
    config = steptrace.init(run_dir=str(tmp_path), run_id="rot", backend=device)
    assert config.jsonl_max_bytes == 4096
    for n in range(40):
        with steptrace.step(n, tokens=100) as s:
            with steptrace.span("data"):
                pass
            s.wait_for(device.run(0.001))
    steptrace.shutdown()
    files = sorted(p.name for p in (tmp_path / "rot").iterdir())
    assert len(files) > 3 and "rank-0.jsonl" in files
    run = load_run(tmp_path / "rot")
    assert [s["step"] for s in run.steps(0)] == list(range(40))
    assert {r["type"] for r in run.records_by_rank[0]} >= {"metadata", "step", "span", "run"}
    assert summarize(run.steps(0))["steps"] == 40
    trace = build_trace(run)
    assert sum(1 for e in trace["traceEvents"] if e.get("name", "").startswith("step ")) >= 40
    rows = {r.metric: r for r in compare_runs(run, run)["rows"]}
    assert rows["steps"].a == 40


def test_jsonl_max_bytes_is_checked_at_init(monkeypatch):
    import pytest

    with pytest.raises(ValueError, match="jsonl_max_bytes"):
        steptrace.init(jsonl_max_bytes=-1, jsonl=False)
    monkeypatch.setenv("STEPTRACE_JSONL_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="STEPTRACE_JSONL_MAX_BYTES"):
        steptrace.init(jsonl=False)
