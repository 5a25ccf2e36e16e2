"""The JAX-on-GPU measurement of test_jax_gpu.py, in a process of its own: CUPTI takes one subscriber
per process (jax.profiler failed with CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED after
torch.profiler ran in the same pytest process on an H200), so the trace is taken here.

Prints one JSON line: per step (backend, end_source, compute_seconds, end_time) and the device's own
windows of each ``jit_train_step`` execution from XLA's trace. Argument: a directory for the trace.
"""

import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import steptrace  # noqa: E402
from kernel_timeline import load_json, xla_module_windows  # noqa: E402
from steptrace.testing import capture  # noqa: E402

STEPS = 16


def main(trace_dir: str) -> None:
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # torch's CUDA context exists, as with a pinned-memory loader

    @jax.jit
    def train_step(x):
        for _ in range(6):
            x = jnp.tanh(x @ x) * 0.5
        return x

    x = jnp.ones((4096, 4096), jnp.float32)
    train_step(x).block_until_ready()  # compile and autotune before the trace
    with capture() as sink, jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for n in range(STEPS):
            with steptrace.step(n) as s:
                x = train_step(x)
                s.wait_for(x)
        x.block_until_ready()
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    modules = xla_module_windows(load_json(path), module="jit_train_step", runs=STEPS)
    steps = sorted(sink.steps(), key=lambda r: r["step"])
    json.dump({"steps": [{k: r.get(k) for k in ("step", "backend", "end_source", "compute_seconds", "end_time",
                                                 "interval_seconds")} for r in steps],
               "modules": modules}, sys.stdout)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
