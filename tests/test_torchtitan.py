"""torchtitan hooks: torchtitan 0.3.0's llama3 debug model through its real ``Trainer`` on CPU.

``tests/torchtitan_scripts/torchtitan_worker.py`` runs ``Trainer.train()`` in one process twice over
one dump folder: 3 steps with ``checkpoint.interval=2`` and ``async_mode="async"`` (an async save of
step 2, then torchtitan's synchronous last-step save of step 3), then a resume to step 4. The
worker's CPU shim (named there, each with its reason) covers only what torchtitan 0.3.0 cannot do on
a CPU-only torch 2.13; the Trainer, its loop, checkpointer, data loader and metrics are torchtitan's.

What the tests rely on, from torchtitan 0.3.0's source: ``Trainer.train`` increments ``self.step``
before each ``train_step`` and calls ``checkpointer.save(self.step, last_step=...)`` after it
(``trainer.py``); ``CheckpointManager._save`` saves when ``_should_save`` (interval or last step),
with ``dcp.async_save`` leaving ``save_future`` in ``async`` mode except for the last step, which
is a synchronous ``dcp.save`` (``components/checkpointer/dcp.py``); ``_load`` restores the
``train_state`` (the trainer's ``step``); ``MetricsProcessor.log`` computes ``tps`` as the tokens
fetched since its last log over the host time since its last log (the first from its construction
in ``Trainer.__init__``), ``tflops = num_flops_per_token × tps`` and ``mfu`` against a peak from
the device name (``components/metrics.py``).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torchtitan tests need torch: pip install 'steptrace[torch]'")
if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("the torchtitan tests need torchtitan 0.3.0 and its dependencies: pip install --no-deps "
                "-r requirements-torchtitan.txt (make test installs them)", allow_module_level=True)

pytestmark = pytest.mark.integration  # real torchtitan

WORKER = Path(__file__).parent / "torchtitan_scripts" / "torchtitan_worker.py"
SEQ_LEN, BATCH = 128, 2
TOKENS = SEQ_LEN * BATCH  # label tokens per step on the one rank


def _run(work: Path, run_id: str, steps: int, port: int, *, batch: int = BATCH, pp: int = 1) -> dict:
    out = work / f"out-{run_id}"
    args = [str(WORKER), "--work", str(work), "--run-dir", str(work / "runs"), "--run-id", run_id, "--out", str(out),
            "--steps", str(steps), "--seq-len", str(SEQ_LEN), "--batch", str(batch), "--pp", str(pp)]
    if pp > 1:  # one process per pipeline stage, on gloo
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp}", *args]
    else:
        cmd = [sys.executable, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(port))
    env.pop("STEPTRACE_DISABLED", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (work / "runs" / run_id / "rank-0.jsonl").read_text().splitlines()]
    result = {"records": records, "work": work, **json.loads((out / "torchtitan.json").read_text())}
    result["ranks"] = [records] + [
        [json.loads(line) for line in (work / "runs" / run_id / f"rank-{r}.jsonl").read_text().splitlines()]
        for r in range(1, pp)]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torchtitan")
    fresh = _run(work, "fresh", 3, 29611)
    resume = _run(work, "resume", 4, 29612)
    return fresh, resume


def _of(run: dict, kind: str) -> list[dict]:
    return [r for r in run["records"] if r["type"] == kind]


def _restores(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["type"] == "span" and r["name"] == "restore"]


def test_every_hook_installs_on_torchtitan_030(runs):
    fresh, _ = runs
    assert fresh["hooks"] == [
        "torchtitan.trainer.Trainer.train_step", "torchtitan.trainer.Trainer.batch_generator",
        "torchtitan.components.checkpointer.dcp.CheckpointManager._save",
        "torchtitan.components.checkpointer.dcp.CheckpointManager._maybe_wait_for_staging",
        "torchtitan.components.checkpointer.dcp.CheckpointManager._load",
        "torchtitan.components.validate.Validator.validate"]
    # only the worker's named shims, and on CPU all four of the accelerator ones
    cpu_shims = ["device_type", "memory_monitor", "flex_attention_backward", "set_pg_timeouts"]
    assert set(fresh["shims"]) <= {*cpu_shims, "pipeline_step_microbatches"}
    import torch

    if not torch.cuda.is_available():
        assert fresh["shims"][:4] == cpu_shims


def test_steps_are_torchtitans_with_its_tokens_and_model_flops(runs):
    fresh, resume = runs
    assert [s["step"] for s in _of(fresh, "step")] == [1, 2, 3]
    assert [s["step"] for s in _of(resume, "step")] == [4]  # numbered from the restored train_state
    assert fresh["non_data_parallel_size"] == 1
    flops_per_token = fresh["num_flops_per_token"]
    assert flops_per_token > 0
    for s in _of(fresh, "step") + _of(resume, "step"):
        assert s["status"] == "ok"
        assert s["tokens"] == TOKENS
        assert s["flops"] == pytest.approx(TOKENS * flops_per_token)
        assert s["compute_seconds"] > 0
        assert s["idle_breakdown"]["data"] > 0  # the step's own fetch, in a data span
    # torchtitan's own cumulative token count agrees with the tokens steptrace gave each step
    for run in (fresh, resume):
        for s in _of(run, "step"):
            assert run["metrics"][str(s["step"])]["n_tokens_seen"] == TOKENS * s["step"]


def test_async_save_is_timed_to_its_commit_and_the_last_save_is_blocking(runs):
    fresh, _ = runs
    ckpts = {c["step"]: c for c in _of(fresh, "checkpoint")}
    assert sorted(ckpts) == [2, 3]  # interval 2, and the last step
    assert ckpts[2]["after_step"] == 2 and ckpts[2]["blocking_seconds"] > 0
    assert ckpts[2]["async_seconds"] is not None and ckpts[2]["async_seconds"] > 0  # the dcp.async_save commit
    assert ckpts[3]["async_seconds"] is None and ckpts[3]["blocking_seconds"] > 0  # last step: dcp.save
    # The commit ends no earlier than DCP's last write: the checkpoint's .metadata, written by the
    # async save's finish step (torch.distributed.checkpoint's StorageWriter.finish) before the future
    # completes. Both are wall-clock times; 5 ms covers steptrace's clock calibration.
    written = (fresh["work"] / "dump" / "checkpoint" / "step-2" / ".metadata").stat().st_mtime
    assert ckpts[2]["end_time"] + ckpts[2]["async_seconds"] >= written - 0.005
    step3 = next(s for s in _of(fresh, "step") if s["step"] == 3)
    # the save after step 2 is step 3's idle time, never its compute
    assert step3["idle_breakdown"]["checkpoint"] == pytest.approx(ckpts[2]["blocking_seconds"], rel=1e-6)


def test_resume_is_a_restore_before_the_first_step_after_it(runs):
    fresh, resume = runs
    (nothing,) = _restores(fresh)  # train() always calls load: the fresh run found nothing
    assert nothing["attrs"] == {"restored": False}
    (restore,) = _restores(resume)
    assert restore["attrs"]["restored_step"] == 3 and restore["seconds"] > 0
    (step4,) = _of(resume, "step")
    assert step4.get("first_after_restore") is True
    assert not any(s.get("first_after_restore") for s in _of(fresh, "step"))
    assert [c["step"] for c in _of(resume, "checkpoint")] == [4]


def test_torchtitans_tps_and_tflops_side_by_side(runs):
    """torchtitan's window for a step runs from its previous log to this one: it holds the save
    after the previous step and the fetch, so its tflops (model FLOPs over that window) is below
    steptrace's TFLOP/s (the same FLOPs over compute_seconds) by the save; its first window starts
    at the metrics processor's construction in ``Trainer.__init__``, so it also holds the restore."""
    fresh, resume = runs
    steps = {s["step"]: s for s in _of(fresh, "step")}
    ckpt2 = next(c for c in _of(fresh, "checkpoint") if c["step"] == 2)
    tt3 = fresh["metrics"]["3"]
    window3 = tt3["time_metrics/end_to_end(s)"]  # log_freq=1: the host time since the last log
    assert tt3["throughput(tps)"] == pytest.approx(TOKENS / window3, rel=1e-6)
    # the window holds the save and step 3's fetch and compute, all timed by steptrace inside it
    assert window3 > ckpt2["blocking_seconds"] + steps[3]["idle_breakdown"]["data"]
    steptrace_flops_per_s = steps[3]["flops"] / steps[3]["compute_seconds"]
    assert tt3["tflops"] * 1e12 < steptrace_flops_per_s
    assert tt3["tflops"] * 1e12 == pytest.approx(fresh["num_flops_per_token"] * tt3["throughput(tps)"], rel=1e-6)
    # after the resume, torchtitan's first window holds the restore steptrace names separately
    (restore,) = _restores(resume)
    assert resume["metrics"]["4"]["time_metrics/end_to_end(s)"] > restore["seconds"]


