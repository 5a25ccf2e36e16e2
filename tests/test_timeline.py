"""Tests for steptrace.timeline: the Chrome/Perfetto trace and the PNG timeline.

Runs come from hand-written JSONL (two pipeline ranks running a 1F1B schedule,
a checkpoint, an error step) and from a run recorded by the real SDK.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import steptrace
from steptrace import timeline
from steptrace._attribution import HostSpan, idle_segments
from steptrace._cli import main as cli_main
from steptrace.report import RunDirError, load_run
from steptrace.timeline import build_trace, parse_steps, render_png, write_trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0
FWD, BWD, OPTIMIZER = 0.010, 0.020, 0.002
N_STAGES, N_MICROBATCHES = 2, 4


# --------------------------------------------------------------------------
# A hand-written pipeline run
# --------------------------------------------------------------------------


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: warm-up forwards, alternate F/B, cool-down backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("forward", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        order += [("forward", f), ("backward", b)]
        f, b = f + 1, b + 1
    order += [("backward", i) for i in range(b, microbatches)]
    return order


def schedule(stages: int, microbatches: int) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(stage, kind, microbatch) -> (start, end) offsets, honouring pipeline dependencies."""
    orders = {s: one_f_one_b(s, stages, microbatches) for s in range(stages)}
    done: dict[tuple[int, str, int], tuple[float, float]] = {}
    free = {s: 0.0 for s in range(stages)}
    pos = {s: 0 for s in range(stages)}
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "forward":
                dep = (s - 1, "forward", i) if s > 0 else None
            else:
                dep = (s + 1, "backward", i) if s < stages - 1 else (s, "forward", i)
            if dep is not None and dep not in done:
                continue
            begin = max(free[s], done[dep][1] if dep else 0.0)
            end = begin + (FWD if kind == "forward" else BWD)
            done[(s, kind, i)] = (begin, end)
            free[s] = end
            pos[s] += 1
    return done


def r6(t: float) -> float:
    return round(t, 6)


