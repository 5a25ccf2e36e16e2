"""DeepSpeed hooks: DeepSpeed 0.19's real engine and PipelineEngine on CPU (its CPU accelerator, gloo).

``tests/deepspeed_scripts/deepspeed_worker.py`` runs under ``python -m torch.distributed.run``: the
engine on 1 process (ZeRO stage 0 and 2, gradient accumulation 2, a save and a resume), the
PipelineEngine on 2 processes (2 stages, 4 micro-batches). DeepSpeed builds its shared-memory
communication op with g++/ninja on first use (cached under ~/.cache/torch_extensions): the first
run on a machine takes minutes.

What the tests rely on, from DeepSpeed 0.19.8's source: ``DeepSpeedEngine.step`` applies the
update on the gradient accumulation boundary and counts it in ``global_steps``
(``runtime/engine.py``), which ``save_checkpoint``/``load_checkpoint`` store and restore;
``PipelineEngine.train_batch`` runs ``TrainSchedule`` (``runtime/pipe/schedule.py``), whose
``_step_to_micro_batch`` gives the micro-batch and direction of each of its
``2 × (micro_batches + stages − 1)`` steps. The decoupled checkpoint engine's behaviour the tests rely
on is written down in ``tests/deepspeed_scripts/deepspeed_decoupled_worker.py``.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the DeepSpeed tests need torch: pip install 'steptrace[torch]'")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("the DeepSpeed tests need deepspeed: DS_BUILD_OPS=0 pip install 'steptrace[deepspeed]' "
                "(make test installs it)", allow_module_level=True)

pytestmark = pytest.mark.integration  # real DeepSpeed

WORKER = Path(__file__).parent / "deepspeed_scripts" / "deepspeed_worker.py"
DECOUPLED_WORKER = Path(__file__).parent / "deepspeed_scripts" / "deepspeed_decoupled_worker.py"
WRITE_S = 1.0  # the decoupled writer's extra time per save (in the writer process only)
MICROBATCHES = 4
FORWARD_S = 0.02
DATA_S = 0.02  # the engine loop's wait for each micro-batch, in a data span
UPDATES = 6  # optimizer updates before the save


def _run(tmp: Path, mode: str, nproc: int, *extra: str, worker: Path = WORKER) -> tuple[Path, Path]:
    runs, out = tmp / "runs", tmp / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(worker),
           "--run-dir", str(runs), "--out", str(out), *extra]
    if worker == WORKER:
        cmd += ["--mode", mode, "--forward-s", str(FORWARD_S)]
    # DeepSpeed's own launcher sets CROSS_RANK/CROSS_SIZE (the node's rank and the node count);
    # torch.distributed.run does not, and the decoupled checkpoint engine reads them
    # (runtime/model_checkpointing/utils.py: create_universal_parallel_info).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CROSS_RANK="0", CROSS_SIZE="1")
    env.pop("STEPTRACE_DISABLED", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return runs / mode, out


def _records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"rank-{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=[0, 2], ids=["zero0", "zero2"])
def engine_run(request, tmp_path_factory):
    return _run(tmp_path_factory.mktemp(f"ds-engine-{request.param}"), "engine", 1, "--steps", str(UPDATES),
                "--zero", str(request.param), "--data-s", str(DATA_S))


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ds-pipe"), "pipe", 2, "--steps", "2", "--microbatches", str(MICROBATCHES))


def test_engine_steps_are_optimizer_updates_numbered_by_global_steps(engine_run):
    run_dir, out = engine_run
    records = _records(run_dir, 0)
    steps = [r for r in records if r["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(UPDATES + 1))  # then 1 update after the resume
    for s in steps:
        assert s["status"] == "ok" and s["attrs"]["micro_batches"] == 2 and s["samples"] == 4
        assert s["compute_seconds"] >= 2 * FORWARD_S  # both micro-batches' forwards are in the step
    for s in steps[1:]:  # (step 0's first wait is before the first step: start-up time)
        assert s["idle_breakdown"]["data"] >= 0.9 * 2 * DATA_S  # the wait for its two micro-batches


def test_deepspeeds_throughput_timer_is_steptraces_samples_over_compute_not_over_the_interval(engine_run):
    """DeepSpeed's ThroughputTimer (its "CurrSamplesPerSec"/"RunningAvgSamplesPerSec") times each
    micro-batch from engine.forward to engine.step and skips its first start_step updates: the data
    wait between micro-batches and between updates is not in it. Over the same updates it matches
    steptrace's samples per compute second; what the job gets is samples per interval, lower by the wait."""
    run_dir, out = engine_run
    timer = json.loads((out / "engine.json").read_text())["throughput_timer"]
    assert timer["global_step_count"] == UPDATES and timer["batch_size"] == 4
    steps = [r for r in _records(run_dir, 0) if r["type"] == "step" and timer["start_step"] <= r["step"] < UPDATES]
    samples = sum(s["samples"] for s in steps)
    per_compute = samples / sum(s["compute_seconds"] for s in steps)
    per_interval = samples / sum(s["interval_seconds"] for s in steps)
    assert timer["avg_samples_per_sec"] == pytest.approx(per_compute, rel=0.1), (timer, per_compute)
    assert per_interval < 0.8 * timer["avg_samples_per_sec"], (per_interval, timer)


