"""Tests for steptrace.report, using hand-written JSONL run directories."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from steptrace import report
from steptrace.analysis import palette, plotting
from steptrace.analysis import report as report_view
from steptrace.report import RunDirError, find_run, load_run, percentile, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------
# Fixture helpers
# --------------------------------------------------------------------------


def step_record(step, interval, compute, idle=None, *, rank=0, world_size=1,
                tokens=1000, flops=1e12, mfu=None, status="ok", start=None, **extra):
    """A step record shaped like the SDK writes it; idle defaults to 'other'. ``start``: seconds
    after the run's origin the step starts (default ``10 * step``)."""
    idle = dict(idle) if idle is not None else {"other": interval - compute}
    start = 1_700_000_000.0 + (step * 10 if start is None else start)
    record = {
        "type": "step", "run_id": "r1", "rank": rank, "world_size": world_size,
        "step": step, "status": status, "backend": "cpu",
        "host_start_time": start, "host_end_time": start + interval,
        "dispatch_time": start, "start_time": start, "end_time": start + interval,
        "interval_seconds": interval, "compute_seconds": compute,
        "idle_seconds": sum(idle.values()), "idle_breakdown": idle,
        "idle_segments": [[k, start, start + v] for k, v in idle.items()],
        "tokens": tokens, "samples": 8 if tokens is not None else None,
        "flops": flops,
        "tokens_per_second": tokens / interval if tokens is not None else None,
        "samples_per_second": 8 / interval if tokens is not None else None,
        "tflops_per_second": flops / compute / 1e12 if flops is not None else None,
        "mfu": mfu, "attrs": {},
    }
    if status == "error":
        record["error"] = "RuntimeError: boom"
    record.update(extra)
    return record


def checkpoint_record(step, blocking, *, rank=0, async_seconds=None):
    return {
        "type": "checkpoint", "run_id": "r1", "rank": rank, "step": step,
        "start_time": 1_700_000_000.0, "end_time": 1_700_000_000.0 + blocking,
        "host_seconds": blocking, "blocking_seconds": blocking,
        "async_seconds": async_seconds, "status": "ok",
    }


