"""Real MaxText (PyPI, CPU, tiny synthetic config, orbax checkpoints) with and without the hooks.

MaxText needs Python >= 3.12, so it runs as a subprocess in ``.venv-maxtext``
(``make maxtext-env``; ``make test`` builds it). Its own log line
``completed step: N, seconds: S`` is the host time between two dispatches; the
assertions compare it with steptrace's records by ratios only (the machine is
small and shared).
"""

import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-maxtext" / "bin" / "python"
STEPS = 6
CHECKPOINT_PERIOD = 2
EVAL_INTERVAL = 4  # eval after steps 0 and 4
# Large enough that a step's device time (~0.1 s on a CPU core) dwarfs its dispatch time (~2 ms).
SEQ = 128
BATCH = 4

if not VENV_PYTHON.exists():
    pytest.skip("MaxText tests need the Python 3.12 env .venv-maxtext: run `make maxtext-env` "
                "(make test builds it)", allow_module_level=True)

COMPLETED = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?\bloss: ([0-9.]+)")


def _maxtext_args(out_dir: Path) -> list[str]:
    configs = subprocess.run([str(VENV_PYTHON), "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    return [f"{configs}/configs/base.yml", "run_name=t", f"base_output_directory={out_dir}", "hardware=cpu",
            "skip_jax_distributed_system=True", "dataset_type=synthetic", "base_emb_dim=256",
            "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=1024", "base_num_decoder_layers=2",
            "head_dim=64", "vocab_size=256", f"max_target_length={SEQ}", f"per_device_batch_size={BATCH}",
            f"steps={STEPS}",
            "enable_checkpointing=True", "async_checkpointing=False", f"checkpoint_period={CHECKPOINT_PERIOD}",
            "attention=dot_product", "dtype=float32", "enable_tensorboard=False",
            f"eval_interval={EVAL_INTERVAL}", "eval_steps=1"]


def _run(tmp: Path, hooked: bool) -> dict:
    name = "hooked" if hooked else "plain"
    module = "steptrace.adapters.maxtext" if hooked else "maxtext.trainers.pre_train.train"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPTRACE_")}
    env.update(STEPTRACE_RUN_DIR=str(tmp / "runs"), STEPTRACE_RUN_ID=name, JAX_PLATFORMS="cpu",
               PYTHONWARNINGS="always::UserWarning")
    proc = subprocess.run([str(VENV_PYTHON), "-m", module, *_maxtext_args(tmp / name)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    maxtext_steps = {int(m[1]): (float(m[2]), float(m[3])) for m in COMPLETED.finditer(log)}
    records = []
    if hooked:
        for line in (tmp / "runs" / name / "rank-0.jsonl").read_text().splitlines():
            records.append(json.loads(line))
    return {"log": log, "maxtext": maxtext_steps, "records": records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("maxtext")
    return _run(tmp, hooked=True), _run(tmp, hooked=False)


def test_hooks_install_and_record_every_step(runs):
    hooked, _ = runs
    assert "SteptraceWarning" not in hooked["log"], "a hook disabled itself against this maxtext"
    steps = {r["step"]: r for r in hooked["records"] if r["type"] == "step"}
    assert sorted(steps) == list(range(STEPS))
    assert sorted(hooked["maxtext"]) == list(range(STEPS))
    for record in steps.values():
        assert record["status"] == "ok" and record["backend"] == "jax"
        assert record["compute_seconds"] > 0
        assert record["tokens"] == BATCH * SEQ  # per_device_batch_size * max_target_length, one CPU device
    spans = [r for r in hooked["records"] if r["type"] == "span"]
    assert {r["step"] for r in spans if r["name"] == "data"} == set(range(STEPS))
    assert {r["step"] for r in spans if r["name"] == "eval"} == set(range(0, STEPS, EVAL_INTERVAL))


def _quiet_steps(steps: dict) -> list[int]:
    """Steps after step 0 with no save or eval before them (MaxText charges those to the next step)."""
    return [n for n in range(1, STEPS) if (n - 1) % CHECKPOINT_PERIOD != 0 and (n - 1) % EVAL_INTERVAL != 0]


def _steady_compute(steps: dict) -> float:
    return statistics.median(steps[n]["compute_seconds"] for n in _quiet_steps(steps))


def test_step0_is_dispatch_and_compile_in_maxtext_compile_is_idle_here(runs):
    """MaxText's step-0 seconds is compilation plus dispatch: it ends before the device ran the step.

    steptrace puts the compilation in step 0's idle_breakdown and ends the step when the device did.
    """
    hooked, _ = runs
    steps = {r["step"]: r for r in hooked["records"] if r["type"] == "step"}
    step0, naive0 = steps[0], hooked["maxtext"][0][0]
    compile0 = step0["idle_breakdown"].get("compile", 0)
    assert compile0 > 0
    assert compile0 < naive0  # MaxText's step 0 contains the compilation...
    assert naive0 < step0["compute_seconds"]  # ...but not the step's device work (dispatch only)
    # Compilation is not counted as compute, checked against JAX's own compile events (recorded as `compile`
    # spans): what JAX compiled in step 0's interval before the step began (no device work of the run had
    # been dispatched) is all idle `compile`; a compile after it began may overlap the step's device work
    # (MaxText compiles small helpers while train_step runs), which is then compute, so the idle is at most
    # what JAX compiled in the whole interval. (Not "within a few steady steps": XLA:CPU's first execution
    # does one-time work of the device's own, and on 2 loaded cores step 0's compute was 3.4x the steady's.)
    end = step0["end_time"]
    begin, start = end - step0["interval_seconds"], step0["start_time"]
    compiles = [(r["start_time"], r["end_time"]) for r in hooked["records"]
                if r["type"] == "span" and r["name"] == "compile"]
    before = _union([(max(low, begin), min(high, start)) for low, high in compiles if high > begin and low < start])
    within = _union([(max(low, begin), min(high, end)) for low, high in compiles if high > begin and low < end])
    assert before - 2e-3 <= compile0 <= within + 2e-3, (before, compile0, within)
    assert step0["compute_seconds"] <= step0["interval_seconds"] - before + 1e-3


def _union(intervals: list[tuple[float, float]]) -> float:
    """The seconds covered by the intervals (nested compile events overlap)."""
    total, reach = 0.0, float("-inf")
    for low, high in sorted(intervals):
        if high > reach:
            total += high - max(low, reach)
            reach = high
    return total


def test_checkpoint_wait_is_not_next_steps_compute(runs):
    """MaxText charges the save after step n to step n+1's seconds; steptrace keeps it out of compute."""
    hooked, _ = runs
    steps = {r["step"]: r for r in hooked["records"] if r["type"] == "step"}
    saves = {r["step"]: r for r in hooked["records"] if r["type"] == "checkpoint"}
    saved = [n for n in range(1, STEPS - 1) if n % CHECKPOINT_PERIOD == 0]
    assert saved and set(saved) <= set(saves)
    for n in saved:
        save, after = saves[n], steps[n + 1]
        assert save["status"] == "ok" and save["blocking_seconds"] > 0 and save["after_step"] == n
        # The save's blocking time is idle time of step n+1, reason "checkpoint", not compute: the
        # checkpoint table and the step table agree, save for a compile inside the save (innermost wins).
        idle = after["idle_breakdown"]
        assert 0 < idle["checkpoint"] <= save["blocking_seconds"] + 1e-6
        assert idle["checkpoint"] + idle.get("compile", 0.0) >= save["blocking_seconds"] - 1e-6
        # Compute did not absorb the save. Its bound allows the noise of 2 shared cores (where the CPU
        # device's compute itself varies by half) or most of a save, whichever is more: a step that
        # had absorbed the save would carry all of it.
        steady = _steady_compute(steps)
        assert after["compute_seconds"] < max(1.5 * steady, steady + 0.75 * save["blocking_seconds"]), \
            (after["compute_seconds"], steady, save["blocking_seconds"])
        # ...where MaxText's own log puts the whole save into step n+1.
        naive = hooked["maxtext"][n + 1][0]
        assert naive > after["compute_seconds"] + 0.5 * save["blocking_seconds"]


def test_steps_without_a_save_are_not_dispatch_only(runs):
    """A step with no save before it: MaxText logs its dispatch time, far below the device time."""
    hooked, _ = runs
    steps = {r["step"]: r for r in hooked["records"] if r["type"] == "step"}
    quiet = _quiet_steps(steps)
    assert quiet
    # MaxText logs ~2 ms ("faster than the hardware"); the device needed far longer.
    ratios = [hooked["maxtext"][n][0] / steps[n]["compute_seconds"] for n in quiet]
    assert max(ratios) < 0.25, (ratios, {n: steps[n]["compute_seconds"] for n in quiet})
    # Intervals tile the run: steptrace's intervals add up to the device end-to-end time.
    total = sum(steps[n]["interval_seconds"] for n in range(STEPS))
    span = steps[STEPS - 1]["end_time"] - steps[0]["end_time"] + steps[0]["interval_seconds"]
    assert total == pytest.approx(span, rel=1e-6)


def test_hooks_do_not_change_losses(runs):
    hooked, plain = runs
    losses_hooked = [hooked["maxtext"][n][1] for n in range(STEPS)]
    losses_plain = [plain["maxtext"][n][1] for n in range(STEPS)]
    assert losses_hooked == losses_plain
    assert len(set(losses_hooked)) > 1  # the model actually trained


def test_changed_signature_disables_only_that_hook():
    """A hooked function with another signature warns once, naming it and the version, and is skipped."""
    code = r"""
import warnings, steptrace
import maxtext.common.checkpointing as ck
def save_checkpoint(manager, step, state):  # not the signature the hook expects
    return "original"
ck.save_checkpoint = save_checkpoint
from steptrace.adapters import maxtext as adapter
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = adapter.install(jsonl=False)
msgs = [str(w.message) for w in caught if issubclass(w.category, steptrace.SteptraceWarning)]
assert len(msgs) == 1 and "save_checkpoint" in msgs[0] and "maxtext 0.2.5" in msgs[0], msgs
assert "save_checkpoint" not in names and "training_loop_iteration" in names, names
assert ck.save_checkpoint is save_checkpoint
adapter.uninstall()
import maxtext.trainers.pre_train.train as train
assert not hasattr(train.training_loop_iteration, "__steptrace_original__")
print("ok")
"""
    proc = subprocess.run([str(VENV_PYTHON), "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def _resumed_run(tmp: Path) -> list[dict]:
    """A hooked run killed (SIGKILL) once MaxText logged step 3, after its save of step 2, then
    launched again with the same run id: MaxText restores its latest checkpoint by itself."""
    out, env = tmp / "resumed", {k: v for k, v in os.environ.items() if not k.startswith("STEPTRACE_")}
    env.update(STEPTRACE_RUN_DIR=str(tmp / "runs"), STEPTRACE_RUN_ID="resumed", JAX_PLATFORMS="cpu")
    cmd = [str(VENV_PYTHON), "-m", "steptrace.adapters.maxtext", *_maxtext_args(out)]
    first = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in first.stdout:  # type: ignore[union-attr]
            log.append(line)
            if re.search(r"completed step: 3\b", line):
                first.kill()
                break
    finally:
        first.kill()
        first.wait(timeout=60)
    assert any("completed step: 3" in line for line in log), "".join(log)[-4000:]
    second = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    return [json.loads(line) for line in (tmp / "runs" / "resumed" / "rank-0.jsonl").read_text().splitlines()]


def test_a_killed_and_resumed_run_times_maxtexts_restore_and_the_first_step_after_it(tmp_path):
    """Nothing wrapped by hand: the hook on load_state_if_possible times the restore of step 2
    (MaxText's TRAINING_PREPARATION), the step after it is marked with its one-off cost separated,
    and the job's accounting adds up exactly across the two attempts."""
    from steptrace.analysis.goodput import BUCKETS, job_accounting

    records = _resumed_run(tmp_path)
    by_attempt = {a: [r for r in records if r["attempt"] == a] for a in (0, 1)}
    assert [r["attempt"] for r in records if r["type"] == "attempt"] == [0, 1]
    # The first launch found no checkpoint: its look is a restore span that says so, and its first
    # step is not marked.
    (looked,) = [r for r in by_attempt[0] if r["type"] == "span" and r["name"] == "restore"]
    assert looked["attrs"] == {"restored": False}
    assert not any(r.get("first_after_restore") for r in by_attempt[0] if r["type"] == "step")
    (restore,) = [r for r in by_attempt[1] if r["type"] == "span" and r["name"] == "restore"]
    # MaxText logs step n once step n+1 is dispatched: the kill can come after step 4's save too.
    restored = restore["attrs"]["restored_step"]
    assert restore["attrs"] == {"restored_step": restored} and restored in (2, 4)
    assert restore["step"] is None and restore["seconds"] > 0
    steps = [r for r in by_attempt[1] if r["type"] == "step"]
    first = steps[0]
    assert first["first_after_restore"] is True and not any(s.get("first_after_restore") for s in steps[1:])
    assert first["step"] == restored + 1  # MaxText resumes after the restored step
    # Before the first step the restore is start-up time by reason (a compile inside it would be
    # `compile`: the innermost span wins), so its `restore` share is at most the span.
    assert 0 < first["before_step_breakdown"]["restore"] <= restore["seconds"] + 1e-6
    firsts = [next(r for r in by_attempt[a] if r["type"] == "step") for a in (0, 1)]
    job = job_accounting(records)
    # Both launches' restores (the first one's look for a checkpoint too) are restore time.
    assert job["badput"]["restore"] == pytest.approx(sum(f["before_step_breakdown"].get("restore", 0.0)
                                                         for f in firsts), abs=1e-6)
    (cost,) = job["after_restore"]
    assert cost["step"] == restored + 1 and cost["attempt"] == 1
    # Defined once (summary.after_restore_costs); on this small shared machine it can be 0.
    assert cost["one_off_seconds"] == pytest.approx(max(0.0, first["interval_seconds"]
                                                        - cost["typical_step_interval_seconds"]), abs=1e-9)
    assert set(job["badput"]) == set(BUCKETS)
    assert job["productive_seconds"] + sum(job["badput"].values()) == pytest.approx(job["total_seconds"], abs=1e-6)