def test_save_checkpoint_is_tied_to_the_last_step_and_load_checkpoint_is_a_restore(engine_run):
    run_dir, out = engine_run
    result = json.loads((out / "engine.json").read_text())
    result.pop("throughput_timer")
    assert result == {"steps_before": UPDATES, "steps_loaded": UPDATES, "restored_equal": True,
                      "steps_after": UPDATES + 1}
    records = _records(run_dir, 0)
    (ckpt,) = [r for r in records if r["type"] == "checkpoint"]
    assert ckpt["step"] == UPDATES - 1 and ckpt["after_step"] == UPDATES - 1 and ckpt["blocking_seconds"] > 0
    (restore,) = [r for r in records if r["type"] == "span" and r["name"] == "restore"]
    assert restore["attrs"]["restored_step"] == UPDATES and restore["step"] is None
    steps = {s["step"]: s for s in records if s["type"] == "step"}
    assert steps[UPDATES].get("first_after_restore") is True
    assert not any(steps[n].get("first_after_restore") for n in range(UPDATES))


@pytest.fixture(scope="module")
def decoupled_run(tmp_path_factory):
    # ZeRO stage 0: with stage 2 on CPU, DeepSpeed 0.19.8's decoupled save itself raises
    # ("Cowardly refusing to serialize non-leaf tensor which requires_grad": _save_zero_checkpoint puts
    # the optimizer's partitions on the writer's multiprocessing queue).
    run_dir, out = _run(tmp_path_factory.mktemp("ds-decoupled"), "decoupled", 1, "--write-s", str(WRITE_S),
                        "--zero", "0", worker=DECOUPLED_WORKER)
    records = _records(run_dir, 0)
    result = json.loads((out / "decoupled.json").read_text())
    for tag in ("a", "a2", "b"):
        assert set(result["files"][tag]) == {"mp_rank_00_model_states.pt"}, result["files"]
    return records, result


def _written(out: dict, tag: str) -> float:
    """When the writer finished save ``tag``: its last file's mtime."""
    return max(out["files"][tag].values())


def _checkpoints(records: list[dict]) -> list[dict]:
    """The saves in the order they were made: "a", "a2", "b", "c", "d"."""
    saves = sorted((r for r in records if r["type"] == "checkpoint"), key=lambda r: r["start_time"])
    assert [r["step"] for r in saves] == [1, 1, 3, 4, 5]  # each save recorded once
    return saves


def _commit_spans(records: list[dict]) -> dict[int, dict]:
    spans = [r for r in records if r["type"] == "span" and r["name"] == "checkpoint"]
    assert all(s["attrs"]["waiting"] == "commit" for s in spans)
    return {s["attrs"]["checkpoint_step"]: s for s in spans}