def write_rank(run_dir: Path, rank: int, records, *, tail: str = "") -> Path:
    """Write records as JSONL; *tail* is appended raw (e.g. a truncated line)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"rank-{rank}.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


def three_steps():
    """Three steps with hand-checkable totals (see test_summarize_values), back to back from the run's
    origin (the checkpoint's start): the wall is 7 s."""
    return [
        step_record(1, 1.0, 0.8, {"data": 0.2}, mfu=0.1, start=0.0),
        step_record(2, 2.0, 1.0, {"checkpoint": 0.9, "other": 0.1}, mfu=0.2, start=1.0),
        step_record(3, 4.0, 3.0, {"data": 0.5, "eval": 0.5}, status="error", start=3.0),
    ]


@pytest.fixture
def small_run(tmp_path):
    run_dir = tmp_path / "steptrace-runs" / "r1"
    # Written out of order on purpose: load_run must sort by step.
    steps = three_steps()
    records = [steps[2], steps[0], checkpoint_record(2, 0.9), steps[1],
               {"type": "run", "run_id": "r1", "rank": 0, "world_size": 1,
                "dropped": {}, "steps": 3}]
    write_rank(run_dir, 0, records)
    return run_dir


def capture(run, **kwargs) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    report.render_report(run, console=console, **kwargs)
    return console.export_text()


# --------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = [3.0, 0.5, 7.25, 1.0, 9.0, 2.5, 4.0]
    for q in (0, 10, 25, 50, 75, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None
    assert percentile([4.0], 90) == 4.0


def test_summarize_values(small_run):
    run = load_run(small_run)
    s = summarize(run.steps(), run.checkpoints())
    assert s["steps"] == 3
    assert s["error_steps"] == 1
    assert s["interval_seconds"] == pytest.approx(7.0)
    assert s["compute_seconds"] == pytest.approx(4.8)
    # Not goodput (no process start here): Σ own compute / Σ interval, under its own name.
    assert s["compute_share_of_steps"] == pytest.approx(4.8 / 7.0) and "goodput" not in s
    assert s["compute_p50"] == pytest.approx(1.0)
    # sorted computes [0.8, 1.0, 3.0]: position 0.9 * 2 = 1.8 -> 1.0 + 0.8 * 2.0
    assert s["compute_p90"] == pytest.approx(2.6)
    assert s["interval_p50"] == pytest.approx(2.0)
    assert s["idle_breakdown_totals"] == pytest.approx(
        {"data": 0.7, "checkpoint": 0.9, "other": 0.1, "eval": 0.5})
    # Largest reason first.
    assert list(s["idle_breakdown_totals"])[0] == "checkpoint"
    assert s["tokens_per_second"] == pytest.approx(3000 / 7.0)
    assert s["tflops_per_second"] == pytest.approx(3e12 / 4.8 / 1e12)
    assert s["mfu"] == pytest.approx(0.15)  # the null mfu of step 3 is skipped
    assert s["checkpoints"] == 1
    assert s["checkpoint_blocking_seconds"] == pytest.approx(0.9)


def test_summarize_without_optional_fields():
    steps = [step_record(0, 1.0, 0.5, tokens=None, flops=None)]
    s = summarize(steps, [])
    assert s["tokens_per_second"] is None
    assert s["tflops_per_second"] is None
    assert s["mfu"] is None
    assert s["compute_share_of_steps"] == pytest.approx(0.5)

    empty = summarize([], [])
    assert empty["steps"] == 0
    assert empty["compute_share_of_steps"] is None
    assert empty["compute_p50"] is None
    assert empty["idle_breakdown_totals"] == {}


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def test_load_run_sorts_and_exposes_metadata(small_run):
    run = load_run(small_run)
    assert run.path == small_run
    assert run.ranks == [0]
    assert run.run_id == "r1"
    assert [s["step"] for s in run.steps(0)] == [1, 2, 3]
    assert [c["step"] for c in run.checkpoints()] == [2]
    assert run.dropped == {}
    assert run.warnings == []


def test_unknown_types_and_fields_are_ignored(tmp_path):
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [
        {"type": "future_thing", "payload": [1, 2, 3]},
        {"no_type": True},
        step_record(0, 1.0, 0.75, shiny_new_field={"x": 1}),
        {"type": "span", "run_id": "r1", "rank": 0, "name": "data", "step": 0,
         "start_time": 0.0, "end_time": 0.25, "seconds": 0.25, "attrs": {}},
    ])
    run = load_run(run_dir)
    assert len(run.steps()) == 1
    assert summarize(run.steps(), run.checkpoints())["compute_share_of_steps"] == pytest.approx(0.75)
    assert len(run.records("span")) == 1


def test_truncated_last_line_is_skipped_with_warning(tmp_path, capsys):
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [step_record(0, 1.0, 0.5), step_record(1, 1.0, 0.5)],
               tail='{"type": "step", "run_id": "r1", "st')
    run = load_run(run_dir)
    assert [s["step"] for s in run.steps()] == [0, 1]
    assert len(run.warnings) == 1
    assert "rank-0.jsonl: skipped 1 unreadable line (first: line 3" in run.warnings[0]
    assert "truncated" in run.warnings[0]

    # The CLI reports it on stderr and still succeeds.
    assert report.main([str(run_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "line 3" in captured.err
    assert json.loads(captured.out)["steps"] == 2


def test_truncated_multibyte_last_line_is_skipped(tmp_path):
    run_dir = tmp_path / "r1"
    path = write_rank(run_dir, 0, [step_record(0, 1.0, 0.5)])
    # A crash can cut a UTF-8 sequence in half.
    with path.open("ab") as f:
        f.write('{"type": "span", "name": "é'.encode()[:-1])
    run = load_run(run_dir)
    assert len(run.steps()) == 1
    assert "line 2" in run.warnings[0]


def test_a_torn_middle_line_costs_that_line_alone(tmp_path):
    """A restart with the same run_id after a crash, or a full disk, leaves a bad line mid-file."""
    run_dir = tmp_path / "steptrace-runs" / "r1"
    write_rank(run_dir, 0, [step_record(0, 1.0, 0.5), "{not json",
                            step_record(1, 1.0, 0.5), "[1, 2]", step_record(2, 1.0, 0.5)])
    run = load_run(run_dir)
    assert [s["step"] for s in run.steps()] == [0, 1, 2]
    (warning,) = run.warnings
    assert "skipped 2 unreadable lines" in warning and "line 2, invalid JSON" in warning
    assert list(run.skipped_lines.values()) == [2]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.lists(st.one_of(st.integers(min_value=0, max_value=10**6), st.sampled_from(
    ["{", "{\"type\": \"st", "null", "[1]", "\"text\"", "\x00\x01garbage", "{\"a\":"])), max_size=30))
def test_any_garbage_anywhere_is_skipped_and_counted(tmp_path, layout):
    run_dir = tmp_path / f"r{abs(hash(tuple(map(str, layout))))}"
    lines = [step_record(item, 1.0, 0.5) if isinstance(item, int) else item for item in layout]
    write_rank(run_dir, 0, [step_record(-1, 1.0, 0.5)] + lines)
    run = load_run(run_dir)
    good = [item for item in layout if isinstance(item, int)]
    assert sorted(s["step"] for s in run.steps()) == sorted([-1] + good)
    assert sum(run.skipped_lines.values()) == len(layout) - len(good)


def test_blank_lines_do_not_count_as_last_line(tmp_path):
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [step_record(0, 1.0, 0.5), "{broken", ""], tail="\n\n")
    run = load_run(run_dir)
    assert len(run.steps()) == 1
    assert "line 2" in run.warnings[0]


def test_missing_and_empty_dirs(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(RunDirError, match="nope: no such directory"):
        load_run(missing)

    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("hi")
    with pytest.raises(RunDirError, match="no rank-\\*.jsonl files"):
        find_run(empty)

    assert report.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("steptrace report: ")
    assert "nope" in err


def test_parent_run_dir_picks_newest_run(tmp_path):
    parent = tmp_path / "steptrace-runs"
    old = write_rank(parent / "old", 0, [step_record(0, 1.0, 0.5)])
    new = write_rank(parent / "new", 0, [step_record(0, 2.0, 1.0)])
    (parent / "stray").mkdir()  # newest entry, but holds no rank files
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    assert find_run(parent) == parent / "new"
    assert load_run(parent).steps()[0]["interval_seconds"] == 2.0

    # Appending to the old run makes it the most recent one.
    os.utime(old, (3_000_000, 3_000_000))
    assert find_run(parent) == parent / "old"


def test_unknown_rank_is_an_error(small_run):
    run = load_run(small_run)
    with pytest.raises(RunDirError, match="no rank 5"):
        run.steps(5)
    assert report.main([str(small_run), "--rank", "5"]) == 2


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------


def test_render_report_shows_steps_checkpoints_and_summary(small_run):
    text = capture(load_run(small_run))
    assert "Steps (rank 0)" in text
    assert "checkpoint 0.90, other 0.10" in text
    assert "data 0.50, eval 0.50" in text
    assert "RuntimeError: boom" in text
    assert "Checkpoints (rank 0)" in text
    # 4.8 s of compute over a 7 s wall, less the failed step's compute (wasted progress since issue 32).
    import re
    goodput = float(re.search(r"Goodput ([0-9.]+)%", text).group(1))
    assert 0 < goodput < round(4.8 / 7 * 100, 1)
    # Idle totals with percent of wall time: checkpoint 0.9 / 7.0 = 12.9%.
    assert "idle: checkpoint" in text and "12.9% of wall" in text
    assert "Per-rank summary" not in text
    assert "dropped" not in text


def test_the_checkpoint_table_says_which_step_a_save_numbered_by_steps_done_follows(tmp_path):
    """A save called `n` for the state after n steps runs before step n: its blocking counts from step
    n - 1's end, and the table says so in an `after step` column (left out when every save follows its
    own number)."""
    run_dir = tmp_path / "steptrace-runs" / "r1"
    steps = three_steps()
    saved_before_step_2 = dict(checkpoint_record(2, 0.9), after_step=1)
    write_rank(run_dir, 0, [steps[0], saved_before_step_2, steps[1], steps[2]])
    table = capture(load_run(run_dir)).split("Checkpoints (rank 0)")[1]
    header = next(line for line in table.splitlines() if "┃" in line)
    row = next(line for line in table.splitlines() if "│" in line)
    assert [c.strip() for c in header.split("┃")[1:5]] == ["step", "after step", "host s", "blocking s"]
    assert [c.strip() for c in row.split("│")[1:5]] == ["2", "1", "0.900", "0.900"]
    plain = tmp_path / "plain" / "r1"
    write_rank(plain, 0, [steps[0], steps[1], dict(checkpoint_record(2, 0.9), after_step=2), steps[2]])
    assert "after step" not in capture(load_run(plain))


def test_max_rows_keeps_the_notable_steps_and_says_how_many_it_left_out(tmp_path):
    """--max-rows keeps the first step, failures, checkpoint/eval/compile steps and the slowest,
    wherever they are (cutting the middle by position hid them), then evenly spaced others."""
    run_dir = tmp_path / "r1"
    records = []
    for i in range(100):
        n = 1000 + i  # step numbers that cannot collide with other table values
        idle = {"checkpoint": 5.0} if i == 40 else {"eval": 3.0} if i == 55 else {"other": 0.1}
        interval = 1.0 + sum(idle.values()) + (0.5 if i == 70 else 0.0) + i * 1e-4
        records.append(step_record(n, interval, interval - sum(idle.values()), idle, tokens=None,
                                   status="error" if i == 63 else "ok"))
    write_rank(run_dir, 0, records)
    text = capture(load_run(run_dir), max_rows=12)
    table = text[text.index("Steps (rank 0)"):text.index("Summary")]
    shown = [int(line.split("│")[1]) for line in table.splitlines() if line.startswith("│")]
    assert len(shown) == 12 and shown == sorted(shown)
    assert {1000, 1040, 1055, 1063, 1070} <= set(shown)  # first, checkpoint, eval, error, slowest
    assert "12 of 100 steps shown (first 1, failed 1, checkpoint/eval/compile 2, slowest 5, evenly spaced 3)" \
        in text and "88 left out" in text
    assert 1099 in shown  # the slowest of the rest (intervals grow with i)
    full = capture(load_run(run_dir), max_rows=0)
    assert "left out" not in full and "1050" in full


def test_notable_rows_fill_in_priority_order_when_short_of_room():
    steps = [{"step": i, "status": "ok", "interval_seconds": 1.0 + i / 100, "idle_breakdown": {}} for i in range(50)]
    steps[30]["status"] = "error"
    steps[10]["idle_breakdown"] = {"checkpoint": 1.0}
    rows, counts = report_view.notable_rows(steps, 3)
    assert [r["step"] for r in rows] == [0, 10, 30] and counts == {"first": 1, "failed": 1,
                                                                  "checkpoint/eval/compile": 1}
    assert report_view.notable_rows(steps, 50)[0] == steps  # room for all: all, in order


def test_columns_and_summary_rows_without_data_are_left_out(tmp_path):
    """No FLOPs, tokens or MFU given: no TFLOP/s, tokens/s or MFU column or summary row of dashes."""
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [step_record(i, 1.0, 0.9, tokens=None, flops=None) for i in range(3)])
    text = capture(load_run(run_dir))
    assert "FLOP/s" not in text and "tokens/s" not in text and "MFU" not in text
    assert "—" not in text
    write_rank(tmp_path / "r2", 0, [step_record(i, 1.0, 0.9, mfu=0.4) for i in range(3)])
    text = capture(load_run(tmp_path / "r2"))
    assert "TFLOP/s" in text and "tokens/s" in text and "40.0%" in text


def test_multi_rank_table_leaves_out_rates_no_rank_has(tmp_path):
    run_dir = tmp_path / "r1"
    for rank in (0, 1):
        write_rank(run_dir, rank, [step_record(s, 1.0, 0.5, rank=rank, world_size=2, tokens=None, flops=None)
                                   for s in range(3)])
    text = capture(load_run(run_dir))
    per_rank = text[text.index("Per-rank summary"):]
    assert "tok/s" not in per_rank and "FLOP/s" not in per_rank and "top idle" in per_rank


def test_flop_rates_keep_three_significant_figures_on_small_and_large_devices(tmp_path):
    """issue 49: a small device's 0.00-0.03 TFLOP/s (two decimals) hid the spread between steps."""
    assert [report_view.flops_rate(v) for v in (0.0312, 0.00049, 12.345, 1632.088, 999.7, 0.0, None)] == [
        "31.2 GFLOP/s", "490 MFLOP/s", "12.3 TFLOP/s", "1.63 PFLOP/s", "1.00 PFLOP/s", "0 TFLOP/s", "—"]
    run_dir = tmp_path / "small"
    # 3.1e9 and 4.6e9 FLOPs in 0.1 s of compute: 0.031 and 0.046 TFLOP/s, "0.03" and "0.05" in two decimals.
    write_rank(run_dir, 0, [step_record(0, 0.12, 0.1, flops=3.1e9), step_record(1, 0.12, 0.1, flops=4.6e9)])
    text = capture(load_run(run_dir), max_rows=0)
    assert "31.0 GFLOP/s" in text and "46.0 GFLOP/s" in text
    assert "38.5 GFLOP/s" in text  # the summary: Σ FLOPs / Σ compute


def test_report_width_follows_the_option_the_terminal_or_columns_else_never_wraps(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("COLUMNS", raising=False)
    assert report_view.report_width(None, io.StringIO()) == report_view.UNWRAPPED_WIDTH
    assert report_view.report_width(None, Tty()) is None  # rich asks the terminal
    assert report_view.report_width(132, io.StringIO()) == 132
    monkeypatch.setenv("COLUMNS", "100")
    assert report_view.report_width(None, io.StringIO()) == 100


def test_piped_report_keeps_one_line_per_step(tmp_path):
    """Written to a pipe, a report used to wrap its step table at 80 columns (3-6 lines a step)."""
    import subprocess
    import sys

    run_dir = tmp_path / "r1"
    idle = {"checkpoint": 1.5, "data": 0.25, "other": 0.1}
    write_rank(run_dir, 0, [step_record(i, 3.0, 1.15, idle, mfu=0.4,
                                        status="error" if i == 2 else "ok") for i in range(5)])
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir)], capture_output=True,
                         text=True, env=env, check=True).stdout
    table = out[out.index("Steps (rank 0)"):out.index("Summary")]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert len(rows) == 5 and "checkpoint 1.50, data 0.25, other 0.10" in rows[0]
    assert max(len(line) for line in out.splitlines()) > 80
    narrow = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir), "--width", "60"],
                            capture_output=True, text=True, env=env, check=True).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 60


