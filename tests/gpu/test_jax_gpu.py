"""JAX on a GPU, in a process that also uses torch on CUDA (a DataLoader, say): steps are timed by
JAX, never by an empty torch stream (the issue saw compute -90 % labelled ``torch-cuda``), and the
step times are checked against XLA's own device timeline of the same run (``jax_gpu_child.py``, in a
process of its own: CUPTI takes one profiler per process)."""

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
pytest.importorskip("torch", reason="the case under test is torch imported next to JAX")

from kernel_timeline import relative_error  # noqa: E402

from .conftest import median_and_p95  # noqa: E402

pytestmark = pytest.mark.integration


def _measure(tmp_path):
    child = Path(__file__).with_name("jax_gpu_child.py")
    out = subprocess.run([sys.executable, str(child), str(tmp_path)], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jax_steps_next_to_cuda_torch_are_timed_by_jax(tmp_path):
    result = _measure(tmp_path)
    steps, modules = result["steps"], result["modules"]
    assert [r["backend"] for r in steps] == ["jax"] * len(steps)
    assert len(modules) == len(steps), modules
    errors, interval_errors = [], []
    for i in range(1, len(steps)):
        (start, end), (_, previous_end) = modules[i], modules[i - 1]
        # Steps run back to back: the device's compute of step i is its execution window, and the
        # interval between ends is what the device took from one end to the next.
        errors.append(relative_error(steps[i]["compute_seconds"], end - start))
        interval_errors.append(relative_error(steps[i]["end_time"] - steps[i - 1]["end_time"], end - previous_end))
    median, p95 = median_and_p95(errors)
    assert median <= 0.03, (median, p95, errors, [r["end_source"] for r in steps])
    median, p95 = median_and_p95(interval_errors)
    assert median <= 0.03, ("intervals", median, p95, interval_errors)
