"""Value-timed steps (JAX's path) observed as each ends and finalized in batches (issue 35).

The resolver waits on each step's outputs as it ends (that part must happen per step: it is when the end
is seen) and builds the records of up to ``_DEFER_STEPS`` of them together, or once the oldest was observed
``_DEFER_S`` ago. These tests hold the batched records to the ones finalized one at a time, and check
what must not wait for a batch: the stall watch's pace, the order of records around checkpoints and host
steps, records reaching the sinks without a flush, and nothing lost at shutdown.
"""

from __future__ import annotations

import collections
import json
import time

import pytest

import steptrace
from steptrace import _resolver
from steptrace._handles import CheckpointHandle, StepHandle
from steptrace.testing import MemorySink, SimulatedDevice


def _computed_work() -> tuple[SimulatedDevice, list]:
    """Work dispatched once and computed: both resolvers see the same device ends."""
    device = SimulatedDevice(uses_events=False, report_end_times=True, memory_limit_bytes=1 << 30)
    device.memory_in_use_bytes = 3 << 20
    work = [device.run(0.0003 * (1 + n % 3)) for n in range(40)]
    device.synchronize()
    return device, work


def _value_loop_items(work: list):
    """The handles of a fixed value-timed loop (held back from the resolver), with fixed host times: spans
    inside and between steps, a host step, a failed step, device memory, a checkpoint in the middle."""
    resolver = steptrace._active.resolver
    # (The resolver thread keeps its own reference to its queue: a fresh one on the attribute holds the
    # handles back, whether Resolver.submit or the compiled step's exit appends them.)
    queue = resolver._queue
    items = resolver._queue = collections.deque()
    try:
        for n, done in enumerate(work):
            if n % 9 == 4:
                with steptrace.span("eval"):
                    pass
            try:
                with steptrace.step(n, **({"flops": 1e9} if n % 4 == 0 else {})) as s:
                    if n % 2 == 0:
                        with steptrace.span("data"):
                            pass
                    if n % 5 == 3:
                        s.log(loss=1.0 / (n + 1))
                    if n == 21:
                        raise RuntimeError("lost")
                    if n != 30:  # step 30 is timed on the host: it ends a batch
                        s.wait_for(done)
            except RuntimeError:
                pass
            if n == 17:
                with steptrace.checkpoint(n):
                    pass
    finally:
        resolver._queue = queue
    items = [item for item in items if isinstance(item, (StepHandle, CheckpointHandle))]
    # Every host time from the fixed work's own (device) times, so both runs give the same records.
    for item in items:
        start = work[item.step].start_time
        if isinstance(item, CheckpointHandle):
            item.host_start, item.host_end = start + 3e-5, start + 4e-5
            continue
        item.host_start = item.dispatch = start - 1e-4
        item.host_end = start + 2e-5
        for k, span in enumerate(item.spans):
            span.start, span.end = start - 9e-5 + 2e-6 * k, start - 8e-5 + 2e-6 * k
    return items


def _records(defer: bool, run_id: str, work: list) -> tuple[list[dict], list[int]]:
    """The records of the fixed value loop, and the sizes of the batches the resolver finalized."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=run_id, strict=False, peak_tflops=100.0, stall_watch=False)
    resolver = steptrace._active.resolver
    resolver.defer_values = defer
    batches: list[int] = []
    real = resolver._finalize_deferred

    def counting() -> None:
        batches.append(len(resolver._deferred))
        real()

    resolver._finalize_deferred = counting
    items = _value_loop_items(work)
    resolver.started = 99.0
    resolver.unix_offset = resolver.records.unix_offset = 1.7e9
    resolver._queue.extend(items)
    resolver._wake.set()
    assert steptrace.flush(60.0)
    records = [r for r in sink.records if r["type"] in ("step", "span", "checkpoint")]
    steptrace.shutdown()
    return records, batches


def test_value_steps_finalized_in_batches_give_the_records_finalized_one_at_a_time():
    _, work = _computed_work()
    now, now_batches = _records(False, "defer", work)
    later, later_batches = _records(True, "defer", work)
    assert now_batches == []
    # A batch ends at 16 steps, before the checkpoint after step 17, before the steps timed on the host (21
    # raised before its wait_for, 30 has none), and at the flush.
    assert later_batches == [_resolver._DEFER_STEPS, 2, 3, 8, 9]
    assert len(later) == len(now) == 40 + 1 + 20 + 4  # steps, a checkpoint, data and eval spans
    for got, expected in zip(later, now):
        assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
    order = [(r["type"], r.get("step")) for r in later if r["type"] != "span"]
    assert order.index(("checkpoint", 17)) == order.index(("step", 17)) + 1
    assert [r["step"] for r in later if r["type"] == "step"] == list(range(40))
    steps = {r["step"]: r for r in later if r["type"] == "step"}
    assert steps[21]["status"] == "error"
    assert steps[21]["end_source"] == steps[30]["end_source"] == "host"
    assert {steps[n]["end_source"] for n in steps if n not in (21, 30)} == {"device"}
    assert steps[7]["device_memory"]["in_use_bytes"] == 3 << 20  # read as the step was observed


def _value_run(run_id: str, **init_kwargs) -> tuple[MemorySink, SimulatedDevice]:
    """A run of this test's own (a memory sink) and a simulated value device (JAX's path) to time steps by."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=run_id, strict=False, **init_kwargs)
    return sink, SimulatedDevice(uses_events=False)


