"""JAX on a GPU: each step's end read from the device's clock (the outputs handed through DLPack to a
CUDA stream of steptrace's, an event behind them; issue 34), checked against XLA's own device timeline
of the same run (``jax_gpu_child.py``, in a process of its own: CUPTI takes one profiler per process).
Twice: with torch's CUDA context in the process (a DataLoader, say: steps are still timed by JAX, never
by an empty torch stream) and with JAX alone (the CUDA driver is reached without torch)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax", reason="needs jax")
try:
    jax.devices("gpu")
except RuntimeError:
    pytest.skip("needs JAX with a CUDA GPU (jax.devices('gpu') failed)", allow_module_level=True)

from kernel_timeline import relative_error  # noqa: E402

from .conftest import median_and_p95  # noqa: E402

pytestmark = pytest.mark.integration


def _measure(tmp_path, mode):
    child = Path(__file__).with_name("jax_gpu_child.py")
    out = subprocess.run([sys.executable, str(child), str(tmp_path), mode], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["torch", "jax-only"])
def test_jax_steps_end_on_the_device_clock_and_match_xla_s_trace(tmp_path, mode):
    if mode == "torch":
        pytest.importorskip("torch", reason="the case under test is torch imported next to JAX")
    result = _measure(tmp_path, mode)
    steps, modules = result["steps"], result["modules"]
    assert result["torch"] == (mode == "torch")
    assert [r["backend"] for r in steps] == ["jax"] * len(steps)
    assert [r["end_source"] for r in steps] == ["device"] * len(steps), steps
    assert len(modules) == len(steps), modules
    errors, interval_errors = [], []
    for i in range(1, len(steps)):
        (start, end), (_, previous_end) = modules[i], modules[i - 1]
        # Steps run back to back: the device's compute of step i is its execution window, and the
        # interval between ends is what the device took from one end to the next.
        errors.append(relative_error(steps[i]["compute_seconds"], end - start))
        interval_errors.append(relative_error(steps[i]["end_time"] - steps[i - 1]["end_time"], end - previous_end))
    median, p95 = median_and_p95(errors)
    print(f"\n[{mode}] compute |error| median {median:.2%} p95 {p95:.2%}; intervals", end=" ")
    assert median <= 0.01 and p95 <= 0.03, (median, p95, errors)
    median, p95 = median_and_p95(interval_errors)
    print(f"median {median:.2%} p95 {p95:.2%}")
    assert median <= 0.01 and p95 <= 0.03, ("intervals", median, p95, interval_errors)
