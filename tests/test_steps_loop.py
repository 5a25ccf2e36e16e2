"""``steptrace.steps()``: a loop body that raises, and a loop left while a variable holds the generator
(issue 32, items 4 and 5).

A ``for`` loop never tells its iterator why it stopped: ``steps()`` learns it from where the loop's
frame is when the generator is closed or when steptrace is next called (``steptrace/_loops.py``).
Each test runs the same loop in the ``with steptrace.step(n)`` form where that form has an answer,
and asserts the two agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

import steptrace
from steptrace.testing import capture


def _boom_with(n_fail: int) -> None:
    for n in range(5):
        with steptrace.step(n):
            if n == n_fail:
                raise ValueError("boom")


def _boom_steps(n_fail: int) -> None:
    for n, _ in steptrace.steps(range(5)):
        if n == n_fail:
            raise ValueError("boom")


# -- item 4: a body that raised is an error step ------------------------------------------------------
def test_a_steps_body_that_raises_into_a_handler_is_the_error_step_the_with_form_records():
    """The handler calls steptrace (here: flush): the exception is read there, exactly as `with` has it."""
    recorded = {}
    for form, loop in (("with", _boom_with), ("steps", _boom_steps)):
        with capture(strict=False) as sink:
            try:
                loop(2)
            except ValueError:
                assert steptrace.flush(timeout_s=10)
            with steptrace.step(10):  # training goes on after the handler
                pass
        recorded[form] = sink.steps()
    with_form, steps_form = recorded["with"], recorded["steps"]
    assert [(r["step"], r["status"], r.get("error")) for r in steps_form] == [
        (0, "ok", None), (1, "ok", None), (2, "error", "ValueError: boom"), (10, "ok", None)]
    assert [(r["step"], r["status"], r.get("error")) for r in steps_form] == [
        (r["step"], r["status"], r.get("error")) for r in with_form]
    assert [sorted(r) for r in steps_form] == [sorted(r) for r in with_form]  # the same record fields


def test_a_steps_body_that_raises_out_of_the_program_records_its_exception():
    """Uncaught: the program dies with the exception; the step's record names it (read at exit)."""
    script = textwrap.dedent("""
        import sys, time, steptrace
        steptrace.init(run_dir=sys.argv[1], run_id=sys.argv[2], backend="host")
        if sys.argv[2] == "with":
            for n in range(5):
                with steptrace.step(n):
                    time.sleep(0.002)
                    if n == 3:
                        raise ValueError("boom at 3")
        else:
            for n, _ in steptrace.steps(range(5)):
                time.sleep(0.002)
                if n == 3:
                    raise ValueError("boom at 3")
    """)
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        records = {}
        for form in ("with", "steps"):
            proc = subprocess.run([sys.executable, "-c", script, run_dir, form], capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 1 and "ValueError: boom at 3" in proc.stderr
            with open(f"{run_dir}/{form}/rank-0.jsonl") as handle:
                records[form] = [json.loads(line) for line in handle]
    for form in ("with", "steps"):
        steps = [r for r in records[form] if r["type"] == "step"]
        assert [(r["step"], r["status"], r.get("error")) for r in steps] == [
            (0, "ok", None), (1, "ok", None), (2, "ok", None), (3, "error", "ValueError: boom at 3")], form
        (run,) = [r for r in records[form] if r["type"] == "run"]
        assert run["dropped"] == {}, form  # nothing refused, nothing left unresolved
    assert [sorted(r) for r in records["steps"] if r["type"] == "step"] == [
        sorted(r) for r in records["with"] if r["type"] == "step"]


def test_a_steps_body_whose_exception_is_handled_unseen_is_still_an_error_step():
    """No steptrace call in the handler: the exception's text is gone, the failure is not: the step is
    an error, its text says where the loop body raised (this file, the raising line)."""
    with capture(strict=False) as sink:
        with pytest.raises(ValueError):
            _boom_steps(1)
        with steptrace.step(7):
            pass
    steps = sink.steps()
    assert [(r["step"], r["status"]) for r in steps] == [(0, "ok"), (1, "error"), (7, "ok")]
    line = _boom_steps.__code__.co_firstlineno + 3
    assert steps[1]["error"] == f"exception left the steps() loop body at test_steps_loop.py:{line}"


def test_a_failed_step_is_wasted_progress_not_productive_in_either_form():
    """The job's accounting: a failed step's compute is not productive; its whole interval is wasted
    progress (docs/goodput.md), whichever form recorded it; the summary counts it as an error step."""
    import math

    from steptrace.analysis.goodput import job_accounting
    from steptrace.analysis.summary import summarize

    def slow_boom_with() -> None:
        for n in range(4):
            with steptrace.step(n):
                time.sleep(0.02)
                if n == 2:
                    raise ValueError("boom")

    def slow_boom_steps() -> None:
        for n, _ in steptrace.steps(range(4)):
            time.sleep(0.02)
            if n == 2:
                raise ValueError("boom")

    for form, loop in (("with", slow_boom_with), ("steps", slow_boom_steps)):
        with capture(strict=False) as sink:
            try:
                loop()
            except ValueError:
                steptrace.flush(timeout_s=10)
            with steptrace.step(3):
                time.sleep(0.02)
        steps = sink.steps()
        assert [r["status"] for r in steps] == ["ok", "ok", "error", "ok"], form
        job = job_accounting(sink.records)
        ok_compute = math.fsum(r["compute_seconds"] for r in steps if r["status"] == "ok")
        assert job["productive_seconds"] == pytest.approx(ok_compute, abs=1e-9), form
        assert job["badput"]["wasted"] == pytest.approx(steps[2]["interval_seconds"], abs=1e-9), form
        assert (job["kept_steps"], job["wasted_steps"]) == (3, 1), form
        assert summarize(steps)["error_steps"] == 1, form


def test_a_break_out_of_steps_is_an_ok_step_ended_at_the_break():
    with capture() as sink:
        for n, _ in steptrace.steps(range(10)):
            if n == 2:
                break
        time.sleep(0.05)  # after the loop: not step 2's time
        with steptrace.step(3):
            pass
    steps = sink.steps()
    assert [(r["step"], r["status"]) for r in steps] == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "ok")]
    # Ended when the loop let go of the generator, right after the break: not 50 ms later.
    assert steps[2]["host_end_time"] < steps[3]["host_start_time"] - 0.04