# The record's times are perf_counter plus an offset read once (time.time() - perf_counter()); a
# file's mtime comes from the kernel's coarse clock, at or before the write. 1 ms covers the mapping.
CLOCKS_S = 1e-3


def test_decoupled_save_is_async_and_its_async_part_ends_when_the_commit_completed(decoupled_run):
    """Saves "a" and "a2" after step 1: save_checkpoint returns once the state is queued to the
    writer subprocess; each checkpoint's async part ends when the one commit in step 2 returned (it
    waits for every save queued before it), after the writer's file was complete, and not before."""
    records, out = decoupled_run
    (commit,) = [c for c in out["commits"] if c["tag"] == "a2"]  # DeepSpeed commits the last save's info
    assert commit["global_steps"] == 2  # committed by step 2's boundary step(), not by the saves
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    commit_ends = []
    for save, tag in zip(_checkpoints(records)[:2], ("a", "a2")):
        assert save["status"] == "ok" and save["after_step"] == 1
        mtime = _written(out, tag)
        commit_end = save["end_time"] + save["async_seconds"]
        assert save["end_time"] < mtime  # the save returned before the writer wrote the file...
        assert commit_end >= mtime - CLOCKS_S  # ...and the commit ended after it had
        assert save["blocking_seconds"] < save["host_seconds"] + save["async_seconds"]
        assert save["async_seconds"] >= WRITE_S  # the writer's own time is in the async part
        assert save["blocking_seconds"] < WRITE_S  # and not in the blocking part
        assert steps[2]["host_start_time"] < commit_end <= steps[2]["end_time"] + 1e-6
        commit_ends.append(commit_end)
    assert commit_ends[1] == pytest.approx(commit_ends[0], abs=1e-3)  # one commit ended both


def test_the_wait_for_the_commit_inside_a_step_is_that_steps_idle_checkpoint(decoupled_run):
    """Step 2's step() waits for the writer: a `checkpoint` span (waiting=commit) inside step 2,
    as long as the commit measured around checkpoint_engine.commit; step 2's idle `checkpoint` is that
    wait plus the blocking parts of saves "a" and "a2" (they ran after step 1's end), and none of it
    is compute."""
    records, out = decoupled_run
    (commit,) = [c for c in out["commits"] if c["tag"] == "a2"]
    measured_s = commit["end"] - commit["start"]
    span = _commit_spans(records)[1]
    assert span["step"] == 2
    # The span is inside the measured call: never longer; shorter only by the hook's own few calls.
    assert measured_s - max(0.05, 0.05 * measured_s) <= span["seconds"] <= measured_s + 1e-6
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    blocking_s = sum(save["blocking_seconds"] for save in _checkpoints(records)[:2])
    assert steps[2]["idle_breakdown"]["checkpoint"] == pytest.approx(blocking_s + span["seconds"], abs=1e-3)
    assert steps[2]["compute_seconds"] < steps[2]["interval_seconds"] - span["seconds"] + 1e-6
    for n in (0, 1, 3):  # no commit in them
        assert "checkpoint" not in steps[n]["idle_breakdown"]


def test_a_commit_by_destroy_is_timed_outside_the_steps(decoupled_run):
    """Save "b" after step 3, committed by engine.destroy() (DecoupledCheckpointEngine.cleanup): the
    async part ends with that commit, after the writer's file; the wait is a checkpoint span outside
    any step, charged to the next step's interval (step 4 of the resumed engine) as `checkpoint`."""
    records, out = decoupled_run
    save = _checkpoints(records)[2]
    (commit,) = [c for c in out["commits"] if c["tag"] == "b"]
    assert save["status"] == "ok"
    mtime = _written(out, "b")
    assert save["end_time"] < mtime <= save["end_time"] + save["async_seconds"] + CLOCKS_S
    span = _commit_spans(records)[3]
    measured_s = commit["end"] - commit["start"]
    assert span["step"] is None and measured_s - max(0.05, 0.05 * measured_s) <= span["seconds"] <= measured_s + 1e-6
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert steps[4]["idle_breakdown"]["checkpoint"] >= span["seconds"]