def pipeline_rank(rank: int, n_steps: int = 3) -> list[dict]:
    """One pipeline rank (stage = rank): data spans, compile in step 0, an eval span
    between steps 0 and 1, a checkpoint of step 1 (blocking, with an async commit),
    step 2 failing.  Device times follow the timing model (DESIGN.md §2)."""
    times = schedule(N_STAGES, N_MICROBATCHES)
    makespan = max(end for _, end in times.values())
    records: list[dict] = []
    host_spans: list[HostSpan] = []
    host = T0
    prev_end = None
    for n in range(n_steps):
        host_start = host
        spans = [HostSpan("data", host_start, host_start + 0.003)]
        if n == 0:
            spans.append(HostSpan("compile", host_start + 0.003, host_start + 0.053))
        dispatch = spans[-1].end
        host_end = dispatch + 0.001
        host_spans += spans
        window_start = host_start if prev_end is None else prev_end
        start = max(window_start, dispatch)
        end = start + makespan + OPTIMIZER
        segments = idle_segments(window_start, start, host_spans)
        for span in spans:
            records.append({"type": "span", "run_id": "pp", "rank": rank, "name": span.name, "step": n,
                            "start_time": r6(span.start), "end_time": r6(span.end),
                            "seconds": span.end - span.start, "attrs": {}})
        for (stage, kind, i), (b, e) in sorted(times.items(), key=lambda kv: kv[1]):
            if stage != rank:
                continue
            records.append({"type": "microbatch", "run_id": "pp", "rank": rank, "step": n,
                            "microbatch": i, "stage": stage, "chunk": None, "kind": kind,
                            "host_start_time": r6(dispatch), "host_end_time": r6(dispatch),
                            "start_time": r6(start + b), "end_time": r6(start + e), "compute_seconds": e - b})
        interval, compute = end - window_start, end - start
        breakdown: dict[str, float] = {}
        for seg in segments:
            breakdown[seg.name] = breakdown.get(seg.name, 0.0) + seg.end - seg.start
        step = {
            "type": "step", "run_id": "pp", "rank": rank, "world_size": 2, "step": n,
            "trace_id": f"{n:032x}", "status": "ok", "backend": "simulated",
            "host_start_time": r6(host_start), "host_end_time": r6(host_end), "dispatch_time": r6(dispatch),
            "start_time": r6(start), "end_time": r6(end),
            "interval_seconds": interval, "compute_seconds": compute, "idle_seconds": interval - compute,
            "idle_breakdown": breakdown,
            "idle_segments": [[s.name, r6(s.start), r6(s.end)] for s in segments],
            "tokens": 4096, "samples": 8, "flops": None, "tokens_per_second": 4096 / interval,
            "samples_per_second": 8 / interval, "tflops_per_second": None, "mfu": None, "attrs": {},
            "pipeline_bubble_ratio": {str(rank): 0.3},
        }
        if n == 2:
            step["status"] = "error"
            step["error"] = "RuntimeError: boom"
        records.append(step)
        host = host_end
        prev_end = end
        if n == 0:
            host_spans.append(HostSpan("eval", host, host + 0.02))
            records.append({"type": "span", "run_id": "pp", "rank": rank, "name": "eval", "step": None,
                            "start_time": r6(host), "end_time": r6(host + 0.02), "seconds": 0.02, "attrs": {}})
            host += 0.02
        if n == 1:
            ckpt_end = host + 0.3
            host_spans.append(HostSpan("checkpoint", host, ckpt_end))
            records.append({"type": "checkpoint", "run_id": "pp", "rank": rank, "step": n, "status": "ok",
                            "start_time": r6(host), "end_time": r6(ckpt_end), "host_seconds": 0.3,
                            "blocking_seconds": ckpt_end - max(host, end), "async_seconds": 0.5})
            host = ckpt_end + 0.0005
    records.append({"type": "run", "run_id": "pp", "rank": rank, "world_size": 2, "steps": n_steps,
                    "dropped": {}})
    return records


def write_rank(run_dir: Path, rank: int, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def pipeline_dir(tmp_path) -> Path:
    run_dir = tmp_path / "runs" / "pp"
    for rank in range(N_STAGES):
        write_rank(run_dir, rank, pipeline_rank(rank))
    return run_dir


@pytest.fixture
def pipeline_run(pipeline_dir):
    return load_run(pipeline_dir)


# --------------------------------------------------------------------------
# Helpers over a trace dict
# --------------------------------------------------------------------------


def meta(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == name]


def thread_ids(trace: dict, pid: int) -> dict[str, int]:
    """thread name -> tid for one process."""
    return {e["args"]["name"]: e["tid"] for e in meta(trace, "thread_name") if e["pid"] == pid}


def slices(trace: dict, pid: int, thread: str) -> list[dict]:
    tid = thread_ids(trace, pid)[thread]
    found = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid]
    return sorted(found, key=lambda e: (e["ts"], -e["dur"]))


def us(trace: dict, t: float) -> float:
    """Unix seconds -> trace microseconds (the trace rounds each end to whole microseconds)."""
    return (t - trace["otherData"]["origin_unix_seconds"]) * 1e6