# -- item 5: a loop left while a variable still holds the generator ------------------------------------
def test_a_break_while_the_generator_is_held_ends_the_step_at_the_next_steptrace_call():
    """The issue's probe: `it` keeps the generator alive past the loop; the eval after it and the next
    four `with step()` are steptrace's own, none refused as nested."""
    with capture(strict=True) as sink:
        it = steptrace.steps(range(100))
        for n, _ in it:
            if n == 3:
                break
        time.sleep(0.02)  # the loop is left: nothing of this is step 3's
        with steptrace.span("eval"):
            time.sleep(0.01)
        for m in range(4, 8):
            with steptrace.step(m):
                pass
        assert it is not None  # still held
    steps = sink.steps()
    assert [(r["step"], r["status"]) for r in steps] == [(n, "ok") for n in range(8)]
    (run,) = sink.of_type("run")
    assert run["dropped"] == {}  # no misuse: nothing refused
    (eval_span,) = [s for s in sink.spans() if s["name"] == "eval"]
    # Step 3 ended at the latest when eval began (the next steptrace call), the eval is not inside it:
    assert steps[3]["host_end_time"] <= eval_span["start_time"]
    assert eval_span["step"] is None
    assert steps[4]["idle_breakdown"].get("eval", 0) > 0.005  # the eval is idle time before step 4


def test_a_held_generator_left_then_closed_ends_its_step_when_closed():
    """Nothing calls steptrace after the break: the generator's close is the first moment it is known."""
    with capture() as sink:
        it = steptrace.steps(range(100))
        for n, _ in it:
            if n == 1:
                break
        time.sleep(0.02)
        it.close()
        assert steptrace.current_step() is None
        with steptrace.step(2):
            pass
    steps = sink.steps()
    assert [(r["step"], r["status"]) for r in steps] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert steps[1]["interval_seconds"] >= 0.02  # it ran until the close, an upper bound


