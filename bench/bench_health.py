"""Cost of GPU health sampling (health="nvml", steptrace/_health.py) on the fake NVML (tests/fake_nvml.py),
against the same loop with health off.

Usage::

    .venv/bin/python bench/bench_health.py            # 5 rounds x 1,500 steps per variant
    .venv/bin/python bench/bench_health.py --quick    # 2 rounds x 500

Each variant runs ``--steps`` steps of ``--work-ms`` of pure-Python work (a step's host side, holding
the GIL as a real loop's Python does), JSONL off, a ``MemorySink``; ``nvml`` samples the fake GPU at
the default period (1 s). Variants run interleaved, round by round, so this machine's drift hits
them alike. Per round and variant:

* **loop**: wall time of the loop per step; the ratio to ``off`` (paired in the round) is what the
  sampler's thread and the resolver's window lookup cost the training thread (neither runs on it);
* **resolver CPU**: the resolver thread's CPU per step (it takes each step's window);
* **sampler CPU**: the sampler thread's CPU per step and per sample.

Then, apart, the two operations by themselves (``--calls`` times each): one sample of every field
(``HealthSampler.sample``, ~20 NVML calls) and one step's window lookup (``HealthSampler.window``). On
the fake an NVML call is a Python method; the real one is a ctypes call (~1.1 µs for
``nvmlDeviceGetPowerUsage`` on an H200, GPU-FINDINGS.md): tests/gpu/test_nvml.py measures a real sample.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import fake_nvml  # noqa: E402
import steptrace  # noqa: E402
from steptrace import _health  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

VARIANTS = ("off", "nvml")


def _work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def run(variant: str, steps: int, work_s: float, first_step: int) -> dict:
    health = {} if variant == "off" else {"health": "nvml", "health_device": "GPU-fake-0"}
    steptrace.init(run_id=f"{variant}-{first_step}", backend="host", jsonl=False, sinks=[MemorySink()],
                   stall_watch=False, **health)
    cpu_thread = time.thread_time()
    t0 = time.perf_counter()
    for n in range(first_step, first_step + steps):
        with steptrace.step(n):
            _work(work_s)
    loop = time.perf_counter() - t0
    train_cpu = time.thread_time() - cpu_thread
    steptrace.flush(timeout_s=60)
    stats = steptrace.stats()
    runtime = steptrace._active
    sampler = getattr(runtime, "health", None)
    samples = sampler.samples_taken if sampler is not None else 0
    steptrace.shutdown(timeout_s=60)
    cpu = stats["background_cpu_seconds"]
    return {"loop": loop / steps, "train_cpu": train_cpu / steps, "resolver": cpu.get("resolver", 0.0) / steps,
            "sampler": cpu.get("health", 0.0) / steps, "samples": samples,
            "per_sample": cpu.get("health", 0.0) / samples if samples else 0.0}


def alone(calls: int) -> tuple[float, float, int]:
    """Seconds per sample and per window lookup, and the NVML calls one sample makes."""
    fake = fake_nvml.FakeNvml([fake_nvml.gpu(0)])
    _health.init_nvml(fake)
    sampler = _health.HealthSampler(fake, "GPU-fake-0")
    sampler._open()
    sampler.sample()
    before = fake.calls
    t0 = time.perf_counter()
    for _ in range(calls):
        sampler.sample()
    per_sample = (time.perf_counter() - t0) / calls
    nvml_calls = (fake.calls - before) // calls
    t0 = time.perf_counter()
    for _ in range(calls):
        sampler.window(time.perf_counter())  # one sample between lookups at most: the usual case
    per_window = (time.perf_counter() - t0) / calls
    return per_sample, per_window, nvml_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.calls = 2, 500, 500
    sys.modules["pynvml"] = fake_nvml.FakeNvml([fake_nvml.gpu(0)])
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    step = 0
    for _ in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(run(variant, args.steps, args.work_ms / 1e3, step))
            step += args.steps
    print(f"{args.rounds} rounds x {args.steps} steps of {args.work_ms:g} ms host work, health period 1 s; "
          "medians over rounds\n")
    print("| health | loop per step | x off (paired) | training-thread CPU per step | resolver CPU per step | "
          "sampler CPU per step | samples per run | sampler CPU per sample |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        rows = results[variant]
        ratio = statistics.median(r["loop"] / b["loop"] for r, b in zip(rows, results["off"]))

        def med(key: str, scale: float = 1e6, rows: list[dict] = rows) -> float:
            return statistics.median(r[key] for r in rows) * scale

        print(f"| {variant} | {med('loop', 1e3):.3f} ms | {ratio:.3f} | {med('train_cpu', 1e3):.3f} ms | "
              f"{med('resolver'):.1f} µs | {med('sampler'):.2f} µs | {med('samples', 1):.0f} | "
              f"{med('per_sample'):.0f} µs |")
    per_sample, per_window, nvml_calls = alone(args.calls)
    print(f"\nalone, {args.calls} calls each on the fake: one sample {per_sample * 1e6:.1f} µs ({nvml_calls} NVML "
          f"calls), one step's window lookup {per_window * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
