"""The first step after a restore: marked on its record, its one-off cost separated (docs/goodput.md).

A ``restore`` span (``steptrace.restore()``, which every framework hook writes) closed between
steps marks the next step ``first_after_restore: true``; the analysis separates its one-off cost
(``one_off_seconds`` = its interval − the run's typical step interval) in the report, compare and
the job's accounting, which still adds up exactly. The hooks themselves are tested against the real
frameworks in test_maxtext.py, test_megatron.py and test_axlearn.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

import steptrace
from steptrace.adapters._hooks import NothingRestored, timed_restore
from steptrace.analysis.compare import compare_runs, steady_steps
from steptrace.analysis.goodput import BUCKETS, job_accounting
from steptrace.analysis.runs import load_run
from steptrace.analysis.summary import after_restore_costs, typical_step_interval
from steptrace.testing import capture


def _nothing(_: object) -> int:
    raise NothingRestored


def test_the_step_after_a_restore_is_marked_and_no_other():
    with capture() as sink:
        with steptrace.step(0):
            pass
        with steptrace.restore(0):
            pass
        for n in (1, 2):
            with steptrace.step(n):
                pass
    marked = {s["step"]: s.get("first_after_restore") for s in sink.steps()}
    assert marked == {0: None, 1: True, 2: None}
    (span,) = [s for s in sink.spans() if s["name"] == "restore"]
    assert span["attrs"] == {"restored_step": 0} and span["step"] is None


def test_the_hooks_restore_carries_the_step_it_restored_and_a_restore_that_found_nothing_marks_no_step():
    with capture() as sink:
        assert timed_restore(lambda: (None, None), _nothing) == (None, None)  # nothing to restore
        with steptrace.step(0):
            pass
        assert timed_restore(lambda: ("state", 7), lambda result: result[1]) == ("state", 7)
        with steptrace.step(8):
            # A restore inside a step (a hook that reloads a shard) is that step's idle, not a restart.
            timed_restore(lambda: 1, lambda result: result)
        with steptrace.step(9):
            pass
    spans = [s for s in sink.spans() if s["name"] == "restore"]
    assert [s["attrs"] for s in spans] == [{"restored": False}, {"restored_step": 7}, {"restored_step": 1}]
    assert {s["step"]: s.get("first_after_restore") for s in sink.steps()} == {0: None, 8: True, 9: None}


def test_a_failing_restore_propagates_unchanged_and_is_still_timed():
    with capture() as sink:
        with pytest.raises(OSError, match="no such checkpoint"):
            timed_restore(lambda: (_ for _ in ()).throw(OSError("no such checkpoint")), lambda r: 3)
    (span,) = [s for s in sink.spans() if s["name"] == "restore"]
    assert span["attrs"] == {"restored": False, "error": "OSError: no such checkpoint"}  # issue 48: not a restore


def _step(attempt, n, start, interval, compute, **extra):
    record = {"type": "step", "attempt": attempt, "step": n, "status": "ok", "host_start_time": start,
              "end_time": start + interval, "interval_seconds": interval, "compute_seconds": compute,
              "idle_breakdown": {"compile": interval - compute} if interval > compute else {}}
    record.update(extra)
    return record


def test_the_one_off_cost_of_the_first_step_after_a_restore_is_start_up_and_the_accounting_adds_up():
    """Attempt 0: steps 0-3 of 1 s from 1 s (0.75 s compute); it crashes. Attempt 1 (from 10 s)
    restores step 1 (1 s) and resumes at step 2: 4 s of interval, 1 s of it compile idle and 3 s
    compute; steps 3-4 of 1 s. The typical step is 1 s (steps 1, 3, 4: not an attempt's first, not
    a first after a restore): the one-off is 3 s, of which 2 s is compute (start-up, not productive)
    and 1 s compile (already badput)."""
    records = [
        {"type": "attempt", "attempt": 0, "start_time": 0.0, "init_time": 0.5},
        _step(0, 0, 1.0, 1.0, 0.75, before_step_seconds=0.5, before_step_breakdown={"startup": 0.5}),
        _step(0, 1, 2.0, 1.0, 0.75), _step(0, 2, 3.0, 1.0, 0.75), _step(0, 3, 4.0, 1.0, 0.75),
        {"type": "attempt", "attempt": 1, "start_time": 10.0, "init_time": 10.5},
        _step(1, 2, 12.5, 4.0, 3.0, before_step_seconds=2.0, before_step_breakdown={"restore": 1.0, "startup": 1.0},
              first_after_restore=True),
        _step(1, 3, 16.5, 1.0, 1.0), _step(1, 4, 17.5, 1.0, 1.0),
        {"type": "run", "attempt": 1},
    ]
    job = job_accounting(records)
    assert job["after_restore"] == [{"attempt": 1, "step": 2, "interval_seconds": 4.0,
                                     "typical_step_interval_seconds": 1.0, "one_off_seconds": 3.0,
                                     "one_off_compute_seconds": 2.0}]
    assert job["total_seconds"] == 18.5
    # Kept: steps 0, 1 (0.75 each), 2 (3 s compute less the 2 s one-off), 3, 4 (1 each).
    assert job["productive_seconds"] == 0.75 * 2 + 1.0 + 2.0
    assert job["badput"]["startup"] == 0.5 + 0.5 + 0.5 + 1.0 + 2.0
    assert job["badput"]["compile"] == 0.25 * 2 + 1.0
    assert job["badput"]["restore"] == 1.0 and job["badput"]["wasted"] == 2.0
    assert set(job["badput"]) == set(BUCKETS)
    assert job["productive_seconds"] + math.fsum(job["badput"].values()) == pytest.approx(job["total_seconds"],
                                                                                        abs=1e-12)
    # Without the mark, the same records count the warm-up as productive (the change is the mark's).
    unmarked = job_accounting([{k: v for k, v in r.items() if k != "first_after_restore"} for r in records])
    assert unmarked["productive_seconds"] == job["productive_seconds"] + 2.0 and unmarked["after_restore"] == []


def test_the_typical_step_leaves_out_every_step_with_one_off_costs():
    steps = [_step(0, 0, 0.0, 9.0, 9.0), _step(0, 1, 9.0, 1.0, 1.0), _step(0, 2, 10.0, 3.0, 3.0),
             _step(1, 3, 20.0, 8.0, 8.0), _step(1, 4, 28.0, 2.0, 2.0),
             _step(1, 5, 30.0, 7.0, 7.0, first_after_restore=True)]
    assert typical_step_interval(steps) == 2.0  # median of 1, 3, 2
    (cost,) = after_restore_costs(steps)
    assert (cost["step"], cost["one_off_seconds"], cost["one_off_compute_seconds"]) == (5, 5.0, 5.0)
    assert after_restore_costs(steps[-1:])[0]["one_off_seconds"] is None  # no typical step to compare with


def _restarted_run(run_dir, run_id: str, warm_s: float) -> None:
    """Two attempts of one run in this process: steps 0-5, then a restore of step 5 and steps 6-11,
    the first of which is ``warm_s`` slower (its warm-up)."""
    for attempt, steps in ((0, range(0, 6)), (1, range(6, 12))):
        steptrace.init(run_dir=str(run_dir), run_id=run_id, attempt=attempt)
        if attempt:
            with steptrace.restore(5):
                time.sleep(0.01)
        for n in steps:
            with steptrace.step(n):
                time.sleep(0.01 + (warm_s if n == 6 else 0.0))
        steptrace.shutdown()


def test_report_and_compare_show_the_first_step_after_a_restore_and_do_not_call_it_a_regression(tmp_path):
    _restarted_run(tmp_path, "warm", warm_s=0.3)
    _restarted_run(tmp_path, "cold", warm_s=0.0)
    warm = load_run(tmp_path / "warm")
    steps = warm.steps(0)
    (first,) = [s for s in steps if s.get("first_after_restore")]
    assert first["step"] == 6 and first["attempt"] == 1
    typical = typical_step_interval(steps)
    assert first not in steady_steps(steps)

    out = subprocess.run([sys.executable, "-m", "steptrace", "report", str(tmp_path / "warm"), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job"]
    (cost,) = job["after_restore"]
    assert cost["step"] == 6 and cost["typical_step_interval_seconds"] == pytest.approx(typical, abs=1e-12)
    assert cost["one_off_seconds"] == pytest.approx(first["interval_seconds"] - typical, abs=1e-12)
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-6)
    text = subprocess.run([sys.executable, "-m", "steptrace", "report", str(tmp_path / "warm")],
                          capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert text.returncode == 0, text.stderr
    assert "First step after a restore" in text.stdout and f"one-off {cost['one_off_seconds']:.3f} s" in text.stdout

    result = compare_runs(load_run(tmp_path / "cold"), warm)
    rows = {row.metric: row for row in result["rows"]}
    # Both runs' steady steps are the same 10 ms steps: the warm-up is no regression of the steps...
    assert rows["interval_median"].verdict != "regression"
    # ...and is shown as what it is, the restarts' one-off cost.
    assert rows["after_restore_one_off"].b == pytest.approx(cost["one_off_seconds"], abs=1e-12)


def test_the_otlp_step_span_of_the_first_step_after_a_restore_says_so():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="OTLP export needs steptrace[otlp]")
    from otlp_receiver import OtlpHttpReceiver

    with OtlpHttpReceiver() as receiver:
        steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id="r")
        with steptrace.restore(3):
            pass
        for n in (4, 5):
            with steptrace.step(n):
                pass
        steptrace.shutdown(timeout_s=10)
        spans = {s.attributes["train.step"]: s.attributes for s in receiver.spans() if s.name == "train.step"}
    assert spans[4]["train.first_after_restore"] is True
    assert "train.first_after_restore" not in spans[5]


def test_a_restore_that_raised_is_a_span_with_its_error_and_marks_no_step():
    """Issue 48: a restore block that raised restored nothing. Its span is written (the time was spent) with
    the error and ``restored: false``; the next step is not ``first_after_restore``, and the accounting gives
    it no restore's one-off cost. The exception reaches the caller unchanged."""
    with capture() as sink:
        with steptrace.step(0):
            pass
        with pytest.raises(FileNotFoundError, match="no checkpoint at /ckpt/7"):
            with steptrace.restore(7):
                raise FileNotFoundError("no checkpoint at /ckpt/7")
        for n in (1, 2):
            with steptrace.step(n):
                pass
        with pytest.raises(OSError):
            timed_restore(lambda: (_ for _ in ()).throw(OSError("disk gone")), lambda result: 3)
        with steptrace.step(3):
            pass
        with steptrace.restore(3):  # one that worked still marks the next step
            pass
        with steptrace.step(4):
            pass
    marked = {s["step"]: s.get("first_after_restore") for s in sink.steps()}
    assert marked == {0: None, 1: None, 2: None, 3: None, 4: True}
    spans = [s for s in sink.spans() if s["name"] == "restore"]
    assert [s["attrs"] for s in spans] == [
        {"restored_step": 7, "restored": False, "error": "FileNotFoundError: no checkpoint at /ckpt/7"},
        {"restored": False, "error": "OSError: disk gone"},
        {"restored_step": 3}]
    assert all(s["seconds"] >= 0 for s in spans)
