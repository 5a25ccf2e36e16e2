"""The JAX-on-GPU measurement of test_jax_gpu.py, in a process of its own: CUPTI takes one subscriber
per process (jax.profiler failed with CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED after
torch.profiler ran in the same pytest process on an H200), so the trace is taken here.

Prints one JSON line: per step (backend, end_source, compute_seconds, end_time) and the device's own
windows of each ``jit_train_step`` execution from XLA's trace. Arguments: a directory for the trace,
then ``torch`` to make torch's CUDA context first (a pinned-memory loader) or ``jax-only``.
"""

import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import steptrace  # noqa: E402
from kernel_timeline import load_json, xla_module_windows  # noqa: E402
from steptrace.testing import capture  # noqa: E402

STEPS = 16


def main(trace_dir: str, mode: str) -> None:
    if mode == "torch":
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # torch's CUDA context exists, as with a pinned-memory loader

    @jax.jit
    def train_step(x):
        for _ in range(6):
            x = jnp.tanh(x @ x) * 0.5
        return x

    x = jnp.ones((4096, 4096), jnp.float32)
    train_step(x).block_until_ready()  # compile and autotune before the trace
    with capture() as sink:
        # Step 0 carries the run's one-off work on steptrace's side (its metadata record): its end is
        # observed. The steps under test follow it.
        with steptrace.step(0) as s:
            x = train_step(x)
            s.wait_for(x)
        steptrace.flush()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for n in range(1, STEPS + 1):
                with steptrace.step(n) as s:
                    x = train_step(x)
                    s.wait_for(x)
            x.block_until_ready()
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    modules = xla_module_windows(load_json(path), module="jit_train_step", runs=STEPS)
    steps = sorted((r for r in sink.steps() if r["step"] >= 1), key=lambda r: r["step"])
    json.dump({"steps": [{k: r.get(k) for k in ("step", "backend", "end_source", "compute_seconds", "end_time",
                                                 "interval_seconds")} for r in steps],
               "modules": modules, "torch": "torch" in sys.modules}, sys.stdout)
    print()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "torch")
