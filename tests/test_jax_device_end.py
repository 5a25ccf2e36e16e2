"""JAX on a CUDA GPU: a step's end read from the device's clock (issue 34), on the fake of
``tests/fake_jax_gpu.py`` (the rules it enforces are listed there). The real GPU check is
``tests/gpu/test_jax_gpu.py``, against XLA's own trace.

The outputs given to ``wait_for`` are handed, through DLPack, to a CUDA stream of steptrace's own as
soon as the resolver sees them, and an event behind them completes when they are ready: the end no
longer depends on when the resolver next gets the GIL.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

pytest.importorskip("jax", reason="the JAX adapter needs jax")

import steptrace  # noqa: E402
from steptrace.adapters import jax as jax_adapter  # noqa: E402
from steptrace.testing import capture  # noqa: E402

from fake_jax_gpu import fake_jax_gpu  # noqa: E402

# A long C call that keeps the GIL (the training thread pickling, sorting, in jaxlib's own code):
# the resolver cannot run until it returns.
_UNSORTED = [random.random() for _ in range(400_000)]


def _hold_gil_past(deadline: float) -> None:
    while time.perf_counter() < deadline:
        sorted(_UNSORTED)


def _by_step(sink):
    return {r["step"]: r for r in sink.steps()}


def _first_step(gpu):
    """Step 0, then a flush: the resolver's one-off work at a run's first step (the run's metadata) is
    done before the steps under test (the first step's outputs are ready long before it looks)."""
    with steptrace.step(0) as s:
        s.wait_for(gpu.run(0.001))
    steptrace.flush()
    gpu.exports.clear()


def test_the_end_is_the_device_s_even_when_the_gil_is_held_past_it(monkeypatch):
    with fake_jax_gpu(monkeypatch) as gpu, capture() as sink:
        offset = steptrace._active.resolver.unix_offset  # the records' perf_counter -> unix offset
        outputs = []
        _first_step(gpu)
        for n in range(1, 7):
            with steptrace.step(n) as s:
                loss = gpu.run(0.03)
                s.wait_for(loss)
            outputs.append(loss)
            time.sleep(0.004)  # the data loader releases the GIL: the resolver hands the loss over
            _hold_gil_past(loss.ready_at + 0.04)  # then the GIL is held across the device's end
    steps = _by_step(sink)
    for n, loss in enumerate(outputs, start=1):
        record = steps[n]
        assert record["end_source"] == "device", record
        # Observed, the end would be >= 40 ms late (the GIL came back only then).
        assert abs(record["end_time"] - (loss.ready_at + offset)) < 1e-3, (n, record["end_time"])
    assert all(thread == "steptrace-resolver" for thread in gpu.exports), set(gpu.exports)
    assert all(loss.external_references == 0 for loss in outputs)


def test_outputs_already_ready_when_first_seen_are_observed_never_early(monkeypatch):
    with fake_jax_gpu(monkeypatch) as gpu, capture() as sink:
        offset = steptrace._active.resolver.unix_offset
        outputs = []
        _first_step(gpu)
        for n in range(1, 4):
            with steptrace.step(n) as s:
                loss = gpu.run(0.01)
                s.wait_for(loss)
                _hold_gil_past(loss.ready_at + 0.02)  # the resolver first looks after the end
            outputs.append(loss)
    for n, loss in enumerate(outputs, start=1):
        record = _by_step(sink)[n]
        assert record["end_source"] == "observed", record
        assert record["end_time"] >= loss.ready_at + offset
    assert gpu.exports == []


def test_a_sharded_output_ends_with_its_last_gpu(monkeypatch):
    with fake_jax_gpu(monkeypatch, count=2) as gpu, capture() as sink:
        offset = steptrace._active.resolver.unix_offset
        outputs = []
        _first_step(gpu)
        for n in range(1, 5):
            with steptrace.step(n) as s:
                loss = gpu.run_sharded([0.02, 0.045])  # GPU 1 is the slow one
                s.wait_for(loss)
            outputs.append(loss)
            time.sleep(0.004)
            _hold_gil_past(loss.ready_at + 0.03)
    steps = _by_step(sink)
    for n, loss in enumerate(outputs, start=1):
        assert steps[n]["end_source"] == "device"
        slow_shard = loss.addressable_shards[1].data
        assert abs(steps[n]["end_time"] - (slow_shard.ready_at + offset)) < 1e-3
    created = [c for c in gpu.driver.calls if c[1] == "cuStreamCreateWithPriority"]
    assert len(created) == 4  # an anchor stream and a wait stream on each GPU, made once


def test_the_training_thread_can_donate_what_it_waited_for(monkeypatch):
    """The capsule's external reference would make the next step's donation fail: it never outlives
    the resolver's export."""
    with fake_jax_gpu(monkeypatch) as gpu, capture() as sink:
        state = gpu.run(0.005)
        for n in range(20):
            with steptrace.step(n) as s:
                new_state = gpu.run(0.005)
                gpu.donate(state)  # jit(train_step, donate_argnums=0)(state)
                state = new_state
                s.wait_for(state)
            time.sleep(0.001)
    assert len(sink.steps()) == 20


def test_cpu_arrays_never_touch_the_cuda_driver(monkeypatch):
    import jax.numpy as jnp

    def no_driver():
        raise AssertionError("a CPU array asked for the CUDA driver")

    monkeypatch.setattr(jax_adapter, "_driver", no_driver)
    with capture() as sink:
        x = jnp.ones((64, 64))
        for n in range(3):
            with steptrace.step(n) as s:
                x = x @ x / 64
                s.wait_for(x)
    assert [r["end_source"] for r in sink.steps()] == ["observed"] * 3


def test_a_driver_that_fails_is_said_once_and_the_ends_are_observed(monkeypatch, caplog):
    with fake_jax_gpu(monkeypatch) as gpu, capture() as sink, caplog.at_level(logging.WARNING, "steptrace"):
        gpu.driver.broken = OSError("cuInit failed (CUresult 100)")
        for n in range(4):
            with steptrace.step(n) as s:
                s.wait_for(gpu.run(0.005))
            time.sleep(0.01)
    assert [r["end_source"] for r in sink.steps()] == ["observed"] * 4
    said = [r for r in caplog.records if "GPU's clock" in r.getMessage()]
    assert len(said) == 1 and "cuInit failed" in said[0].getMessage()


def test_a_deleted_output_is_counted_as_before(monkeypatch):
    with fake_jax_gpu(monkeypatch) as gpu, capture() as sink:
        for n in range(2):
            with steptrace.step(n) as s:
                loss = gpu.run(0.02)
                s.wait_for(loss)
                loss.deleted = True  # donated right after wait_for, before the resolver looked
            time.sleep(0.03)
    run = [r for r in sink.records if r.get("type") == "run"]
    assert run and run[-1]["dropped"].get("device_wait_error") == 2, run
    assert [r["end_source"] for r in sink.steps()] == ["observed"] * 2
