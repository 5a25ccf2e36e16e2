"""Real AXLearn (PyPI, CPU, a tiny MLP on synthetic batches) with and without the hooks.

AXLearn pins its own jax and tensorflow, so it runs as a subprocess in ``.venv-axlearn``
(``make axlearn-env``, ~1.8 GB, built by ``make test``). The trainer (tests/axlearn_scripts/train_tiny.py) runs
``SpmdTrainer`` for six steps with a tensorstore checkpoint every 2 steps, an ``SpmdEvaler``
every 3 and a profiler trace started after step 1. No timing thresholds: the machine is small
and shared; the assertions are on which records exist and how they relate.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
# AXLEARN_PYTHON: another interpreter with axlearn and steptrace installed, e.g. one built from
# AXLearn's GitHub source on Python 3.12 (CI cannot reach GitHub; the default is the PyPI env).
VENV_PYTHON = Path(os.environ.get("AXLEARN_PYTHON") or ROOT / ".venv-axlearn" / "bin" / "python")
SCRIPT = ROOT / "tests" / "axlearn_scripts" / "train_tiny.py"
STEPS = 6  # AXLearn numbers steps from 1
CHECKPOINT_EVERY = 2
EVAL_EVERY = 3
PROFILE_AFTER = 1  # AXLearn traces the 3 steps after it

if not VENV_PYTHON.exists():
    pytest.skip("AXLearn tests need the Python 3.11 env .venv-axlearn (~1.8 GB; make test builds it "
                "where a Python 3.11 exists): run `make axlearn-env`", allow_module_level=True)

AXLEARN_VERSION = subprocess.run(
    [str(VENV_PYTHON), "-c", "from steptrace.adapters.axlearn import axlearn_version; print(axlearn_version())"],
    capture_output=True, text=True, timeout=120, check=True).stdout.strip()

LOSS = re.compile(r"step\s+(\d+)\] loss=(\S+)")


def _env(tmp: Path, run_id: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPTRACE_")}
    env.update(STEPTRACE_RUN_DIR=str(tmp / "runs"), STEPTRACE_RUN_ID=run_id, JAX_PLATFORMS="cpu",
               PYTHONWARNINGS="always::UserWarning")
    return env


def _losses(log: str) -> dict:
    """AXLearn's own per-step loss log lines (steps 1..5) and the last step's loss from run()."""
    losses = {int(m[1]): m[2] for m in LOSS.finditer(log)}
    result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    losses[result["last_step"]] = repr(result["last_loss"])
    return losses


def _run(tmp: Path, hooked: bool) -> dict:
    name = "hooked" if hooked else "plain"
    args = [str(VENV_PYTHON), str(SCRIPT), str(tmp / name)] + (["--hooked"] if hooked else [])
    proc = subprocess.run(args, env=_env(tmp, name), cwd=tmp, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = []
    if hooked:
        records = [json.loads(line) for line in (tmp / "runs" / name / "rank-0.jsonl").read_text().splitlines()]
    return {"log": log, "losses": _losses(log), "records": records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("axlearn")
    return _run(tmp, hooked=True), _run(tmp, hooked=False)


def _of(records: list, kind: str, name: str | None = None) -> list:
    return [r for r in records if r["type"] == kind and (name is None or r.get("name") == name)]


def test_every_hook_installs_and_every_step_is_device_timed(runs):
    hooked, _ = runs
    assert "SteptraceWarning" not in hooked["log"], "a hook disabled itself against this axlearn"
    installed = json.loads(hooked["log"].split("installed: ", 1)[1].splitlines()[0])
    assert {"SpmdTrainer._run_step", "SpmdTrainer._prepare_training", "SpmdTrainer._maybe_stop_or_start_tracing",
            "SpmdEvaler.eval_step", "Checkpointer.save", "Checkpointer.wait_until_finished",
            "SpmdTrainer.restore_checkpoint"} <= set(installed)
    steps = {r["step"]: r for r in _of(hooked["records"], "step")}
    assert sorted(steps) == list(range(1, STEPS + 1))  # steptrace's numbers are AXLearn's
    for record in steps.values():
        assert record["status"] == "ok" and record["backend"] == "jax"
        assert record["end_source"] == "observed"  # the loss was waited on by the resolver
        assert record["compute_seconds"] > 0
        assert record["idle_seconds"] == pytest.approx(sum(record["idle_breakdown"].values()), abs=1e-9)
    # The first step compiles the train program: its idle time says so, not its compute.
    assert steps[1]["idle_breakdown"].get("compile", 0) > 0


def test_checkpoints_have_blocking_and_async_commit_time(runs):
    hooked, _ = runs
    steps = {r["step"]: r for r in _of(hooked["records"], "step")}
    saves = {r["step"]: r for r in _of(hooked["records"], "checkpoint")}
    assert sorted(saves) == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    for n, save in saves.items():
        assert save["status"] == "ok"
        assert 0 < save["blocking_seconds"] <= save["host_seconds"]
        # The tensorstore writes committed in the background (the storage's on_commit_callback ran).
        assert save["async_seconds"] is not None and save["async_seconds"] >= 0
        # AXLearn saves inside step n, after its loss was handed to wait_for: the save follows step n.
        assert save["after_step"] == n
        if n + 1 in steps:
            # The save blocked after step n's device work: idle time of step n+1, never compute. The
            # tables agree, save for a compile inside the save (the first save compiles a copy program):
            # the innermost span names idle time, so that part is `compile` in the step table.
            idle = steps[n + 1]["idle_breakdown"]
            assert 0 < idle["checkpoint"] <= save["blocking_seconds"] + 1e-6
            assert idle["checkpoint"] + idle.get("compile", 0.0) >= save["blocking_seconds"] - 1e-6
    # The trainer's final wait for background writes (Checkpointer.stop) is a checkpoint span.
    assert _of(hooked["records"], "span", "checkpoint")


def test_eval_and_data_spans(runs):
    hooked, _ = runs
    records = hooked["records"]
    evals = _of(records, "span", "eval")
    assert sorted(r["step"] for r in evals) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert {r["attrs"]["evaler"] for r in evals} == {"tiny_eval"}
    steps = {r["step"]: r for r in _of(records, "step")}
    for r in evals:  # evaluation after step n waits in step n+1's idle time
        if r["step"] + 1 in steps:
            assert r["step"] + 1 in steps and set(steps[r["step"] + 1]["idle_breakdown"]) & {"eval", "compile"}
    # One input batch per step, fetched before the step opens (AXLearn increments the step after).
    data = _of(records, "span", "data")
    assert len(data) == STEPS and all(r["step"] is None for r in data)
    assert all(steps[n]["idle_breakdown"].get("data", 0) > 0 for n in range(2, STEPS + 1))


def test_profiler_trace_window_is_marked_on_steptraces_steps(runs):
    """start_trace_steps=[1]: AXLearn traces steps 2..4 (StepTraceAnnotation step_num = steptrace's step)."""
    hooked, _ = runs
    steps = {r["step"]: r for r in _of(hooked["records"], "step")}
    traced = sorted(n for n, r in steps.items() if r["attrs"].get("profiler_trace"))
    assert traced == list(range(PROFILE_AFTER + 1, PROFILE_AFTER + 4))
    assert "Start profiler tracing" in hooked["log"] and "Stopped profiler tracing" in hooked["log"]
    # Starting and stopping the profiler (which blocks on the last traced step) are host time.
    assert len(_of(hooked["records"], "span", "profile")) == 2
    assert steps[PROFILE_AFTER + 4]["idle_breakdown"].get("profile", 0) > 0


def test_hooks_do_not_change_losses(runs):
    hooked, plain = runs
    assert sorted(hooked["losses"]) == list(range(1, STEPS + 1))
    assert hooked["losses"] == plain["losses"]
    assert len(set(hooked["losses"].values())) > 1  # the model actually trained


def test_changed_signature_disables_only_that_hook(runs, tmp_path):
    """A hooked function with another signature warns once, naming it and the version; training runs."""
    code = r"""
import json, sys, warnings
import steptrace
import axlearn.common.checkpointer as ck
original = ck.Checkpointer.save
def save(self, step, state, evaler_summaries=None, *, force=False):  # not the signature the hook expects
    return original(self, step=step, state=state, evaler_summaries=evaler_summaries)
ck.Checkpointer.save = save
from steptrace.adapters import axlearn as adapter
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = adapter.install()
msgs = [str(w.message) for w in caught if issubclass(w.category, steptrace.SteptraceWarning)]
assert len(msgs) == 1 and "Checkpointer.save" in msgs[0] and "axlearn VERSION" in msgs[0], msgs
assert "Checkpointer.save" not in names and "SpmdTrainer._run_step" in names, names
assert ck.Checkpointer.save is save
sys.argv = ["train_tiny.py", sys.argv[1], "--max-step", "3"]
sys.path.insert(0, SCRIPT_DIR)
import train_tiny
train_tiny.main(sys.argv)
""".replace("VERSION", AXLEARN_VERSION).replace("SCRIPT_DIR", repr(str(SCRIPT.parent)))
    proc = subprocess.run([str(VENV_PYTHON), "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path, "changed"), cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "changed" / "rank-0.jsonl").read_text().splitlines()]
    # Training went on with the other hooks: steps recorded, checkpoints saved but not recorded.
    assert sorted(r["step"] for r in _of(records, "step")) == [1, 2, 3]
    assert not _of(records, "checkpoint")
    assert (tmp_path / "out" / "checkpoints" / "step_00000002" / "index").exists()
    # ...and the losses are those of an unhooked run.
    _, plain = runs
    losses = {int(m[1]): m[2] for m in LOSS.finditer(log)}  # AXLearn's own loss log lines
    assert losses == {n: plain["losses"][n] for n in (1, 2, 3)}


def test_recorder_flag_installs_the_hooks(tmp_path):
    """``--recorder_type=steptrace.adapters.axlearn:steptrace``: AXLearn's measurement registry builds our recorder."""
    code = r"""
import importlib.util, sys
if importlib.util.find_spec("axlearn.common.measurement") is None:
    print("SKIP"); sys.exit(0)
from absl import flags
from axlearn.common import measurement
measurement.define_flags()
flags.FLAGS(["prog", "--recorder_type=steptrace.adapters.axlearn:steptrace"])
measurement.initialize(flags.FLAGS)
from steptrace.adapters import axlearn as adapter
assert type(measurement.global_recorder).__name__ == "SteptraceRecorder"
assert "SpmdTrainer._run_step" in adapter.installed()
measurement.record_event(measurement.Event.END_JOB)
print("ok")
"""
    proc = subprocess.run([str(VENV_PYTHON), "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env(tmp_path, "recorder"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if proc.stdout.strip().endswith("SKIP"):
        pytest.skip(f"axlearn {AXLEARN_VERSION} has no measurement recorder registry (no PyPI release has); "
                    "AXLearn's GitHub source has it: AXLEARN_PYTHON=<an env built from it>")
    assert proc.stdout.strip().endswith("ok")


def test_a_killed_and_resumed_run_times_axlearns_restore_and_the_first_step_after_it(tmp_path):
    """Nothing wrapped by hand: a hooked run (saves every 2 steps) is killed (SIGKILL) once AXLearn
    logged step 5, then launched again with the same run id; AXLearn's restore_checkpoint (between
    its training-preparation events) restores the latest committed checkpoint by itself. The hook
    times it, the step after it is marked with its one-off cost separated, and the job's
    accounting adds up exactly across the two attempts."""
    from steptrace.analysis.goodput import BUCKETS, job_accounting

    cmd = [str(VENV_PYTHON), str(SCRIPT), str(tmp_path / "resumed"), "--hooked", "--max-step", "8"]
    env = _env(tmp_path, "resumed")
    first = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in first.stdout:  # type: ignore[union-attr]
            log.append(line)
            if re.search(r"step\s+5\] loss=", line):
                break
    finally:
        first.kill()
        first.wait(timeout=60)
    assert any(re.search(r"step\s+5\] loss=", line) for line in log), "".join(log)[-4000:]
    second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "resumed" / "rank-0.jsonl").read_text().splitlines()]

    assert [r["attempt"] for r in records if r["type"] == "attempt"] == [0, 1]
    restores = _of(records, "span", "restore")
    assert [r["attempt"] for r in restores] == [0, 1]
    looked, restore = restores
    assert looked["attrs"] == {"restored": False}  # the first launch found no checkpoint
    restored = restore["attrs"]["restored_step"]
    # The commit of step 4's save is asynchronous: the kill can come before it.
    assert restore["attrs"] == {"restored_step": restored} and restored in (2, 4)
    assert restore["step"] is None and restore["seconds"] > 0
    steps = [r for r in records if r["type"] == "step" and r["attempt"] == 1]
    assert [s["step"] for s in steps] == list(range(restored + 1, 9))
    assert [bool(s.get("first_after_restore")) for s in steps] == [True] + [False] * (len(steps) - 1)
    assert not any(r.get("first_after_restore") for r in records if r["type"] == "step" and r["attempt"] == 0)
    # Before the first step the restore is start-up time by reason; AXLearn compiles inside it
    # (innermost span wins), so its `restore` share is at most the span.
    assert 0 < steps[0]["before_step_breakdown"]["restore"] <= restore["seconds"] + 1e-6
    firsts = [next(r for r in records if r["type"] == "step" and r["attempt"] == a) for a in (0, 1)]
    job = job_accounting(records)
    (cost,) = job["after_restore"]
    assert (cost["attempt"], cost["step"]) == (1, restored + 1)
    assert cost["one_off_seconds"] == pytest.approx(
        max(0.0, steps[0]["interval_seconds"] - cost["typical_step_interval_seconds"]), abs=1e-9)
    assert job["badput"]["restore"] == pytest.approx(sum(f["before_step_breakdown"].get("restore", 0.0)
                                                         for f in firsts), abs=1e-6)
    assert set(job["badput"]) == set(BUCKETS)
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-6)
