"""steptrace.adapters.orbax on a real orbax ``CheckpointManager`` and a small JAX loop.

One line (``instrument(manager)``) and the loop saves as it always did: every save orbax performs is a
checkpoint record under orbax's step number (a declined save records nothing), its blocking part in
the step table exactly once, its asynchronous commit in ``async_seconds`` and never in a step;
restores are ``restore`` spans, your waits for a commit ``checkpoint`` spans.
"""

from __future__ import annotations

import time
import warnings

import pytest

pytest.importorskip("jax", reason="the orbax adapter is tested on a JAX loop")
ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint (the demo extra)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import steptrace  # noqa: E402
from steptrace import SteptraceWarning  # noqa: E402
from steptrace.adapters import orbax as orbax_adapter  # noqa: E402
from steptrace.analysis.summary import summarize  # noqa: E402
from steptrace.testing import capture  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 7
SLOW_COMMIT_S = 0.3  # a commit to slow storage: it must overlap the steps after the save


@jax.jit
def train_step(state):
    w = state["w"]
    for _ in range(3):
        w = jnp.tanh(w @ w) * 0.5
    return {"w": w, "n": state["n"] + 1}, w.sum()


def _state():
    return {"w": jnp.ones((256, 256)) / 256, "n": jnp.zeros((), jnp.int32)}


def _manager(path, *, async_save: bool, slow_commit: bool = False):
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, enable_async_checkpointing=async_save))
    if slow_commit:
        finalize = manager._finalize

        def slow_finalize(step, steps_to_remove):  # the finalize thread's work, made slow
            time.sleep(SLOW_COMMIT_S)
            return finalize(step, steps_to_remove)

        manager._finalize = slow_finalize
    return manager


def _loop(manager, numbering: str) -> None:
    """nanodo's order (save the state after n steps at the top of iteration n) or MaxText's (save
    after step n as n); ``save`` is called every iteration and the policy keeps every second."""
    state = _state()
    for n in range(STEPS):
        if numbering == "steps_done":
            manager.save(n, args=ocp.args.StandardSave(state))
        with steptrace.step(n) as s:
            state, loss = train_step(state)
            s.wait_for(loss)
        if numbering == "last_step":
            manager.save(n, args=ocp.args.StandardSave(state))


@pytest.mark.parametrize("numbering", ["steps_done", "last_step"])
@pytest.mark.parametrize("async_save", [True, False])
def test_each_save_orbax_makes_is_one_record_its_blocking_part_charged_once(tmp_path, async_save, numbering):
    manager = orbax_adapter.instrument(_manager(tmp_path / "ckpt", async_save=async_save, slow_commit=async_save))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteptraceWarning)  # this orbax fits: nothing to warn about
        with capture() as sink:
            _loop(manager, numbering)
            manager.close()
    saved = [0, 2, 4, 6]  # save_interval_steps=2: the policy declined the others
    ckpts = sorted(sink.checkpoints(), key=lambda c: c["step"])
    assert [c["step"] for c in ckpts] == saved and manager.all_steps() == [4, 6]
    steps = {r["step"]: r for r in sink.steps()}
    for c in ckpts:
        assert c["status"] == "ok" and 0 < c["blocking_seconds"] <= c["host_seconds"]
        after = c["step"] - 1 if numbering == "steps_done" else c["step"]
        assert c["after_step"] == (after if after >= 0 else None)
        if async_save:
            # The commit ran on orbax's finalize thread, after save() returned.
            assert c["async_seconds"] >= SLOW_COMMIT_S * 0.95
        else:
            assert c["async_seconds"] is None
        nxt = steps.get(after + 1)
        if nxt is not None and after >= 0:
            # Charged once: the blocking part is the next step's checkpoint idle, to the microsecond.
            assert nxt["idle_breakdown"]["checkpoint"] == pytest.approx(c["blocking_seconds"], abs=1e-6)
    # The summary agrees over the saves a step followed (before the first step: start-up time).
    followed = [c for c in ckpts if c["after_step"] is None or c["after_step"] + 1 in steps]
    summary = summarize(sink.steps(), followed)
    assert summary["idle_breakdown_totals"]["checkpoint"] == pytest.approx(summary["checkpoint_blocking_seconds"],
                                                                         abs=1e-6)
    if async_save:
        # The commits overlapped later steps, which show no checkpoint time for them: every step's
        # checkpoint idle is the blocking part of the save just before it, nothing more.
        first = ckpts[1]
        commit_end = first["end_time"] + first["async_seconds"]
        overlapped = [r for r in steps.values() if r["start_time"] < commit_end and r["step"] > first["after_step"]]
        assert overlapped
        for r in overlapped:
            own = [c["blocking_seconds"] for c in ckpts if c["after_step"] == r["step"] - 1]
            assert r["idle_breakdown"].get("checkpoint", 0.0) == pytest.approx(sum(own), abs=1e-6)
    # close() waited for the last commit: a checkpoint span after the last step, not a save.
    waits = [s for s in sink.spans() if s["name"] == "checkpoint"]
    assert len(waits) == 1 and waits[0]["step"] is None