PP_MICROBATCHES = 4  # batch 4, microbatch size 1
# torch 2.13's Schedule1F1B._step_microbatches: stage s runs min(M, stages - s) warm-up forwards, then
# alternates one backward and one forward, then the remaining backwards.
ONE_F_ONE_B = {
    0: [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2), ("backward", 1), ("forward", 3),
        ("backward", 2), ("backward", 3)],
    1: [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2),
        ("forward", 3), ("backward", 3)],
}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("torchtitan-pp"), "pp", 2, 29613, batch=PP_MICROBATCHES, pp=2)


def test_pipeline_parallel_microbatches_inside_torchtitans_steps(pipeline_run):
    """parallelism.pipeline_parallel_degree=2 with 1F1B on 2 gloo ranks: each rank's trainer step holds
    its stage's microbatches in the schedule's order; tokens and FLOPs are the rank's share."""
    flops_per_token = pipeline_run["num_flops_per_token"]
    assert pipeline_run["non_data_parallel_size"] == 2
    fetched = PP_MICROBATCHES * SEQ_LEN  # every stage fetches the batch; torchtitan counts it per rank
    for rank, records in enumerate(pipeline_run["ranks"]):
        steps = {s["step"]: s for s in records if s["type"] == "step"}
        assert sorted(steps) == [1, 2]
        for n, step in steps.items():
            assert step["tokens"] == fetched // 2 and step["flops"] == pytest.approx(fetched // 2 * flops_per_token)
            mbs = [m for m in records if m["type"] == "microbatch" and m["step"] == n]
            assert [(m["kind"], m["microbatch"]) for m in mbs] == ONE_F_ONE_B[rank]
            assert {m["stage"] for m in mbs} == {rank} and {m["chunk"] for m in mbs} == {None}
            for m in mbs:
                assert step["start_time"] - 1e-6 <= m["start_time"] <= m["end_time"] <= step["end_time"] + 1e-6
            # the bubble reported = the one from the same step's microbatch spans
            window = max(m["end_time"] for m in mbs) - step["start_time"]
            from_spans = 1 - sum(m["compute_seconds"] for m in mbs) / window
            got = step["pipeline_bubble_ratio"][str(rank)]
            assert abs(got - from_spans) <= 0.1 * from_spans + 1e-9
    # torchtitan's own token count is per rank, the whole batch: steptrace's shares sum to it
    assert pipeline_run["metrics"]["2"]["n_tokens_seen"] == 2 * fetched
