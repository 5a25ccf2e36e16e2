"""torch.distributed.pipelining hooks: every microbatch the real schedules ran, in their order, bubbles.

The integration tests launch ``tests/pipelining_scripts/pipelining_worker.py`` with
``python -m torch.distributed.run`` (gloo, CPU) through torch 2.13's real schedules, unshimmed:
2 ranks with GPipe, 1F1B, Interleaved1F1B (2 stages a rank) and both zero-bubble schedules
(ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble: their split backward runs on gloo); 4 ranks
with GPipe, 1F1B and Interleaved1F1B; 4 ranks of 1F1B with one stage slowed on purpose. Each
schedule's first step also runs once with no hook installed: the gradients must be equal.

What the tests rely on, from torch 2.13.0's ``torch/distributed/pipelining/schedules.py``:
``ScheduleGPipe._step_microbatches`` runs every forward, then every backward, in microbatch order;
``Schedule1F1B._step_microbatches`` runs ``min(M, num_stages - stage_index)`` warm-up forwards,
then one backward and one forward alternately until the forwards are done, then the remaining
backwards; the multi-stage schedules execute ``pipeline_order_with_comms[rank]`` in order
(``_PipelineScheduleRuntime._step_microbatches``), whose compute actions the worker saves.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import steptrace
from steptrace import SteptraceWarning

torch = pytest.importorskip("torch", reason="the pipelining tests need torch: pip install steptrace[torch]")
import torch.distributed as dist  # noqa: E402

import steptrace.adapters.torch_pipelining as pipelining_hooks  # noqa: E402

pytestmark = pytest.mark.integration  # real torch.distributed.pipelining

WORKER = Path(__file__).parent / "pipelining_scripts" / "pipelining_worker.py"
MICROBATCHES = 4
STEPS = 3  # step 0 carries gloo's connection set-up; the bubble checks read the steady steps after it
KIND = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


@pytest.fixture
def hooks():
    yield pipelining_hooks
    pipelining_hooks.uninstall()


# -- installation -----------------------------------------------------------------------
def test_install_hooks_the_stage_and_schedule_methods_and_uninstall_restores_them(hooks):
    from torch.distributed.pipelining import schedules, stage

    originals = {name: stage._PipelineStageBase.__dict__[name]
                 for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")}
    steps = (schedules.PipelineScheduleSingle.__dict__["step"], schedules.PipelineScheduleMulti.__dict__["step"])
    steptrace.init(sinks=[], backend="host")
    try:
        names = hooks.install()
        assert names == [f"torch.distributed.pipelining.stage._PipelineStageBase.{n}" for n in originals] + [
            "torch.distributed.pipelining.schedules.PipelineScheduleSingle.step",
            "torch.distributed.pipelining.schedules.PipelineScheduleMulti.step"]
        assert hooks.install() == names  # idempotent
        for name, original in originals.items():
            assert stage._PipelineStageBase.__dict__[name] is not original
            assert stage._PipelineStageBase.__dict__[name].__steptrace_original__ is original
        hooks.uninstall()
        for name, original in originals.items():
            assert stage._PipelineStageBase.__dict__[name] is original
        assert (schedules.PipelineScheduleSingle.__dict__["step"],
                schedules.PipelineScheduleMulti.__dict__["step"]) == steps
    finally:
        steptrace.shutdown()


def test_a_stage_method_whose_signature_changed_disables_its_hook_with_one_warning(hooks, monkeypatch):
    from torch.distributed.pipelining import stage

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False, extra=None):
        return None

    monkeypatch.setattr(stage._PipelineStageBase, "backward_one_chunk", backward_one_chunk)
    steptrace.init(sinks=[], backend="host")
    try:
        with pytest.warns(SteptraceWarning, match=r"backward_one_chunk disabled .*signature.*torch 2\.") as caught:
            names = hooks.install()
        assert len([w for w in caught if issubclass(w.category, SteptraceWarning)]) == 1
        assert not any(n.endswith("backward_one_chunk") for n in names) and len(names) == 4
        assert stage._PipelineStageBase.__dict__["backward_one_chunk"] is backward_one_chunk
    finally:
        steptrace.shutdown()


def test_the_split_backward_kinds_are_microbatch_kinds_and_unknown_kinds_are_still_misuse(tmp_path):
    steptrace.init(run_dir=tmp_path, run_id="kinds", backend="host")
    with steptrace.step(0):
        for kind in ("forward", "backward_input", "backward_weight", "backward"):
            with steptrace.microbatch(0, stage=0, kind=kind):
                pass
        with pytest.warns(SteptraceWarning, match="kind='sideways' is unknown; use one of forward, backward, "
                          "backward_input, backward_weight"):
            with steptrace.microbatch(0, stage=0, kind="sideways"):
                pass
    steptrace.shutdown()
    records = [json.loads(line) for line in (tmp_path / "kinds" / "rank-0.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in sorted((r for r in records if r["type"] == "microbatch"),
                                       key=lambda r: r["host_start_time"])]
    assert kinds == ["forward", "backward_input", "backward_weight", "backward"]


# -- the real schedules on gloo ------------------------------------------------------------
def _gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


class PipelineRun:
    """One torchrun launch of the worker: its records per schedule and rank, and its saved tensors."""

    def __init__(self, tmp: Path, nproc: int, schedules: list[str], *, steps: int = STEPS,
                 slow: tuple[int, float] | None = None):
        if not _gloo_available():
            pytest.skip("torch.distributed with the gloo backend is not available")
        self.nproc, self.schedules = nproc, schedules
        self.run_dir, out = tmp / "runs", tmp / "out"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKER), "--schedules", ",".join(schedules), "--microbatches", str(MICROBATCHES),
               "--steps", str(steps), "--forward-s", "0.01", "--run-dir", str(self.run_dir), "--out", str(out)]
        if slow is not None:
            cmd += ["--slow-rank", str(slow[0]), "--slow-s", str(slow[1])]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("STEPTRACE_DISABLED", None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, \
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        self.records = {name: {rank: [json.loads(line) for line in
                                      (self.run_dir / name / f"rank-{rank}.jsonl").read_text().splitlines()]
                               for rank in range(nproc)} for name in schedules}
        self.saved = {rank: torch.load(out / f"rank{rank}.pt") for rank in range(nproc)}

    def steps(self, name: str, rank: int) -> list[dict]:
        return [r for r in self.records[name][rank] if r["type"] == "step"]

    def microbatches(self, name: str, rank: int, step: int) -> list[dict]:
        mbs = [r for r in self.records[name][rank] if r["type"] == "microbatch" and r["step"] == step]
        return sorted(mbs, key=lambda r: r["host_start_time"])

    def step_bubbles(self, name: str) -> list[float]:
        """Each steady step's bubble summed over the stages."""
        by_step: dict[int, float] = {}
        for rank in range(self.nproc):
            for s in self.steps(name, rank):
                if s["step"] >= 1:
                    by_step[s["step"]] = by_step.get(s["step"], 0.0) + s["pipeline_bubble_ratio"][str(rank)]
        return list(by_step.values())

    def bubble(self, name: str, rank: int) -> float:
        """The stage's mean bubble over the steady steps (all but step 0)."""
        ratios = [s["pipeline_bubble_ratio"][str(rank)] for s in self.steps(name, rank) if s["step"] >= 1]
        return sum(ratios) / len(ratios)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return PipelineRun(tmp_path_factory.mktemp("pipelining-2"), 2, ["gpipe", "1f1b", "interleaved1f1b", "zb", "zbv"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return PipelineRun(tmp_path_factory.mktemp("pipelining-4"), 4, ["gpipe", "1f1b", "interleaved1f1b"])


def _expected_order(run: PipelineRun, name: str, rank: int) -> list[tuple]:
    """(kind, microbatch, chunk) in the order the schedule runs them on ``rank`` (module docstring)."""
    P, M = run.nproc, MICROBATCHES
    if name == "gpipe":
        return [("forward", i, None) for i in range(M)] + [("backward", i, None) for i in range(M)]
    if name == "1f1b":
        warmup = min(M, P - rank)
        order = [("forward", i, None) for i in range(warmup)]
        forward = warmup
        for backward in range(M):
            order.append(("backward", backward, None))
            if forward < M:
                order.append(("forward", forward, None))
                forward += 1
        return order
    planned = run.saved[rank][name]["order"]
    assert planned, f"{name}: the worker saved no plan for rank {rank}"
    return [(KIND[kind], mb, stage_index // P) for kind, mb, stage_index in planned]


def _check_schedule(run: PipelineRun, name: str) -> None:
    P, M = run.nproc, MICROBATCHES
    for rank in range(P):
        steps = run.steps(name, rank)
        assert [s["step"] for s in steps] == list(range(STEPS)), (name, rank)
        expected = _expected_order(run, name, rank)
        chunks = sorted({c for _, _, c in expected}, key=lambda c: -1 if c is None else c)
        kinds = sorted({k for k, _, _ in expected})
        assert kinds == (["backward_input", "backward_weight", "forward"] if name in ("zb", "zbv")
                         else ["backward", "forward"]), (name, kinds)
        for step in range(STEPS):
            mbs = run.microbatches(name, rank, step)
            assert {m["stage"] for m in mbs} == {rank}
            # Every microbatch once per kind and chunk of this rank...
            for chunk in chunks:
                for kind in kinds:
                    got = sorted(m["microbatch"] for m in mbs if m["chunk"] == chunk and m["kind"] == kind)
                    assert got == list(range(M)), (name, rank, step, chunk, kind)
            # ... in exactly the schedule's order.
            assert [(m["kind"], m["microbatch"], m["chunk"]) for m in mbs] == expected, (name, rank, step)
            record = steps[step]
            for m in mbs:
                assert m["compute_seconds"] > 0
                assert record["start_time"] - 1e-6 <= m["start_time"] <= m["end_time"] <= record["end_time"] + 1e-6
            # The bubble reported = the one computed from the same run's microbatch spans (within 10 %).
            window = max(m["end_time"] for m in mbs) - record["start_time"]
            from_spans = 1 - sum(m["compute_seconds"] for m in mbs) / window
            got = record["pipeline_bubble_ratio"][str(rank)]
            assert abs(got - from_spans) <= 0.1 * from_spans + 1e-9, (name, rank, step, got, from_spans)
            assert record["optimizer_seconds"] >= 0


def _check_gradients_unchanged(run: PipelineRun, name: str) -> None:
    for rank in range(run.nproc):
        saved = run.saved[rank][name]
        assert saved["plain"].keys() == saved["hooked"].keys() and saved["plain"]
        for stage_index, grads in saved["plain"].items():
            for param, grad in grads.items():
                assert torch.equal(grad, saved["hooked"][stage_index][param]), (name, rank, stage_index, param)
                assert grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved1f1b", "zb", "zbv"])
def test_two_ranks_record_every_microbatch_once_in_the_schedules_order(two_ranks, name):
    _check_schedule(two_ranks, name)
    _check_gradients_unchanged(two_ranks, name)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved1f1b"])
def test_four_ranks_record_every_microbatch_once_in_the_schedules_order(four_ranks, name):
    _check_schedule(four_ranks, name)
    _check_gradients_unchanged(four_ranks, name)


def test_schedule_eval_is_an_eval_span_with_no_step_and_no_microbatch(two_ranks):
    for name in ("gpipe", "1f1b"):
        for rank in range(2):
            records = two_ranks.records[name][rank]
            evals = [r for r in records if r["type"] == "span" and r["name"] == "eval"]
            assert len(evals) == 1 and evals[0]["step"] is None and evals[0]["seconds"] > 0, (name, rank)
            last = max(r["host_end_time"] for r in records if r["type"] == "step")
            assert evals[0]["start_time"] >= last  # after the training steps: nothing recorded inside it
            assert not [r for r in records if r["type"] == "microbatch" and r["host_start_time"] >= last]


def test_zero_bubble_schedules_split_the_backward_into_its_input_and_weight_halves(two_ranks):
    """The worker's backward sleeps 10 ms on the input path and 10 ms on the weight path: a split
    backward's halves each take about what a forward takes, a full backward about twice that."""
    for rank in range(2):
        mbs = [m for step in range(STEPS) for m in two_ranks.microbatches("zbv", rank, step)]
        median = {kind: sorted(m["compute_seconds"] for m in mbs if m["kind"] == kind)[len(mbs) // 6]
                  for kind in ("forward", "backward_input", "backward_weight")}
        full = sorted(m["compute_seconds"] for step in range(STEPS)
                      for m in two_ranks.microbatches("1f1b", rank, step) if m["kind"] == "backward")
        assert full[len(full) // 2] > 1.5 * median["forward"], (median, full)
        assert median["backward_weight"] > 0.5 * median["forward"], median


def test_bubbles_shrink_down_the_pipeline_and_with_interleaving_and_zero_bubble(two_ranks, four_ranks):
    """Steady steps (step 0 carries gloo's connection set-up). GPipe and 1F1B: the first stage
    waits longest for the drain, so its bubble is the largest (GPipe, P=4, M=4, backward = 2 × forward:
    stage 0's bubble is (P-1)/(M+P-1) = 0.43, the last stage's 0.2). Interleaving shrinks every stage's
    bubble; the zero-bubble schedules fill it with deferred weight gradients (2 ranks: 1F1B ~0.23 a
    stage, ZBV ~0.04)."""
    for name in ("gpipe", "1f1b"):
        bubbles = [four_ranks.bubble(name, rank) for rank in range(4)]
        assert bubbles[0] > bubbles[3] + 0.03, (name, bubbles)
    flat = [four_ranks.bubble("1f1b", rank) for rank in range(4)]
    inter = [four_ranks.bubble("interleaved1f1b", rank) for rank in range(4)]
    assert sum(inter) < sum(flat), (inter, flat)
    # A preempted rank's gaps are bubble too, and only ever add to it: on 2 loaded cores they raised ZBV's
    # mean to 0.43 against 1F1B's 0.39 in 2 of 6 runs. The least-disturbed steady step of each schedule
    # (the smallest bubble summed over the ranks) is the closest to the schedule's own.
    one_f_one_b = min(two_ranks.step_bubbles("1f1b"))
    zbv = min(two_ranks.step_bubbles("zbv"))
    assert zbv < one_f_one_b, (zbv, one_f_one_b)


def test_the_stage_slowed_on_purpose_is_named_with_its_cost(tmp_path):
    """1F1B on 4 gloo ranks, stage 2's forward 30 ms slower per microbatch: the others wait for it in
    their p2p receives (``Work.wait``, measured by steptrace.adapters.torch_distributed), so stage 2
    has the most time on its own and is named the straggler of the steady steps."""
    from steptrace.analysis.runs import load_run
    from steptrace.analysis.stragglers import straggler_steps, summarize_stragglers

    steps = 6
    PipelineRun(tmp_path, 4, ["1f1b"], steps=steps, slow=(2, 0.03))
    run = load_run(tmp_path / "runs" / "1f1b")
    assert run.ranks == [0, 1, 2, 3]
    for rank in run.ranks:
        assert [s["step"] for s in run.steps(rank)] == list(range(steps))
        assert all(s.get("collective_wait_source") for s in run.steps(rank))
    joined = [s for s in straggler_steps(run.records_by_rank, 4) if s["step"] >= 1]
    named = [s["straggler_rank"] for s in joined]
    assert named.count(2) >= 0.8 * len(joined), named
    summary = summarize_stragglers(joined)
    assert summary["top"] == "2" and summary["ranks"]["2"]["cost_median_seconds"] > 0.03, summary