def test_a_forced_save_is_recorded_and_your_own_wait_is_a_checkpoint_span(tmp_path):
    manager = orbax_adapter.instrument(_manager(tmp_path / "ckpt", async_save=True))
    state = _state()
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                state, loss = train_step(state)
                s.wait_for(loss)
        assert manager.save(3, args=ocp.args.StandardSave(state), force=True)  # off the interval
        assert not manager.should_save(5)  # your own question opens nothing
        manager.wait_until_finished()
        with steptrace.step(3) as s:
            state, loss = train_step(state)
            s.wait_for(loss)
        manager.close()
    (ckpt,) = sink.checkpoints()
    assert ckpt["step"] == 3 and ckpt["after_step"] == 2 and ckpt["async_seconds"] is not None
    wait, closing = [s for s in sink.spans() if s["name"] == "checkpoint"]
    assert wait["start_time"] >= ckpt["end_time"] and closing["start_time"] >= wait["end_time"]
    step3 = next(r for r in sink.steps() if r["step"] == 3)
    # Both the save's blocking part and the wait for its commit held the loop before step 3.
    assert step3["idle_breakdown"]["checkpoint"] >= ckpt["blocking_seconds"]


def test_a_restore_before_the_first_step_is_restore_time(tmp_path):
    path = tmp_path / "ckpt"
    writer = _manager(path, async_save=False)
    writer.save(4, args=ocp.args.StandardSave(_state()))
    writer.close()
    for asked in (4, None):  # None: orbax restores the latest step
        manager = orbax_adapter.instrument(_manager(path, async_save=True))
        with capture() as sink:
            state = manager.restore(asked, args=ocp.args.StandardRestore(_state()))
            with steptrace.step(5) as s:
                state, loss = train_step(state)
                s.wait_for(loss)
            manager.close()
        (span,) = [s for s in sink.spans() if s["name"] == "restore"]
        assert span["attrs"] == {"restored_step": 4} and span["step"] is None
        (first,) = sink.steps()
        assert first["before_step_breakdown"]["restore"] == pytest.approx(span["seconds"], abs=1e-6)


def test_with_steptrace_off_the_manager_is_untouched_in_effect(tmp_path):
    manager = orbax_adapter.instrument(_manager(tmp_path / "ckpt", async_save=True))
    assert orbax_adapter.instrument(manager) is manager  # idempotent
    steptrace.init(enabled=False)
    state = _state()
    assert manager.save(0, args=ocp.args.StandardSave(state))
    assert not manager.save(1, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    assert manager.all_steps() == [0]
    restored = manager.restore(0, args=ocp.args.StandardRestore(_state()))
    assert float(restored["w"].sum()) == pytest.approx(float(state["w"].sum()))
    orbax_adapter.uninstrument(manager)
    assert all(name not in vars(manager) for name in ("save", "should_save", "restore", "_finalize"))
    assert manager.save.__func__ is ocp.CheckpointManager.save
    manager.close()


def test_an_orbax_whose_finalize_differs_warns_once_and_records_the_blocking_part(tmp_path):
    manager = _manager(tmp_path / "ckpt", async_save=True)
    finalize = manager._finalize

    def renamed(directory, steps_to_remove):  # an older orbax: _finalize(directory, steps_to_remove)
        return finalize(directory, steps_to_remove)

    manager._finalize = renamed
    with pytest.warns(SteptraceWarning, match=r"_finalize is not _finalize\(step, \.\.\.\) in orbax-checkpoint "
                                              r"0\.12\.8: asynchronous commits are not timed"):
        orbax_adapter.instrument(manager)
    with capture() as sink:
        _loop(manager, "last_step")
        manager.close()
    ckpts = sink.checkpoints()
    assert [c["step"] for c in ckpts] == [0, 2, 4, 6]
    assert all(c["status"] == "ok" and c["async_seconds"] is None and c["blocking_seconds"] > 0 for c in ckpts)


def test_something_that_is_not_a_checkpoint_manager_is_refused_at_setup():
    class Checkpointer:
        def save(self, path, item):
            pass

    with pytest.raises(TypeError, match="takes an orbax.checkpoint.CheckpointManager; Checkpointer has no "
                                        "should_save, wait_until_finished, restore"):
        orbax_adapter.instrument(Checkpointer())
