"""JAX on a GPU, in a process that also uses torch on CUDA (a DataLoader, say): steps are timed by
JAX, never by an empty torch stream (the issue saw compute -90 % labelled ``torch-cuda``), and the
observed ends are checked against XLA's own device timeline of the same run."""

import glob

import pytest

jax = pytest.importorskip("jax", reason="needs jax")
try:
    jax.devices("gpu")
except RuntimeError:
    pytest.skip("needs JAX with a CUDA GPU (jax.devices('gpu') failed)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the case under test is torch imported next to JAX")

import jax.numpy as jnp  # noqa: E402

import steptrace  # noqa: E402
from kernel_timeline import load_json, relative_error, xla_module_windows  # noqa: E402
from steptrace.testing import capture  # noqa: E402

from .conftest import median_and_p95  # noqa: E402

pytestmark = pytest.mark.integration


def test_jax_steps_next_to_cuda_torch_are_timed_by_jax(tmp_path):
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # torch's CUDA context exists, as with a pinned-memory loader

    @jax.jit
    def train_step(x):
        for _ in range(6):
            x = jnp.tanh(x @ x) * 0.5
        return x

    x = jnp.ones((4096, 4096), jnp.float32)
    train_step(x).block_until_ready()  # compile and autotune before the trace
    with capture() as sink, jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for n in range(16):
            with steptrace.step(n) as s:
                x = train_step(x)
                s.wait_for(x)
        x.block_until_ready()
    (path,) = glob.glob(str(tmp_path / "**" / "perfetto_trace.json.gz"), recursive=True)
    # The device's own time of each execution: the "XLA Modules" line, or the kernels' hlo_module
    # (jax 0.11.2's exported trace on an H100 had only Stream lines).
    modules = xla_module_windows(load_json(path), module="jit_train_step", runs=16)
    steps = sorted(sink.steps(), key=lambda r: r["step"])
    assert [(r["backend"], r["end_source"]) for r in steps] == [("jax", "observed")] * 16
    assert len(modules) == 16, modules
    errors = []
    for record, (start, end) in zip(steps[1:], modules[1:]):
        # Observed ends are never early, but a step's compute runs from the previous observed end,
        # late as well: no one-sided bound follows for the compute, only the error's size.
        errors.append(relative_error(record["compute_seconds"], end - start))
    median, _ = median_and_p95(errors)
    assert median <= 0.03, errors