def test_a_commit_whose_writer_died_is_an_error_and_an_uncommitted_save_is_incomplete(decoupled_run):
    """Save "c" after step 4, then the writer process is killed: step 5's commit raises (DeepSpeed:
    "checkpoint process is not running"), so save "c" and step 5 are errors, and no file was written.
    Save "d" after that is queued nowhere (DeepSpeed's save returns for a dead writer): at
    steptrace.shutdown() it was never committed, and is `incomplete`, not lost."""
    records, out = decoupled_run
    (error,) = out["errors"]
    assert "checkpoint process is not running" in error
    saves = _checkpoints(records)
    assert saves[3]["status"] == "error" and "checkpoint process is not running" in saves[3]["error"]
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert steps[5]["status"] == "error" and "checkpoint process is not running" in steps[5]["error"]
    assert out["files"]["c"] == {} and out["files"]["d"] == {}  # the writer wrote neither
    assert saves[4]["status"] == "incomplete" and saves[4]["async_seconds"] is None


def _expected_order(stage: int, stages: int = 2) -> list[tuple[str, int]]:
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    schedule = TrainSchedule(micro_batches=MICROBATCHES, stages=stages, stage_id=stage)
    order = []
    for step_id in range(2 * (MICROBATCHES + stages - 1)):
        micro_batch, forward = schedule._step_to_micro_batch(step_id)
        if schedule._valid_micro_batch(micro_batch):
            order.append(("forward" if forward else "backward", micro_batch))
    return order


def test_pipeline_engine_microbatches_are_recorded_once_in_the_schedules_order(pipe_run):
    run_dir, out = pipe_run
    for rank in (0, 1):
        saved = json.loads((out / f"pipe-rank{rank}.json").read_text())
        assert saved["stage"] == rank and len(saved["losses"]) == 2
        records = _records(run_dir, rank)
        steps = [r for r in records if r["type"] == "step"]
        assert [s["step"] for s in steps] == [0, 1]
        for step in steps:
            mbs = sorted((r for r in records if r["type"] == "microbatch" and r["step"] == step["step"]),
                         key=lambda r: r["host_start_time"])
            assert {m["stage"] for m in mbs} == {rank} and {m["chunk"] for m in mbs} == {None}
            assert [(m["kind"], m["microbatch"]) for m in mbs] == _expected_order(rank)
            assert step["attrs"]["micro_batches"] == MICROBATCHES
            for m in mbs:
                assert m["compute_seconds"] > 0
                assert step["start_time"] - 1e-6 <= m["start_time"] <= m["end_time"] <= step["end_time"] + 1e-6
            window = max(m["end_time"] for m in mbs) - step["start_time"]
            from_spans = 1 - sum(m["compute_seconds"] for m in mbs) / window
            got = step["pipeline_bubble_ratio"][str(rank)]
            assert abs(got - from_spans) <= 0.1 * from_spans + 1e-9, (got, from_spans)
            assert step["optimizer_seconds"] >= 0
            # The stages that load micro-batches (first and last) wait on the data iterator in `data` spans.
            assert "data" in step["idle_breakdown"]
        # eval_batch: an `eval` span after the training steps, with no step and no microbatch in it.
        (evaluation,) = [r for r in records if r["type"] == "span" and r["name"] == "eval"]
        last = max(s["host_end_time"] for s in steps)
        assert evaluation["step"] is None and evaluation["start_time"] >= last and evaluation["seconds"] > 0
        assert not [r for r in records if r["type"] == "microbatch" and r["host_start_time"] >= last]


# -- installation, in this process -------------------------------------------------------------
@pytest.fixture
def ds_hooks():
    import steptrace.adapters.deepspeed as hooks

    yield hooks
    hooks.uninstall()


