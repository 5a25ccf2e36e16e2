"""Cost per step of the tracker sinks (steptrace.trackers): TensorBoard, MLflow (local file store),
W&B (offline), against the same loop with no tracker.

Usage::

    .venv/bin/python bench/bench_trackers.py             # 5 rounds x 400 steps per variant
    .venv/bin/python bench/bench_trackers.py --quick     # 2 rounds x 200

Each variant runs ``--steps`` steps of ``--work-ms`` of pure-Python work (a training step's host
side, holding the GIL as a real loop's Python does), one ``span("data")`` and ``tokens=``, with
JSONL off and a ``MemorySink`` (every variant has it; the baseline has nothing else). Variants run
interleaved, round by round, so this machine's drift hits them alike. Per round and variant:

* **loop**: wall time of the loop per step; the ratio to ``none`` (paired in the round) is what the
  tracker's thread costs the training thread (it competes for the GIL, it never blocks a step);
* **sink CPU**: the tracker's own thread's CPU time per step (``stats()["background_cpu_seconds"]
  ["sink:<name>"]``), measured after ``shutdown()`` wrote everything out;
* **flush**: the time ``shutdown()`` took (what is left to write at the end).

Reported: medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import steptrace  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

VARIANTS = ("none", "tensorboard", "mlflow", "wandb")


def _work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def run(variant: str, steps: int, work_s: float, first_step: int, root: str) -> dict:
    sinks: list = [MemorySink()]
    trackers = "" if variant == "none" else variant
    if variant == "wandb":
        from steptrace.trackers import WandbSink

        sinks.append(WandbSink(dir=root, project="steptrace-bench", mode="offline"))
        trackers = ""
    steptrace.init(run_dir=root, run_id=f"{variant}-{first_step}", backend="host", jsonl=False, sinks=sinks,
                   trackers=trackers or (), stall_watch=False)
    t0 = time.perf_counter()
    for n in range(first_step, first_step + steps):
        with steptrace.step(n, tokens=4096):
            with steptrace.span("data"):
                pass
            _work(work_s)
    loop = time.perf_counter() - t0
    steptrace.flush(timeout_s=60)
    t1 = time.perf_counter()
    stats_before = steptrace.stats()
    steptrace.shutdown(timeout_s=60)
    flush = time.perf_counter() - t1
    cpu = stats_before["background_cpu_seconds"].get(f"sink:{variant}", 0.0)
    dropped = sum(v for k, v in stats_before["dropped"].items() if k.startswith("sink:"))
    return {"loop_per_step": loop / steps, "sink_cpu_per_step": cpu / steps, "flush": flush, "dropped": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 200
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    step = 0
    with tempfile.TemporaryDirectory() as root:
        os.environ["MLFLOW_TRACKING_URI"] = Path(root, "mlruns").as_uri()
        for _ in range(args.rounds):
            for variant in VARIANTS:
                results[variant].append(run(variant, args.steps, args.work_ms / 1e3, step, root))
                step += args.steps
    print(f"{args.rounds} rounds x {args.steps} steps of {args.work_ms:g} ms host work; medians over rounds\n")
    print("| tracker | loop per step | x none (paired) | sink CPU per step | shutdown | sink drops |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        rows = results[variant]
        ratio = statistics.median(r["loop_per_step"] / b["loop_per_step"] for r, b in zip(rows, results["none"]))
        print(f"| {variant} | {statistics.median(r['loop_per_step'] for r in rows) * 1e3:.3f} ms | {ratio:.3f} | "
              f"{statistics.median(r['sink_cpu_per_step'] for r in rows) * 1e6:.0f} µs | "
              f"{statistics.median(r['flush'] for r in rows) * 1e3:.0f} ms | "
              f"{sum(r['dropped'] for r in rows)} |")


if __name__ == "__main__":
    main()