def _value_steps(device: SimulatedDevice, count: int, seconds: float) -> None:
    for n in range(count):
        with steptrace.step(n) as s:
            s.wait_for(device.run(seconds))


def test_the_stall_watch_is_told_each_interval_as_the_step_ends_not_when_its_batch_is_finalized():
    sink, device = _value_run("pace")
    runtime = steptrace._active
    watch = runtime.stall_watch
    told: list[float] = []
    runtime.resolver.on_step_interval = lambda seconds: (told.append(seconds), watch.step_finalized(seconds))
    _value_steps(device, 5, 0.002)
    deadline = time.monotonic() + 10
    while len(told) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(told) == 5
    assert steptrace.stats()["steps"] == 0  # observed, not finalized yet: fewer than 16, under 1 s
    assert steptrace.flush(10)
    steps = sink.steps()
    assert [r["interval_seconds"] for r in steps] == pytest.approx(told, abs=1e-9)
    assert len(told) == 5  # told once, not again when finalized
    steptrace.shutdown()


def test_deferred_steps_reach_the_sinks_without_a_flush_once_the_oldest_is_a_second_old():
    sink, device = _value_run("defer-age", stall_watch=False)
    _value_steps(device, 3, 0.001)
    ended = time.monotonic()
    deadline = ended + 10
    while len(sink.steps()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r["step"] for r in sink.steps()] == [0, 1, 2]
    assert time.monotonic() - ended < _resolver._DEFER_S + 2.0
    steptrace.shutdown()


def test_steps_observed_and_not_finalized_are_finalized_at_shutdown_and_none_is_counted_lost():
    sink, device = _value_run("defer-stop", stall_watch=False)
    _value_steps(device, 5, 0.001)
    steptrace.shutdown()
    assert [r["step"] for r in sink.steps()] == list(range(5))
    (run,) = sink.of_type("run")
    assert run["steps"] == 5 and not run.get("dropped")


def test_a_run_that_reads_each_finalized_step_at_once_finalizes_each_as_it_ends():
    """The capture's slow-step and spike triggers and the GPU health sampler read each finalized step:
    with either, value steps are not held for a batch."""
    _, device = _value_run("defer-off", stall_watch=False)
    resolver = steptrace._active.resolver
    step = StepHandle.__new__(StepHandle)
    step.values = (device.run(0.0),)
    step.device = device
    assert resolver._deferrable(step)
    resolver.on_step_finalized = lambda record: None
    assert not resolver._deferrable(step)
    resolver.on_step_finalized = None
    resolver.health = object()
    assert not resolver._deferrable(step)
    resolver.health = None
    resolver.defer_values = False
    assert not resolver._deferrable(step)
    steptrace.shutdown()


def test_real_jax_steps_on_cpu_are_deferred_and_the_device_is_not_asked_for_device_ends_again():
    """JAX on CPU, for real (its dispatch is asynchronous): the steps are observed and finalized in a batch,
    their ends observed; once the device said its arrays have no device-clock end, the resolver stops
    looking ahead for one (it cost ~12 µs of cold CPU a step on bench_jax_trainer.py's loop)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="defer-jax", strict=False, stall_watch=False, backend="jax")
    resolver = steptrace._active.resolver
    prepared = []
    real_prepare = resolver._prepare_device_ends
    resolver._prepare_device_ends = lambda: (prepared.append(1), real_prepare())
    batches = []
    real_finalize = resolver._finalize_deferred
    resolver._finalize_deferred = lambda: (batches.append(len(resolver._deferred)), real_finalize())
    step_fn = jax.jit(lambda x: jnp.tanh(x @ x) * 0.5)
    x = jnp.ones((64, 64))
    for n in range(6):
        with steptrace.step(n) as s:
            x = step_fn(x)
            s.wait_for(x)
    assert steptrace.flush(30)
    steps = sink.steps()
    assert [r["step"] for r in steps] == list(range(6))
    assert {r["end_source"] for r in steps} == {"observed"}
    assert max(batches) > 1
    assert len(prepared) <= 1  # the first step only: the device then said it has no device-clock end
    assert steptrace.stats()["steps"] == 6
    steptrace.shutdown()


def test_a_logged_jax_scalar_is_read_as_its_step_ends_not_when_the_batch_is_finalized():
    """``s.log(loss=array)`` is read as the step is observed: a later step may donate (delete) the array
    before the batch is finalized, and the record still has its value, with no drop counted."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="defer-scalar", strict=False, backend="jax")
    runtime = steptrace._active
    watch = runtime.stall_watch
    told: list[float] = []
    runtime.resolver.on_step_interval = lambda seconds: (told.append(seconds), watch.step_finalized(seconds))
    step_fn = jax.jit(lambda x: (x * 0.5, jnp.sum(x)))
    x = jnp.ones((16, 16))
    logged = []
    for n in range(3):
        with steptrace.step(n) as s:
            x, loss = step_fn(x)
            s.log(loss=loss)
            s.wait_for(x)
        logged.append(loss)
    deadline = time.monotonic() + 10
    while len(told) < 3 and time.monotonic() < deadline:  # observed, not finalized (under 16 steps, 1 s)
        time.sleep(0.002)
    assert len(told) == 3 and steptrace.stats()["steps"] == 0
    for loss in logged:
        loss.delete()  # as a donating step would
    assert steptrace.flush(30)
    steps = sink.steps()
    assert [r["scalars"]["loss"] for r in steps] == [256.0, 128.0, 64.0]
    assert not steptrace.stats()["dropped"]
    steptrace.shutdown()