def test_install_hooks_the_engines_and_the_instruction_map_and_uninstall_restores_them(ds_hooks):
    import steptrace
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    before = {name: DeepSpeedEngine.__dict__[name] for name in ("forward", "step", "save_checkpoint",
                                                                "load_checkpoint")}
    commit = DecoupledCheckpointEngine.__dict__["commit"]
    instruction_map = PipelineEngine.__dict__["_INSTRUCTION_MAP"]
    steptrace.init(sinks=[], backend="host")
    try:
        names = ds_hooks.install()
        assert len(names) == 11 and ds_hooks.install() == names
        assert DecoupledCheckpointEngine.__dict__["commit"].__steptrace_original__ is commit
        hooked_map = PipelineEngine.__dict__["_INSTRUCTION_MAP"]
        for kind, name in ((schedule.ForwardPass, "_exec_forward_pass"), (schedule.BackwardPass, "_exec_backward_pass"),
                           (schedule.LoadMicroBatch, "_exec_load_micro_batch")):
            assert hooked_map[kind] is PipelineEngine.__dict__[name]
            assert hooked_map[kind].__steptrace_original__ is instruction_map[kind]
        assert hooked_map[schedule.OptimizerStep] is instruction_map[schedule.OptimizerStep]
        ds_hooks.uninstall()
        assert PipelineEngine.__dict__["_INSTRUCTION_MAP"] is instruction_map
        assert {name: DeepSpeedEngine.__dict__[name] for name in before} == before
        assert DecoupledCheckpointEngine.__dict__["commit"] is commit
    finally:
        steptrace.shutdown()


def test_a_method_whose_signature_changed_disables_its_hook_with_one_warning(ds_hooks, monkeypatch):
    import steptrace
    from deepspeed.runtime.engine import DeepSpeedEngine

    from steptrace import SteptraceWarning

    def step(self, lr_kwargs=None, closure=None):
        raise AssertionError("not called")

    monkeypatch.setattr(DeepSpeedEngine, "step", step)
    steptrace.init(sinks=[], backend="host")
    try:
        with pytest.warns(SteptraceWarning, match=r"DeepSpeed hook .*DeepSpeedEngine.step disabled .*deepspeed 0\.19"):
            names = ds_hooks.install()
        assert not any(n.endswith("DeepSpeedEngine.step") for n in names) and len(names) == 10
        assert DeepSpeedEngine.step is step
    finally:
        steptrace.shutdown()


def test_install_without_deepspeed_names_the_install_line(ds_hooks, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"DS_BUILD_OPS=0 pip install 'steptrace\[deepspeed\]'"):
        ds_hooks.install()


def test_a_decoupled_engine_with_its_own_commit_is_recorded_by_the_saves_blocking_part(ds_hooks):
    """steptrace times the commit of DeepSpeed's DecoupledCheckpointEngine (its hooked `commit`). Another
    engine that says is_decoupled() but commits its own way would never report to steptrace: its save
    is recorded by its blocking part, complete, not left to be reported `incomplete` at shutdown."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    import steptrace.testing

    class OwnCommit(CheckpointEngine):  # CheckpointEngine's abstract methods, and decoupled
        def create(self, info):
            self.info = info

        def save(self, state_dict, path):
            pass

        def load(self, path, map_location=None):
            return {}

        def commit(self, info):
            return True

        def is_decoupled(self):
            return True

        def get_commit_info(self):
            return self.info

    engine = SimpleNamespace(checkpoint_engine=OwnCommit(), global_steps=1)

    def deepspeeds_save(self, save_dir, tag=None):
        self.checkpoint_engine.create(tag)  # pending, as DeepSpeed leaves a decoupled save
        return True

    with steptrace.testing.capture(backend="host") as sink:
        ds_hooks.install()
        with steptrace.step(0):
            pass
        assert ds_hooks._hook_save_checkpoint(deepspeeds_save)(engine, "ckpt", tag="t") is True
    (save,) = sink.checkpoints()
    assert save["step"] == 0 and save["status"] == "ok" and save["async_seconds"] is None
    assert not [s for s in sink.spans() if s["name"] == "checkpoint"]
