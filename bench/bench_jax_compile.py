"""Where JAX compile time lands in steptrace's records, against the compile events of an in-run
``jax.profiler`` trace (issue 34: "compile before the first step and between steps labelled
``compile`` within 20 % of the trace's compile time").

Usage::

    .venv/bin/python bench/bench_jax_compile.py            # 3 runs, each in a fresh process
    .venv/bin/python bench/bench_jax_compile.py --runs 1

The loop compiles where real trainers do (nanodo's order, read, not copied):

* **before the first step**: the state is made by a jitted ``init`` (its compile), and a jitted
  ``warm`` is called once;
* **inside step 0**: the first call of the train step;
* **between steps**: the first call of the eval step at step 10 (inside an ``eval`` span) and, at
  step 20, an eval on a new batch shape (a recompile), outside any span.

Truth: the trace's compile events, which JAX's dispatch emits around each stage
(``lower_sharding_computation``: lowering to MLIR; ``backend_compile_and_load``: XLA's compile),
summed by where they fall against the ``StepTraceAnnotation`` of each step (steptrace's own, opened at
``begin_step``), less the part during which the device was executing (the trace's XLA executions):
by the timing model a host span is idle, and so ``compile``, only while the device has nothing to do.
The loop reads the previous step's loss after each step (as nanodo logs its metrics), so the
device is usually drained when the host compiles between steps. Tracing to a jaxpr has no trace
event on CPU; the truth adds JAX's own ``/jax/core/compile/jaxpr_trace_duration`` events (from
``jax.monitoring``, steptrace's source too), by the region they were reported in, and the table
shows the trace alone beside it.

steptrace's figures: the first step's ``before_step_breakdown["compile"]``, step 0's
``idle_breakdown["compile"]``, and the ``idle_breakdown["compile"]`` of the steps after a compile
between steps.

Each run is its own process: JAX caches compiled functions per process.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 30
WIDTH = 256
LAYERS = 24
COMPILE_EVENTS = ("lower_sharding_computation", "backend_compile_and_load")


def one_run(trace_dir: str) -> dict[str, Any]:
    from _workload import ListSink, configure_xla

    configure_xla()
    import jax
    import jax.numpy as jnp

    import steptrace

    records: list[dict] = []

    def init(key):
        keys = jax.random.split(key, LAYERS)
        return [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5 for k in keys]

    def forward(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return x

    def train_step(params, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(forward(p, x) ** 2))(params)
        return [w - 1e-3 * g for w, g in zip(params, grads)], loss

    def eval_step(params, x):
        return jnp.mean(forward(params, x))

    phase = ["before the first step"]
    tracing = {"before the first step": 0.0, "inside step 0": 0.0, "between steps": 0.0}

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            tracing[phase[0]] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    steptrace.init(jsonl=False, run_id="bench-compile", sinks=[ListSink(records)], annotate=True, backend="jax")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    try:
        params = jax.jit(init)(jax.random.PRNGKey(0))  # compile before the first step
        jax.block_until_ready(jax.jit(lambda p: [w * 1.0 for w in p])(params))
        train, evaluate = jax.jit(train_step), jax.jit(eval_step)
        batch = jnp.ones((64, WIDTH))
        previous = None
        for n in range(STEPS):
            if n == 10:
                with steptrace.span("eval"):
                    float(evaluate(params, batch))  # compile between steps, in an eval span
            if n == 20:
                float(evaluate(params, jnp.ones((32, WIDTH))))  # a recompile between steps, no span
            steptrace.begin_step(n)
            phase[0] = "inside step 0" if n == 0 else "between steps"
            params, loss = train(params, batch)
            steptrace.end_step(wait_for=loss)
            phase[0] = "between steps"
            if previous is not None:
                float(previous)  # the previous step's metrics, as nanodo logs them
            previous = loss
        jax.block_until_ready(params)
        steptrace.flush(30)
    finally:
        steptrace.shutdown()
        jax.profiler.stop_trace()
    steps = sorted((r for r in records if r.get("type") == "step"), key=lambda r: r["step"])
    return {"steps": steps, "truth": compile_truth(trace_dir), "tracing": tracing}


def compile_truth(trace_dir: str) -> dict[str, float]:
    """Seconds of the trace's compile events before step 0's annotation, inside step 0's, and between
    the later steps' annotations (each step's annotation runs from begin_step to end_step)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps: dict[int, tuple[float, float]] = {}
    compiles: list[tuple[float, float]] = []
    executions: dict[Any, list[float]] = {}
    for e in events:
        start = float(e["ts"]) / 1e6
        end = start + float(e.get("dur", 0.0)) / 1e6
        args = e.get("args") or {}
        if e.get("name") == "train" and "step_num" in args:
            steps[int(args["step_num"])] = (start, end)
        elif e.get("name") in COMPILE_EVENTS:
            compiles.append((start, end))
        elif "hlo_module" in args and "run_id" in args:
            window = executions.setdefault((args["hlo_module"], args["run_id"]), [start, end])
            window[0], window[1] = min(window[0], start), max(window[1], end)
    busy = sorted(executions.values())
    first_start, first_end = steps[0]
    truth = {"before the first step": 0.0, "inside step 0": 0.0, "between steps": 0.0}
    for start, end in compiles:
        idle = (end - start) - sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        if end <= first_start:
            truth["before the first step"] += idle
        elif start < first_end:
            truth["inside step 0"] += idle
        else:
            truth["between steps"] += idle
    return truth