def test_multi_rank_report(tmp_path):
    run_dir = tmp_path / "r1"
    for rank, compute in ((0, 0.5), (1, 0.25)):
        write_rank(run_dir, rank, [
            step_record(s, 1.0, compute, rank=rank, world_size=2, start=float(s)) for s in range(3)
        ] + [{"type": "run", "run_id": "r1", "rank": rank, "world_size": 2,
              "dropped": {"queue_full": 2 + rank}, "steps": 3}])
    run = load_run(run_dir)
    assert run.ranks == [0, 1]
    assert run.dropped == {"queue_full": 5}

    text = capture(run)
    assert "Steps (rank 0)" in text
    assert "Per-rank summary" in text
    # One summary row per rank (cells: rank, steps, wall, goodput, ...).
    per_rank = text[text.index("Per-rank summary"):]
    rows = [[c.strip() for c in line.split("│")[1:-1]]
            for line in per_rank.splitlines() if line.startswith("│")]
    assert [(r[0], r[1], r[3]) for r in rows] == [("0", "3", "50.0%"),
                                                  ("1", "3", "25.0%")]
    assert "queue_full=5" in text

    text1 = capture(run, rank=1)
    assert "Steps (rank 1)" in text1 and "Summary (rank 1)" in text1


def test_top_reasons_largest_first_without_noise():
    assert report_view._top_reasons({"other": 0.001, "checkpoint": 18.6, "data": 0.01}) == (
        "checkpoint 18.60, data 0.01")
    assert report_view._top_reasons({"a": 4, "b": 3, "c": 2, "d": 1}) == "a 4.00, b 3.00, c 2.00"
    assert report_view._top_reasons(None) == ""


