"""Integration test: the JAX demo (examples/train_jax.py) runs end to end and tells the truth.

Runs the real example in a subprocess (real JAX async dispatch, optax, orbax
checkpoints) and checks the run directory it leaves behind and what it prints.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_jax.py"
STEPS = 12
CHECKPOINT_EVERY = 5
PEAK_TFLOPS = 1.0  # a CPU has no entry in steptrace's peak table


def _missing(*modules: str) -> list[str]:
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):  # a parent package is missing
            missing.append(name)
    return missing


_MISSING = _missing("jax", "optax", "orbax.checkpoint", "rich")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(_MISSING), reason=f"the JAX demo needs {', '.join(_MISSING)}: "
                                              "pip install -e '.[demo]'"),
]


def _naive_seconds(stdout: str, step: int) -> float:
    """The 'naive s' cell of ``step``'s row in the comparison table."""
    in_table = False
    for line in stdout.splitlines():
        if "naive host timing vs steptrace" in line:
            in_table = True
            continue
        if not in_table:
            continue
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        cells = [c for c in cells if c]
        if len(cells) >= 2 and cells[0] == str(step):
            return float(cells[1])
    raise AssertionError(f"no row for step {step} in the comparison table:\n{stdout}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("steptrace-runs")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
         "--run-dir", str(run_dir), "--peak-tflops", str(PEAK_TFLOPS)],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLE.parent.parent,
    )
    return run_dir, proc


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "demo" / "rank-0.jsonl"
    assert path.is_file(), f"{path} was not written"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_demo_exits_cleanly(demo_run):
    _, proc = demo_run
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_demo_writes_steps_and_checkpoints(demo_run):
    run_dir, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    records = _records(run_dir)
    steps = [r for r in records if r.get("type") == "step"]
    checkpoints = [r for r in records if r.get("type") == "checkpoint"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["status"] == "ok" for r in steps)
    assert 2 <= len(checkpoints) <= 3, checkpoints
    assert all(c["status"] == "ok" and c["blocking_seconds"] >= 0 for c in checkpoints)
    # The orbax adapter times each asynchronous save's background commit too, and the blocking part
    # is the next step's checkpoint idle time, never more (the commit is charged to no step).
    by_step = {r["step"]: r for r in steps}
    for c in checkpoints:
        assert c["async_seconds"] is not None and c["after_step"] == c["step"]
        if c["step"] + 1 in by_step:
            assert by_step[c["step"] + 1]["idle_breakdown"].get("checkpoint", 0.0) == pytest.approx(
                c["blocking_seconds"], abs=1e-6)
    # The checkpoints are real orbax saves on disk.
    saved = {int(p.name) for p in (run_dir / "demo" / "ckpt").iterdir() if p.name.isdigit()}
    assert saved and saved <= {c["step"] for c in checkpoints}
    # Nothing was lost on the way to the file.
    run = [r for r in records if r.get("type") == "run"]
    assert run and not any(run[-1]["dropped"].values()), run


def test_step_zero_compile_is_idle_not_compute(demo_run):
    run_dir, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    step0 = next(r for r in _records(run_dir) if r.get("type") == "step" and r["step"] == 0)
    assert step0["idle_breakdown"].get("compile", 0.0) > 0, step0
    assert step0["backend"] == "jax", step0
    # The naive clock charges the compile to step 0; steptrace's device compute excludes it.
    naive0 = _naive_seconds(proc.stdout, 0)
    assert step0["compute_seconds"] < naive0, (step0["compute_seconds"], naive0)


def test_demo_prints_comparison_and_report(demo_run):
    _, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "naive host timing vs steptrace" in out
    for header in ("naive s", "naive TFLOP/s", "steptrace interval s", "compute s", "steptrace TFLOP/s"):
        assert header in out, header
    for step in range(STEPS):
        assert _naive_seconds(out, step) >= 0
    assert "Step 0:" in out and "compile" in out
    assert "Checkpoint after step" in out and "in the background for" in out
    # ...and then the steptrace report, once.
    assert out.count("steptrace run demo") == 1
    assert "Summary (rank 0)" in out


def test_demo_reads_hardware_flops_from_the_compiler_and_shows_mfu_and_hfu_with_their_parts(demo_run):
    """flops="auto": every step's hardware FLOPs from XLA's cost analysis of the compiled train_step
    (compiled in step 0); the analytic 6·params·batch is the model FLOPs. The report shows both,
    TFLOP/s, and MFU and HFU with the formula line of each."""
    run_dir, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    steps = [r for r in _records(run_dir) if r.get("type") == "step"]
    hardware = {r["hardware_flops"] for r in steps}
    assert len(hardware) == 1 and next(iter(hardware)) > 0
    for r in steps:
        assert r["flops_source"] == "xla_cost_analysis" and r["model_flops"] > 0
        assert r["peak_flops"] == PEAK_TFLOPS * 1e12
        assert r["tflops_per_second"] == pytest.approx(r["hardware_flops"] / r["compute_seconds"] / 1e12)
        assert r["hfu"] == pytest.approx(r["hardware_flops"] / r["compute_seconds"] / r["peak_flops"])
        assert r["mfu"] == pytest.approx(r["model_flops"] / r["compute_seconds"] / r["peak_flops"])
    out = proc.stdout
    assert "hardware FLOPs" in out and "xla_cost_analysis" in out and "TFLOP/s" in out
    assert "= model FLOPs / compute s / peak" in out and "= hardware FLOPs / compute s / peak" in out


def test_a_second_demo_run_replaces_the_first_and_refuses_anything_else(tmp_path):
    """`make demo` twice: the first run left its records, checkpoints and steptrace's attempts file
    (rank-0.attempts), which the second run used to call foreign and refuse to delete."""
    spec = importlib.util.spec_from_file_location("train_jax_demo", EXAMPLE)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    run = tmp_path / "demo"
    (run / "ckpt").mkdir(parents=True)
    (run / "rank-0.jsonl").write_text("{}\n")
    (run / "rank-0.attempts").write_text("{}\n")
    demo.clean_run_dir(run)
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="notes.txt"):
        demo.clean_run_dir(run)
    assert (run / "notes.txt").read_text() == "mine"