def test_a_held_generator_whose_body_raised_is_an_error_step_and_later_steps_open():
    with capture(strict=True) as sink:
        it = steptrace.steps(range(100))
        try:
            for n, _ in it:
                if n == 2:
                    raise KeyError("shard")
        except KeyError:
            with steptrace.checkpoint(2):  # an emergency save in the handler
                pass
        for m in range(3, 7):
            with steptrace.step(m):
                pass
        assert it is not None
    steps = sink.steps()
    assert [(r["step"], r["status"], r.get("error")) for r in steps] == [
        (0, "ok", None), (1, "ok", None), (2, "error", "KeyError: 'shard'"),
        *[(m, "ok", None) for m in range(3, 7)]]
    (run,) = sink.of_type("run")
    assert run["dropped"] == {}


def test_spans_and_steptrace_calls_inside_the_body_do_not_end_the_step():
    def inner():
        with steptrace.span("fwd"):
            steptrace.log(loss=1.0)

    with capture(strict=True) as sink:
        it = steptrace.steps(range(3))
        for n, _ in it:
            with steptrace.span("inner"):
                time.sleep(0.001)
            inner()
            try:
                raise RuntimeError("handled inside the body")
            except RuntimeError:
                with steptrace.span("recover"):  # in an except block of the body: still the step
                    pass
            assert steptrace.current_step() is not None and steptrace.current_step().step == n
    steps = sink.steps()
    assert [(r["step"], r["status"]) for r in steps] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert all(r["scalars"] == {"loss": 1.0} for r in steps)
    assert {s["name"]: s["step"] for s in sink.spans() if s["step"] == 1} == {"inner": 1, "fwd": 1, "recover": 1}


def test_a_loop_in_another_thread_is_not_ended_by_this_threads_calls():
    import threading

    inside = threading.Event()
    release = threading.Event()
    with capture(strict=False) as sink:
        def loop():
            for _n, _ in steptrace.steps(range(2)):
                inside.set()
                release.wait(10)

        worker = threading.Thread(target=loop)
        worker.start()
        assert inside.wait(10)
        steptrace.flush(timeout_s=0.1)  # another thread: step 0 is still open
        assert steptrace.current_step() is not None and steptrace.current_step().step == 0
        release.set()
        worker.join(10)
    assert [(r["step"], r["status"]) for r in sink.steps()] == [(0, "ok"), (1, "ok")]


def test_the_loops_frame_and_its_variables_are_freed_once_its_step_ended():
    """steptrace keeps the frame running the loop only while its step is open: once the step ends
    (here at the next steptrace call after a function returned from a left loop), the function's
    variables are freed by reference counting, with no cycle left for a full collection."""
    import gc
    import weakref

    class Model:
        pass

    def train():
        model = Model()
        it = steptrace.steps(range(10))
        for n, _ in it:
            if n == 1:
                break
        return weakref.ref(model), it is not None

    with capture() as sink:
        gc.disable()
        try:
            model, _ = train()
            with steptrace.step(5):  # ends step 1: its loop's function returned
                pass
            assert model() is None
        finally:
            gc.enable()
    assert [(r["step"], r["status"]) for r in sink.steps()] == [(0, "ok"), (1, "ok"), (5, "ok")]


def test_a_loop_inside_a_generator_times_the_body_of_the_loop_that_drives_it():
    """`for b in batches()` where batches() runs the steps() loop and yields: the driving loop's body
    is the step (its spans are the step's); leaving it and opening a step ends the open one."""
    def batches(start):
        for _n, batch in steptrace.steps(range(4), start=start):
            yield batch

    with capture(strict=True) as sink:
        for _batch in batches(0):
            with steptrace.span("fwd"):
                pass
        held = batches(4)
        for batch in held:
            if batch == 1:
                break
        with steptrace.step(10):  # not nested: the driving loop was left
            pass
        assert held is not None
    assert [(r["step"], r["status"]) for r in sink.steps()] == [(n, "ok") for n in range(6)] + [(10, "ok")]
    assert {s["step"] for s in sink.spans() if s["name"] == "fwd"} == {0, 1, 2, 3}