def assert_threads_nest(trace: dict) -> None:
    """On every thread, complete events are properly nested (what trace viewers require)."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, events in by_thread.items():
        open_ends: list[float] = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-6:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-6, f"{key}: {e['name']} overlaps its parent"
            open_ends.append(end)


def assert_device_tiles(trace: dict, run, rank: int) -> None:
    """The device track covers [init(), last step's end] without gaps or overlaps (from the first
    step's window start less its ``before_step_seconds``: the time before the first step, issue 49),
    and its durations add up to Σ interval_seconds + before_step_seconds (1 µs per event)."""
    steps = run.steps(rank)
    device = slices(trace, rank, "device")
    assert device, "no device events"
    before_first = steps[0].get("before_step_seconds") or 0.0
    first_window_start = steps[0]["end_time"] - steps[0]["interval_seconds"] - before_first
    assert device[0]["ts"] == pytest.approx(us(trace, first_window_start), abs=1.5)
    assert device[-1]["ts"] + device[-1]["dur"] == pytest.approx(us(trace, steps[-1]["end_time"]), abs=1.5)
    for before, after in zip(device, device[1:]):
        assert after["ts"] == before["ts"] + before["dur"], (before, after)
    total_us = sum(e["dur"] for e in device)
    wall_us = (sum(s["interval_seconds"] for s in steps) + before_first) * 1e6
    assert total_us == pytest.approx(wall_us, abs=1.0 * len(device))


# --------------------------------------------------------------------------
# The trace from hand-written records
# --------------------------------------------------------------------------


def test_trace_file_is_json_with_one_named_process_per_rank(pipeline_run, tmp_path):
    out = write_trace(pipeline_run, tmp_path / "trace.json")
    trace = json.loads(out.read_text())
    assert set(trace) >= {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] == "ms"
    names = {e["pid"]: e["args"]["name"] for e in meta(trace, "process_name")}
    assert names == {0: "rank 0", 1: "rank 1"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in meta(trace, "process_sort_index")}
    assert sort == {0: 0, 1: 1}
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    other = trace["otherData"]
    assert other["run_id"] == "pp" and other["ranks"] == [0, 1] and other["steps"] == "all"
    # Times are relative to the earliest record: the first step's host start.
    assert other["origin_unix_seconds"] == pytest.approx(T0)
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0
    # Whole microseconds, like the records' times.
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete and all(isinstance(e["ts"], int) and isinstance(e["dur"], int) for e in complete)
    assert_threads_nest(trace)


def test_tracks_are_host_device_then_one_per_stage_in_that_order(pipeline_run):
    trace = build_trace(pipeline_run)
    for rank in (0, 1):
        tids = thread_ids(trace, rank)
        assert set(tids) == {"host", "device", "checkpoint commit", f"stage {rank}"}
        order = {e["tid"]: e["args"]["sort_index"] for e in meta(trace, "thread_sort_index") if e["pid"] == rank}
        ranked = sorted(tids, key=lambda name: order[tids[name]])
        assert ranked == ["host", "device", "checkpoint commit", f"stage {rank}"]


def test_device_track_tiles_the_wall_time(pipeline_run):
    trace = build_trace(pipeline_run)
    for rank in (0, 1):
        assert_device_tiles(trace, pipeline_run, rank)


def test_compute_events_are_the_records_start_to_end_with_the_step_fields(pipeline_run):
    trace = build_trace(pipeline_run)
    for rank in (0, 1):
        compute = [e for e in slices(trace, rank, "device") if e["cat"] == "compute"]
        steps = pipeline_run.steps(rank)
        assert len(compute) == len(steps)
        for event, step in zip(compute, steps):
            assert event["ts"] == pytest.approx(us(trace, step["start_time"]), abs=1.5)
            assert event["dur"] == pytest.approx((step["end_time"] - step["start_time"]) * 1e6, abs=1.5)
            args = event["args"]
            assert args["step"] == step["step"] and args["trace_id"] == step["trace_id"]
            assert args["compute_seconds"] == step["compute_seconds"]
            assert args["interval_seconds"] == step["interval_seconds"]
            assert args["idle_seconds"] == step["idle_seconds"]
            assert args["tokens_per_second"] == step["tokens_per_second"]
            assert args["status"] == step["status"]


def test_idle_pieces_are_named_by_reason(pipeline_run):
    trace = build_trace(pipeline_run)
    idle = [e for e in slices(trace, 0, "device") if e["cat"].startswith("idle")]
    by_step: dict[int, list[str]] = {}
    for e in idle:
        by_step.setdefault(e["args"]["step"], []).append(e["name"])
    # Step 0 waits for data then compile; step 2 waits for the checkpoint, a gap, then data.
    assert by_step[0] == ["data", "compile"]
    assert by_step[2] == ["checkpoint", "other", "data"]
    ckpt = next(e for e in idle if e["name"] == "checkpoint")
    step2 = pipeline_run.steps(0)[2]
    assert ckpt["args"]["seconds"] == pytest.approx(step2["idle_breakdown"]["checkpoint"], abs=2e-6)
    assert ckpt["cat"] == "idle.checkpoint"


def test_host_track_has_steps_spans_and_the_checkpoint_with_its_blocking_part(pipeline_run):
    trace = build_trace(pipeline_run)
    host = slices(trace, 0, "host")
    names = [e["name"] for e in host]
    assert names == ["step 0", "data", "compile", "eval", "step 1", "data", "checkpoint 1", "blocking",
                     "step 2 (error)", "data"]
    step0 = host[0]
    record = pipeline_run.steps(0)[0]
    assert step0["ts"] == pytest.approx(us(trace, record["host_start_time"]), abs=1.5)
    assert step0["dur"] == pytest.approx((record["host_end_time"] - record["host_start_time"]) * 1e6, abs=1.5)
    assert next(e for e in host if e["name"] == "compile")["cat"] == "compile"

    ckpt_record = pipeline_run.checkpoints(0)[0]
    ckpt = next(e for e in host if e["name"] == "checkpoint 1")
    assert ckpt["cat"] == "checkpoint"
    assert ckpt["args"]["blocking_seconds"] == ckpt_record["blocking_seconds"]
    assert ckpt["args"]["async_seconds"] == 0.5
    assert ckpt["dur"] == pytest.approx(0.3e6, abs=1.5)
    blocking = next(e for e in host if e["name"] == "blocking")
    # The blocking part is the end of the save, nested in it.
    assert blocking["ts"] + blocking["dur"] == pytest.approx(ckpt["ts"] + ckpt["dur"], abs=0.01)
    assert blocking["dur"] == pytest.approx(ckpt_record["blocking_seconds"] * 1e6, abs=1.5)
    commit = slices(trace, 0, "checkpoint commit")
    assert [e["name"] for e in commit] == ["checkpoint 1 commit"]
    assert commit[0]["ts"] == pytest.approx(ckpt["ts"] + ckpt["dur"], abs=0.01)
    assert commit[0]["dur"] == pytest.approx(0.5e6, abs=1.5)


def test_microbatches_are_on_their_stage_track_in_1f1b_order(pipeline_run):
    trace = build_trace(pipeline_run)
    expected = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],   # one warm-up forward
                1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}   # the last stage alternates
    for rank in (0, 1):
        events = slices(trace, rank, f"stage {rank}")
        assert len(events) == 3 * N_MICROBATCHES * 2
        step0 = [e for e in events if e["args"]["step"] == 0]
        assert [e["name"] for e in step0] == expected[rank]
        for e in step0:
            assert e["args"]["stage"] == rank
            assert e["args"]["kind"] == ("forward" if e["name"][0] == "F" else "backward")
            assert e["args"]["microbatch"] == int(e["name"][1:])
            assert e["cat"] == f"microbatch.{e['args']['kind']}"
    # The pipeline dependency is visible across ranks: stage 1 runs F0 after stage 0 did.
    f0 = {rank: next(e for e in slices(trace, rank, f"stage {rank}") if e["name"] == "F0") for rank in (0, 1)}
    assert f0[1]["ts"] == pytest.approx(f0[0]["ts"] + f0[0]["dur"], abs=0.01)


def test_microbatch_records_match_their_events(pipeline_run):
    trace = build_trace(pipeline_run)
    events = slices(trace, 1, "stage 1")
    records = sorted(pipeline_run.records("microbatch", 1), key=lambda r: r["start_time"])
    for event, record in zip(events, records):
        assert event["ts"] == pytest.approx(us(trace, record["start_time"]), abs=1.5)
        assert event["dur"] == pytest.approx((record["end_time"] - record["start_time"]) * 1e6, abs=1.5)


def test_error_step_is_marked_on_host_and_device(pipeline_run):
    trace = build_trace(pipeline_run)
    for thread in ("host", "device"):
        marked = [e for e in slices(trace, 0, thread) if e.get("cname") == "terrible"]
        assert [e["name"] for e in marked] == ["step 2 (error)"]
        assert marked[0]["args"]["status"] == "error"
        assert marked[0]["args"]["error"] == "RuntimeError: boom"
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["pid"] == 0]
    assert [(e["name"], e["args"]["step"]) for e in instants] == [("error", 2)]
    assert not [e for e in slices(trace, 0, "host") if e["name"].startswith("step 1") and "cname" in e]


def test_flows_link_each_host_step_to_its_device_compute(pipeline_run):
    trace = build_trace(pipeline_run)
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf" and e["pid"] == 0]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert set(starts) == set(ends) and len(starts) == 3
    tids = thread_ids(trace, 0)
    compute = [e for e in slices(trace, 0, "device") if e["cat"] == "compute"]
    for flow_id, start in starts.items():
        end = ends[flow_id]
        assert start["tid"] == tids["host"] and end["tid"] == tids["device"] and end["bp"] == "e"
        # The start sits strictly inside its host step.
        host = next(h for h in slices(trace, 0, "host") if h["name"].startswith("step")
                    and h["ts"] < start["ts"] < h["ts"] + h["dur"])
        device = next(c for c in compute if c["ts"] < end["ts"] < c["ts"] + c["dur"])
        assert host["args"]["step"] == device["args"]["step"]


def test_rank_filter_keeps_only_those_ranks(pipeline_run):
    trace = build_trace(pipeline_run, ranks=[1])
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    assert trace["otherData"]["ranks"] == [1]
    # The time origin is the whole run's, so the same instant keeps its ts.
    full = build_trace(pipeline_run)
    assert slices(trace, 1, "device") == slices(full, 1, "device")
    with pytest.raises(RunDirError, match="no rank 7"):
        build_trace(pipeline_run, ranks=[7])


def test_step_window_selects_steps_their_records_and_spans_in_between(pipeline_run):
    trace = build_trace(pipeline_run, steps="1:2")
    host_names = [e["name"] for e in slices(trace, 0, "host")]
    assert host_names == ["step 1", "data", "checkpoint 1", "blocking", "step 2 (error)", "data"]
    compute = [e["args"]["step"] for e in slices(trace, 0, "device") if e["cat"] == "compute"]
    assert compute == [1, 2]
    assert {e["args"]["step"] for e in slices(trace, 0, "stage 0")} == {1, 2}
    assert trace["otherData"]["steps"] == "1:2"
    # The between-steps eval span overlaps step 0..1's window, so a window of step 0 keeps it.
    only0 = build_trace(pipeline_run, steps=(0, 0))
    assert "eval" in [e["name"] for e in slices(only0, 0, "host")]
    assert "checkpoint commit" not in thread_ids(only0, 0)


def test_parse_steps():
    assert parse_steps("3:7") == (3, 7)
    assert parse_steps("3:") == (3, None)
    assert parse_steps(":7") == (None, 7)
    assert parse_steps("5") == (5, 5)
    for bad in ("a:b", "7:3", "1:2:3"):
        with pytest.raises(ValueError, match="invalid step window"):
            parse_steps(bad)


def test_interleaved_chunks_get_a_track_each(tmp_path):
    records = [
        {"type": "step", "run_id": "il", "rank": 0, "step": 0, "status": "ok",
         "host_start_time": T0, "host_end_time": T0 + 0.001, "start_time": T0, "end_time": T0 + 0.05,
         "interval_seconds": 0.05, "compute_seconds": 0.05, "idle_seconds": 0.0, "idle_segments": []},
    ]
    # Interleaved stage 0 with two virtual chunks: F0c0 F1c0 F0c1 F1c1 B0c1 B1c1 B0c0 B1c0.
    order = [("forward", 0, 0), ("forward", 1, 0), ("forward", 0, 1), ("forward", 1, 1),
             ("backward", 0, 1), ("backward", 1, 1), ("backward", 0, 0), ("backward", 1, 0)]
    for k, (kind, i, chunk) in enumerate(order):
        records.append({"type": "microbatch", "run_id": "il", "rank": 0, "step": 0, "microbatch": i,
                        "stage": 0, "chunk": chunk, "kind": kind, "start_time": T0 + k * 0.005,
                        "end_time": T0 + (k + 1) * 0.005, "compute_seconds": 0.005})
    write_rank(tmp_path / "il", 0, records)
    trace = build_trace(load_run(tmp_path / "il"))
    tids = thread_ids(trace, 0)
    assert tids["host"] < tids["device"] < tids["stage 0 chunk 0"] < tids["stage 0 chunk 1"]
    assert [e["name"] for e in slices(trace, 0, "stage 0 chunk 0")] == ["F0", "F1", "B0", "B1"]
    assert [e["name"] for e in slices(trace, 0, "stage 0 chunk 1")] == ["F0", "F1", "B0", "B1"]
    assert all(e["args"]["chunk"] == 1 for e in slices(trace, 0, "stage 0 chunk 1"))


def test_a_zero_bubble_split_backward_is_drawn_as_input_and_weight_halves(tmp_path):
    """torch.distributed.pipelining's zero-bubble schedules split a backward into I (input gradient)
    and W (weight gradient), the letters its own schedule dumps use."""
    records = [
        {"type": "step", "run_id": "zb", "rank": 0, "step": 0, "status": "ok",
         "host_start_time": T0, "host_end_time": T0 + 0.001, "start_time": T0, "end_time": T0 + 0.05,
         "interval_seconds": 0.05, "compute_seconds": 0.05, "idle_seconds": 0.0, "idle_segments": []},
    ]
    order = [("forward", 0), ("backward_input", 0), ("forward", 1), ("backward_weight", 0), ("backward", 1)]
    for k, (kind, i) in enumerate(order):
        records.append({"type": "microbatch", "run_id": "zb", "rank": 0, "step": 0, "microbatch": i,
                        "stage": 0, "chunk": None, "kind": kind, "start_time": T0 + k * 0.005,
                        "end_time": T0 + (k + 1) * 0.005, "compute_seconds": 0.005})
    write_rank(tmp_path / "zb", 0, records)
    run = load_run(tmp_path / "zb")
    drawn = slices(build_trace(run), 0, "stage 0")
    assert [e["name"] for e in drawn] == ["F0", "I0", "F1", "W0", "B1"]
    assert [e["args"]["kind"] for e in drawn] == [kind for kind, _ in order]
    assert render_png(run, tmp_path / "zb.png").stat().st_size > 0


def test_spans_that_overlap_without_nesting_go_to_a_second_host_track(tmp_path):
    step = {"type": "step", "run_id": "ov", "rank": 0, "step": 0, "status": "ok",
            "host_start_time": T0 + 0.01, "host_end_time": T0 + 0.03, "start_time": T0 + 0.02,
            "end_time": T0 + 0.04, "interval_seconds": 0.03, "compute_seconds": 0.02, "idle_seconds": 0.01,
            "idle_segments": [["prefetch", T0 + 0.01, T0 + 0.02]]}
    # A prefetch span opened before the step and closed inside it.
    span = {"type": "span", "run_id": "ov", "rank": 0, "name": "prefetch", "step": None,
            "start_time": T0, "end_time": T0 + 0.02, "seconds": 0.02, "attrs": {}}
    write_rank(tmp_path / "ov", 0, [span, step])
    trace = build_trace(load_run(tmp_path / "ov"))
    assert set(thread_ids(trace, 0)) == {"host", "host (overlapping)", "device"}
    assert [e["name"] for e in slices(trace, 0, "host")] == ["prefetch"]
    assert [e["name"] for e in slices(trace, 0, "host (overlapping)")] == ["step 0"]
    assert_threads_nest(trace)


def test_gz_output_is_compressed_json(pipeline_run, tmp_path):
    out = write_trace(pipeline_run, tmp_path / "trace.json.gz", ranks=[0])
    with gzip.open(out, "rt") as handle:
        trace = json.load(handle)
    assert {e["pid"] for e in trace["traceEvents"]} == {0}


# --------------------------------------------------------------------------
# A run recorded by the SDK
# --------------------------------------------------------------------------


@pytest.fixture
def recorded_dir(tmp_path, device):
    steptrace.init(run_dir=str(tmp_path), run_id="t")
    for n in range(4):
        with steptrace.step(n, tokens=1000) as s:
            with steptrace.span("data"):
                time.sleep(0.002)
            for i in range(2):
                with steptrace.microbatch(i, stage=0, kind="forward") as mb:
                    mb.wait_for(device.run(0.002))
            for i in range(2):
                with steptrace.microbatch(i, stage=0, kind="backward") as mb:
                    mb.wait_for(device.run(0.003))
            s.wait_for(device.run(0.01))
        if n == 1:
            with steptrace.checkpoint(n):  # outlasts the device's backlog: it blocks
                time.sleep(0.1)
    with pytest.raises(ValueError):
        with steptrace.step(4) as s:
            s.wait_for(device.run(0.005))
            raise ValueError("bad batch")
    steptrace.shutdown()
    return tmp_path / "t"


def test_recorded_run_becomes_a_consistent_trace(recorded_dir):
    run = load_run(recorded_dir)
    trace = build_trace(run)
    assert [e["args"]["name"] for e in meta(trace, "process_name")] == ["rank 0"]
    assert set(thread_ids(trace, 0)) == {"host", "device", "stage 0"}
    assert_threads_nest(trace)
    assert_device_tiles(trace, run, 0)

    steps = run.steps(0)
    compute = [e for e in slices(trace, 0, "device") if e["cat"] == "compute"]
    assert [e["args"]["step"] for e in compute] == [0, 1, 2, 3, 4]
    for event, step in zip(compute, steps):
        assert event["ts"] == pytest.approx(us(trace, step["start_time"]), abs=1.5)
        assert event["dur"] == pytest.approx((step["end_time"] - step["start_time"]) * 1e6, abs=1.5)
        # The trace rounds each end to the microsecond, compute_seconds is exact.
        assert event["dur"] == pytest.approx(step["compute_seconds"] * 1e6, abs=2.0)
        # 10 ms of device work plus 10 ms of microbatches; the failed step dispatched 5 ms.
        assert event["dur"] >= (0.004e6 if step["status"] == "error" else 0.019e6)
    assert compute[4]["name"] == "step 4 (error)" and compute[4]["cname"] == "terrible"
    assert "bad batch" in compute[4]["args"]["error"]

    micro = slices(trace, 0, "stage 0")
    assert [e["name"] for e in micro if e["args"]["step"] == 0] == ["F0", "F1", "B0", "B1"]
    assert len(micro) == 4 * 4
    # Checkpoint and data spans show on the host track; the checkpoint stall as idle.
    host_names = [e["name"] for e in slices(trace, 0, "host")]
    assert "checkpoint 1" in host_names and host_names.count("data") == 4
    assert "checkpoint" in [e["name"] for e in slices(trace, 0, "device")]
    ckpt = next(e for e in slices(trace, 0, "host") if e["name"] == "checkpoint 1")
    assert ckpt["args"]["blocking_seconds"] == run.checkpoints(0)[0]["blocking_seconds"] > 0


def test_png_of_a_recorded_run(recorded_dir, tmp_path):
    out = render_png(load_run(recorded_dir), tmp_path / "t.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


# --------------------------------------------------------------------------
# PNG and CLI
# --------------------------------------------------------------------------


def test_png_is_written(pipeline_run, tmp_path):
    out = render_png(pipeline_run, tmp_path / "pp.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    # A window and a rank filter render too.
    small = render_png(pipeline_run, tmp_path / "small.png", ranks=[1], steps="2:2")
    assert small.read_bytes().startswith(PNG_SIGNATURE)


def test_png_of_a_long_run_renders_at_a_bounded_size(tmp_path):
    """3,000 steps draw as bands in a figure of bounded size (how fast is bench material, not a test)."""
    records = []
    t = T0
    for n in range(3000):
        records.append({"type": "step", "run_id": "long", "rank": 0, "step": n, "status": "ok",
                        "host_start_time": t, "host_end_time": t + 0.001, "start_time": t + 0.002,
                        "end_time": t + 0.1, "interval_seconds": 0.1, "compute_seconds": 0.098,
                        "idle_seconds": 0.002, "idle_segments": [["data", t, t + 0.002]]})
        t += 0.1
    write_rank(tmp_path / "long", 0, records)
    out = render_png(load_run(tmp_path / "long"), tmp_path / "long.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 0 < width <= 4000 and 0 < height <= 4000, (width, height)


def test_cli_writes_trace_and_png(pipeline_dir, tmp_path, capsys):
    trace_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    code = cli_main(["timeline", str(pipeline_dir.parent), "-o", str(trace_path), "--png", str(png_path),
                     "--rank", "1", "--steps", "0:1"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"wrote {trace_path}" in out and f"wrote {png_path}" in out
    trace = json.loads(trace_path.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    assert {e["args"]["step"] for e in slices(trace, 1, "device") if e["cat"] == "compute"} == {0, 1}
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)


def test_cli_rank_accepts_repeats_and_commas(pipeline_dir, tmp_path):
    for ranks in (["--rank", "0", "--rank", "1"], ["--rank", "1,0"]):
        out = tmp_path / "r.json"
        assert cli_main(["timeline", str(pipeline_dir), "-o", str(out), *ranks]) == 0
        assert json.loads(out.read_text())["otherData"]["ranks"] == [0, 1]


def test_cli_missing_directory_is_exit_2_with_a_message(tmp_path):
    missing = tmp_path / "nope"
    result = subprocess.run([sys.executable, "-m", "steptrace", "timeline", str(missing), "-o",
                             str(tmp_path / "x.json")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("steptrace timeline: ") and str(missing) in result.stderr
    assert "no such directory" in result.stderr
    assert not (tmp_path / "x.json").exists()


def test_cli_unknown_rank_and_nothing_to_write_are_exit_2(pipeline_dir, tmp_path, capsys):
    assert cli_main(["timeline", str(pipeline_dir), "-o", str(tmp_path / "x.json"), "--rank", "5"]) == 2
    assert "steptrace timeline:" in capsys.readouterr().err
    assert cli_main(["timeline", str(pipeline_dir)]) == 2
    assert "nothing to write" in capsys.readouterr().err


def test_cli_bad_step_window_is_a_usage_error(pipeline_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["timeline", str(pipeline_dir), "-o", "x.json", "--steps", "9:2"])
    assert exc.value.code == 2
    assert "invalid step window" in capsys.readouterr().err


def test_cli_unwritable_output_is_exit_1(pipeline_dir, tmp_path, capsys):
    assert cli_main(["timeline", str(pipeline_dir), "-o", str(tmp_path / "no" / "dir" / "x.json")]) == 1
    assert "cannot write trace" in capsys.readouterr().err


def test_import_is_cheap():
    code = ("import sys, steptrace.timeline; "
            "heavy = [m for m in ('matplotlib', 'rich', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_module_entry_point(pipeline_dir, tmp_path):
    out = tmp_path / "m.json"
    assert timeline.main([str(pipeline_dir), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]