def test_warnings_rendered(tmp_path):
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [step_record(0, 1.0, 0.5)], tail="{")
    run = load_run(run_dir)
    assert "warning:" in capture(run)
    assert "warning:" not in capture(run, show_warnings=False)


# --------------------------------------------------------------------------
# CLI and plot
# --------------------------------------------------------------------------


def test_cli_json(small_run, capsys):
    assert report.main([str(small_run), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    # The failed step's compute is wasted progress (issue 32 item 4), not productive: below 4.8 / 7.
    assert 0 < payload["goodput"] < 4.8 / 7.0
    assert payload["run_id"] == "r1"
    assert payload["rank"] == 0
    assert payload["idle_breakdown_totals"]["checkpoint"] == pytest.approx(0.9)


def test_cli_tables(small_run, capsys):
    assert report.main([str(small_run.parent), "--max-rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "Steps (rank 0)" in out
    assert "2 of 3 steps shown" in out and "1 left out" in out


def test_cli_plot_writes_png(small_run, tmp_path, capsys):
    # Add a user-defined idle reason so the plot needs a hashed colour too.
    write_rank(small_run, 1, [
        step_record(1, 1.0, 0.5, {"my_span": 0.3, "other": 0.2}, rank=1),
        step_record(3, 1.0, 0.6, {"data": 0.4}, rank=1),
    ])
    out_png = tmp_path / "timeline.png"
    assert report.main([str(small_run), "--plot", str(out_png), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    data = out_png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000

    out1 = tmp_path / "rank1.png"
    assert report.plot_timeline(load_run(small_run), out1, rank=1) == out1
    assert out1.read_bytes().startswith(PNG_SIGNATURE)


def test_reason_colours_are_stable():
    # Built-in reasons have fixed colours; user reasons hash (crc32, not the
    # per-process salted hash()) into a palette distinct from the fixed ones.
    assert palette.reason_colour("checkpoint") == "#d62728"
    user = palette.reason_colour("my_span")
    assert user in palette._USER_PALETTE
    assert user not in palette.REASON_COLOURS.values()
    assert palette.reason_order(["other", "zeta", "data", "alpha", "checkpoint"]) == [
        "checkpoint", "data", "alpha", "zeta", "other"]


def test_plot_long_run_uses_bands(tmp_path):
    run_dir = tmp_path / "r1"
    steps = [step_record(i, 0.6, 0.5, {"data": 0.1}) for i in range(plotting._MAX_BARS + 100)]
    write_rank(run_dir, 0, steps + [checkpoint_record(10, 0.2)])
    out = report.plot_timeline(load_run(run_dir), tmp_path / "long.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_import_is_cheap():
    # rich and matplotlib are imported lazily.  Check in a fresh interpreter,
    # counting only modules that importing steptrace.report itself pulls in.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import steptrace\n"
        "before = set(sys.modules)\n"
        "import steptrace.report\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.split('.')[0] in ('rich', 'matplotlib')))\n"
    )
    package_parent = str(Path(report.__file__).parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"



def test_report_shows_logged_scalars_and_peak_memory(tmp_path):
    from steptrace.analysis.summary import summarize

    steps = [{"type": "step", "step": n, "interval_seconds": 1.0, "compute_seconds": 0.5,
              "scalars": {"loss": 3.0 - n},
              "device_memory": {"peak_bytes": 2**30 * (n + 1), "peak_percent": 10.0 * (n + 1)}}
             for n in range(3)]
    summary = summarize(steps)
    assert summary["scalars"]["loss"] == {"last": 1.0, "mean": 2.0}
    assert (summary["memory_peak_bytes"], summary["memory_peak_percent"]) == (3 * 2**30, 30.0)
    console = Console(file=io.StringIO(), width=200)
    from steptrace.analysis.goodput import job_accounting
    from steptrace.analysis.report import _summary_panel

    console.print(_summary_panel(summary, job_accounting(steps), "r"))
    text = console.file.getvalue()
    assert "loss" in text and "3.00 GiB" in text and "30.0% of the device's limit" in text
    assert summarize(steps[:0])["memory_peak_bytes"] is None


def test_mfu_and_hfu_are_sums_over_compute_with_their_formula_line(tmp_path):
    """MFU = Σ model FLOPs / Σ compute / peak (like TFLOP/s, not a mean of ratios); the report shows
    each part and the division; without a peak it says why there is no ratio."""
    run_dir = tmp_path / "steptrace-runs" / "f"
    steps = [step_record(1, 1.0, 1.0, {}), step_record(2, 3.0, 3.0, {})]
    for s in steps:
        s.update(model_flops=2e12, hardware_flops=3e12, flops_source="xla_cost_analysis", peak_flops=1e13,
                 flops=3e12)
    write_rank(run_dir, 0, steps)
    summary = summarize(load_run(run_dir).steps())
    assert summary["mfu"] == pytest.approx(4e12 / 4.0 / 1e13)
    assert summary["hfu"] == pytest.approx(6e12 / 4.0 / 1e13)
    assert summary["model_flops_per_step"] == 2e12 and summary["hardware_flops_per_step"] == 3e12
    text = capture(load_run(run_dir))
    assert "= model FLOPs / compute s / peak = 1.000 / 10.0 TFLOP/s" in text
    assert "= hardware FLOPs / compute s / peak = 1.500 / 10.0 TFLOP/s" in text
    assert "from xla_cost_analysis" in text
    for s in steps:
        s.update(peak_flops=None, mfu=None, hfu=None)
    write_rank(run_dir, 0, steps)
    assert "no peak for this device" in capture(load_run(run_dir))


def test_checkpoint_blocking_and_idle_checkpoint_that_differ_say_why(tmp_path):
    """issue 49: ``checkpoint blocking 0.767 s`` beside ``idle: checkpoint 0.768 s``, without a word on the
    0.2 ms between them. Here the second step waits 0.2 s for an async commit outside any save (orbax's
    ``wait_until_finished``, a ``checkpoint`` span): idle checkpoint, not a save's blocking."""
    run_dir = tmp_path / "r1"
    write_rank(run_dir, 0, [
        step_record(1, 1.0, 0.5, {"checkpoint": 0.5}, start=0.0), checkpoint_record(1, 0.5),
        step_record(2, 1.0, 0.8, {"checkpoint": 0.2}, start=1.0),
        {"type": "span", "run_id": "r1", "rank": 0, "name": "checkpoint", "step": None,
         "start_time": 1_700_000_001.0, "end_time": 1_700_000_001.2, "seconds": 0.2, "attrs": {}},
    ])
    text = capture(load_run(run_dir))
    line = next(line for line in text.splitlines() if "checkpoint blocking" in line)
    assert "0.500 s" in line and "idle: checkpoint +200.0 ms: such as waits for an async commit" in line
    assert "DeepSpeed's decoupled commit" in report_view.checkpoint_gap_note(0.5, 0.7)  # not orbax's names only
    assert "idle: checkpoint" in text and "0.700 s" in text
    assert report_view.checkpoint_gap_note(0.7672, 0.7674) == ""  # the same to the millisecond: no note
    assert report_view.checkpoint_gap_note(0.768, 0.7673).startswith("; idle: checkpoint -0.7 ms: such as a span")


def test_compile_by_function_tells_new_signatures_from_recompiles_and_folds_where():
    """issue 49: the demo's ``jit(broadcast_in_dim)``, compiled for 5 shapes outside a step, read
    "compiled 5×: outside a step, outside a step, ...; recompiled". A compile for a new signature is
    another program (``attrs.program`` differs), not a recompile; each place is named once with its count.
    Records without fingerprints (older steptrace) say only how many times, and claim no recompile."""
    from steptrace.analysis.summary import compile_by_function, compile_sentence

    def compile_span(function, step, program=None, seconds=0.01, event="backend_compile_duration"):
        attrs = {"event": event, "function": function}
        if program is not None:
            attrs["program"] = program
        return {"type": "span", "name": "compile", "step": step, "seconds": seconds, "attrs": attrs}

    spans = [compile_span("jit(broadcast_in_dim)", None, f"{i:016x}") for i in range(5)]
    spans += [compile_span("jit(broadcast_in_dim)", None, seconds=0.5, event="jaxpr_trace_duration")]
    spans += [compile_span("jit(step)", 0, "a" * 16, 2.0), compile_span("jit(step)", 4, "a" * 16, 2.0),
              compile_span("jit(step)", 6, "a" * 16, 2.0)]
    spans += [compile_span("jit(old)", None, seconds=0.2), compile_span("jit(old)", None, seconds=0.2),
              compile_span("jit(old)", 4, seconds=0.2)]
    spans += [compile_span("jit(mixed)", 1, "b" * 16, 0.05), compile_span("jit(mixed)", 2, None, 0.05)]
    by_function = compile_by_function(spans)
    assert list(by_function) == ["jit(step)", "jit(old)", "jit(broadcast_in_dim)", "jit(mixed)"]
    assert by_function["jit(broadcast_in_dim)"] == {
        "seconds": pytest.approx(0.55), "compiles": 5, "steps": [None] * 5, "programs": 5, "recompiles": 0,
        "recompile_steps": []}
    assert by_function["jit(step)"]["programs"] == 1 and by_function["jit(step)"]["recompiles"] == 2
    assert by_function["jit(step)"]["recompile_steps"] == [4, 6]
    for unknown in ("jit(old)", "jit(mixed)"):
        assert by_function[unknown]["programs"] is None and by_function[unknown]["recompiles"] is None
    assert compile_sentence(by_function) == (
        "jit(step) 6.000 s (the same program recompiled 2×: step 4, step 6); "
        "jit(old) 0.600 s (compiled 3×: outside a step (2×), step 4); "
        "jit(broadcast_in_dim) 0.550 s (compiled for 5 signatures: outside a step (5×)); "
        "jit(mixed) 0.100 s (compiled 2×: step 1, step 2)")
    assert compile_sentence(by_function, limit=1) == (
        "jit(step) 6.000 s (the same program recompiled 2×: step 4, step 6); 3 more")


def test_steps_beside_an_async_commit_are_named_with_their_compute_against_the_typical_step(tmp_path, capsys):
    """issue 49: on JAX CPU, a step beside orbax's async commit computes longer (measured against the XLA
    trace: the commit's threads share the cores) and its observed end can be late (a collection on the
    commit's thread holds the GIL). The report names those steps and their compute against the typical
    step's, says why, and --json carries it; a commit beside steps of typical compute is not named."""
    from steptrace import _cli

    origin = 1_700_000_000.0
    steps = [step_record(n, 0.1, 0.19 if n in (5, 6, 7) else 0.1, start=n * 1.0, end_source="observed")
             for n in range(12)]
    # Saved after step 4 (host end 4.2 s), committed for 3.3 s: beside steps 5, 6 and 7 (5.0-7.1 s).
    slow = {**checkpoint_record(4, 0.1, async_seconds=3.3), "start_time": origin + 4.1, "end_time": origin + 4.2}
    # Saved after step 8, committed beside steps 9 and 10, whose compute is typical.
    quiet = {**checkpoint_record(8, 0.1, async_seconds=2.0), "start_time": origin + 8.1, "end_time": origin + 8.2}
    sync = {**checkpoint_record(10, 0.1), "start_time": origin + 10.1, "end_time": origin + 10.2}
    write_rank(tmp_path / "r1", 0, steps + [slow, quiet, sync])
    run = load_run(tmp_path / "r1")
    from steptrace.analysis.summary import compute_beside_commits

    entries = compute_beside_commits(run.steps(0), run.checkpoints(0))
    assert [(e["step"], e["steps"]) for e in entries] == [(4, [5, 6, 7]), (8, [9, 10])]
    assert entries[0]["compute_seconds"] == pytest.approx(0.57)
    assert entries[0]["typical_compute_seconds"] == pytest.approx(0.1)
    assert entries[0]["ratio"] == pytest.approx(1.9) and entries[1]["ratio"] == pytest.approx(1.0)
    assert entries[0]["async_seconds"] == pytest.approx(3.3)

    assert _cli.main(["report", str(tmp_path / "r1"), "--width", "400"]) == 0
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("Compute beside async commits")]
    assert ("checkpoint 4's commit (3.300 s) ran beside steps 5–7: compute 1.90× the typical step's (0.570 s; "
            "typical 0.100 s). Why: JAX, no device clock: on CPU the commit's threads share the cores") in line
    assert "checkpoint 8" not in line and "garbage collection on the commit's thread holds the GIL" in line
    assert _cli.main(["report", str(tmp_path / "r1"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [e["steps"] for e in payload["compute_beside_commits"]] == [[5, 6, 7], [9, 10]]

    # Without an async commit (or with steps of typical compute only) there is no line.
    write_rank(tmp_path / "r2", 0, steps[:5] + [sync])
    assert _cli.main(["report", str(tmp_path / "r2"), "--width", "400"]) == 0
    assert "Compute beside async commits" not in capsys.readouterr().out
