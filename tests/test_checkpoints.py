"""Checkpoint saves numbered either way agree across the checkpoint table, the step table and the summary.

Trainers number a save two ways: MaxText (and steptrace's hooks) save after step n and call it n;
nanodo, orbax's ``CheckpointManager.save(step)`` convention, Megatron-LM (``iteration`` after the
increment) and torchtitan (``self.step``, 1-based) call the state after n steps ``n``, so
``checkpoint(n)`` runs before steptrace's step n. Either way the save sits after the step whose
device work preceded it (``after_step``): its ``blocking_seconds`` is the part of its host span
after that step's end, which is exactly the ``checkpoint`` idle time of the step that follows
(DESIGN §2). The simulated device reports exact device ends, so the three figures are compared to
the microsecond.
"""

from __future__ import annotations

import time

import pytest

import steptrace
from steptrace.analysis.summary import summarize
from steptrace.testing import capture

U = 0.02  # seconds of simulated device work per step
WRITE = 0.03  # the save's host time after the device has drained (its exposed part)


def _save(device, label: int, *, async_save: bool, handle_form: str, pending: list) -> None:
    """A save that, like orbax, first waits for the state (the device drains), then writes."""
    if handle_form == "with":
        with steptrace.checkpoint(label, async_save=async_save) as ckpt:
            device.synchronize()
            time.sleep(WRITE)
    else:  # what hooks do: enter and exit the handle around a call they wrap
        ckpt = steptrace.checkpoint(label, async_save=async_save)
        ckpt.__enter__()
        device.synchronize()
        time.sleep(WRITE)
        ckpt.__exit__(None, None, None)
    if async_save:
        pending.append(ckpt)


def _loop(device, *, numbering: str, step_form: str, handle_form: str, async_save: bool):
    """Six steps, a save of the state after 2 and 4 steps; ``numbering``:

    * ``"steps_done"``: ``checkpoint(n)`` at the top of iteration n (nanodo), before step n;
    * ``"last_step"``: ``checkpoint(n - 1)`` after step n - 1 (MaxText, the hooks).
    """
    pending: list = []
    saves = (2, 4)

    def top_of_iteration(n):
        if numbering == "steps_done" and n in saves:
            _save(device, n, async_save=async_save, handle_form=handle_form, pending=pending)

    def end_of_iteration(n):
        if numbering == "last_step" and n + 1 in saves:
            _save(device, n, async_save=async_save, handle_form=handle_form, pending=pending)

    with capture() as sink:
        if step_form == "steps":
            # The iterator opens step n before the loop body runs: a save at the top of the body is
            # inside step n, before its work is dispatched.
            for n, _ in steptrace.steps(range(6)):
                top_of_iteration(n)
                steptrace.wait_for(device.run(U))
                end_of_iteration(n)
        else:
            for n in range(6):
                top_of_iteration(n)
                if step_form == "with":
                    with steptrace.step(n) as s:
                        s.wait_for(device.run(U))
                else:
                    steptrace.begin_step(n)
                    steptrace.end_step(wait_for=device.run(U))
                end_of_iteration(n)
        # The commits finish after every step has been resolved: the record of an async save is
        # built last, when later steps' ends are known too.
        assert steptrace.flush(timeout_s=10)
        for ckpt in pending:
            ckpt.async_done()
    return sink


FORMS = [(step_form, handle_form, async_save)
         for step_form in ("with", "begin_end", "steps")
         for handle_form in ("with", "enter_exit")
         for async_save in (False, True)]


@pytest.mark.parametrize("numbering", ["steps_done", "last_step"])
@pytest.mark.parametrize("step_form, handle_form, async_save", FORMS)
def test_checkpoint_table_step_table_and_summary_agree_however_saves_are_numbered(
        device, numbering, step_form, handle_form, async_save):
    sink = _loop(device, numbering=numbering, step_form=step_form, handle_form=handle_form, async_save=async_save)
    steps = {r["step"]: r for r in sink.steps()}
    ckpts = sorted(sink.checkpoints(), key=lambda c: c["step"])
    labels = [2, 4] if numbering == "steps_done" else [1, 3]
    assert [c["step"] for c in ckpts] == labels  # the trainer's own numbers are kept
    for ckpt in ckpts:
        assert ckpt["status"] == "ok"
        assert (ckpt["async_seconds"] is not None) == async_save
        # Both numberings save the state after steps 0..k, before step k + 1 runs.
        k = ckpt["after_step"]
        assert k == (ckpt["step"] - 1 if numbering == "steps_done" else ckpt["step"])
        # Blocking = the save's host time after step k's device end = step k + 1's checkpoint idle.
        assert ckpt["blocking_seconds"] == pytest.approx(ckpt["end_time"] - steps[k]["end_time"], abs=1e-6)
        assert steps[k + 1]["idle_breakdown"]["checkpoint"] == pytest.approx(ckpt["blocking_seconds"], abs=1e-6)
        assert ckpt["blocking_seconds"] >= WRITE * 0.99  # the write after the device drained, never 0
    summary = summarize(sink.steps(), sink.checkpoints())
    assert summary["checkpoint_blocking_seconds"] == pytest.approx(
        summary["idle_breakdown_totals"]["checkpoint"], abs=1e-6)


@pytest.mark.parametrize("evaluated_first", [False, True])
def test_a_save_inside_a_jax_step_after_its_outputs_were_handed_over_follows_that_step(device, evaluated_first):
    """AXLearn saves inside ``_run_step`` after the step was dispatched (its loss already given to
    ``wait_for``), after its evalers ran: that save follows this step's work, so its blocking starts at
    this step's end, also when the resolver has seen the outputs ready before the save began."""
    with capture() as sink:
        for n in range(4):
            with steptrace.step(n) as s:
                s.wait_for(device.run(U))
                if n == 1:
                    if evaluated_first:
                        device.synchronize()
                        time.sleep(5 * U)  # the evalers: the resolver is done waiting for the outputs
                    with steptrace.checkpoint(n):
                        device.synchronize()
                        time.sleep(WRITE)
    steps = {r["step"]: r for r in sink.steps()}
    (ckpt,) = sink.checkpoints()
    assert ckpt["after_step"] == 1
    assert ckpt["blocking_seconds"] == pytest.approx(
        ckpt["end_time"] - max(ckpt["start_time"], steps[1]["end_time"]), abs=1e-6)
    assert ckpt["blocking_seconds"] >= WRITE * 0.99
    assert steps[2]["idle_breakdown"]["checkpoint"] == pytest.approx(ckpt["blocking_seconds"], abs=1e-6)


def test_a_save_before_the_first_step_blocks_for_all_of_its_host_time(device):
    """No step ran before it: the whole save is host time before the first step (start-up accounting)."""
    with capture() as sink:
        with steptrace.checkpoint(0, async_save=True) as ckpt:
            time.sleep(WRITE)
        for n in range(2):
            with steptrace.step(n) as s:
                s.wait_for(device.run(U))
        assert steptrace.flush(timeout_s=10)
        ckpt.async_done()  # after step 0 was resolved: its end must not be taken for the save's
    (record,) = sink.checkpoints()
    assert record["after_step"] is None
    assert record["blocking_seconds"] == pytest.approx(record["host_seconds"], abs=1e-9)
    first = min(sink.steps(), key=lambda r: r["step"])
    assert first["before_step_breakdown"]["checkpoint"] == pytest.approx(record["blocking_seconds"], abs=1e-6)