def steptrace_figures(steps: list[dict]) -> dict[str, float]:
    first = steps[0]
    return {
        "before the first step": (first.get("before_step_breakdown") or {}).get("compile", 0.0),
        "inside step 0": (first.get("idle_breakdown") or {}).get("compile", 0.0),
        "between steps": sum((r.get("idle_breakdown") or {}).get("compile", 0.0) for r in steps[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        with tempfile.TemporaryDirectory() as trace_dir:
            result = one_run(trace_dir)
        Path(args.child).write_text(json.dumps(result))
        return 0
    import jax

    print("steptrace bench_jax_compile: compile time by where it happened, steptrace vs the trace")
    print(f"  {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  nproc={os.cpu_count()}  "
          f"python {sys.version.split()[0]}  jax {jax.__version__}  {args.runs} run(s), each a fresh process")
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, __file__, "--child", out.name], check=True)
            result = json.loads(Path(out.name).read_text())
        ours = steptrace_figures(result["steps"])
        for where, in_trace in result["truth"].items():
            rows.setdefault(where, []).append((ours[where], in_trace, in_trace + result["tracing"][where]))
    print()
    print(f"{'where':<24}{'steptrace ms':>14}{'trace ms':>10}{'+ tracing ms':>14}{'ratio':>8}"
          "   per run (steptrace / trace + tracing)")
    worst = 0.0
    for where, triples in rows.items():
        ours = statistics.median(t[0] for t in triples) * 1e3
        in_trace = statistics.median(t[1] for t in triples) * 1e3
        true = statistics.median(t[2] for t in triples) * 1e3
        ratios = [t[0] / t[2] if t[2] else float("nan") for t in triples]
        worst = max(worst, *(abs(r - 1) for r in ratios if r == r))
        print(f"{where:<24}{ours:>14.1f}{in_trace:>10.1f}{true:>14.1f}{ours / true if true else float('nan'):>8.2f}   "
              + " ".join(f"{r:.2f}" for r in ratios))
    print()
    print(f"  goal (issue 34): within 20 % of the trace's compile time: worst run {worst * 100:.0f} % -> "
          f"{'met' if worst <= 0.20 else 'MISSED'}")
    print("  truth = the trace's lowering and XLA compile events while the device was idle, + JAX's own")
    print("  tracing durations (jax.monitoring; the trace has no event for tracing to a jaxpr)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
