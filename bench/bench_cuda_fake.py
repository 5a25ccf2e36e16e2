"""steptrace's CUDA path on the CPU fake (tests/fake_cuda.py): training-thread CPU per step and per microbatch.

Usage::

    python bench/bench_cuda_fake.py            # 7 rounds
    python bench/bench_cuda_fake.py --quick

What is timed: the training thread's own CPU (``time.thread_time()``), so what the resolver and
sink threads take meanwhile is not counted (torch ops and ``Event.record`` release the GIL on a real
GPU, so wall time on the training thread is not steptrace's cost alone). Loops, interleaved within
each round, each ``--steps`` steps of one fake kernel launch:

* ``plain``: the launch alone; ``steptrace``: inside ``with steptrace.step(n):``;
* ``plain, 8 mb`` / ``steptrace, 8 mb``: eight launches per step, each in ``steptrace.microbatch``;
* ``steptrace, span``: the step with a ``steptrace.span`` around its launch (on CUDA a marker at the
  span's start and, since issue 32, at its end);
* ``plain, scalar`` / ``steptrace, s.log``: the launch computes a one-element CUDA tensor, which the
  traced loop logs with ``s.log(loss=...)`` (its copy to pinned host memory and an event; pooled
  since issue 32).

Printed: the median over rounds of the paired per-step (per-microbatch, per-span, per-s.log)
difference, and the
resolver thread's CPU per step (``stats()["background_cpu_seconds"]["resolver"]``: GIL time, the
resolver being pure Python) over the one-kernel loop. The fake's
``Event.record`` and stream lookups are Python here (about a microsecond each), so these figures are
an upper bound on what the same code costs against real CUDA, where they are C calls.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (2000 if args.quick else 5000)
    try:
        import torch  # noqa: F401
        from _pytest.monkeypatch import MonkeyPatch
    except ImportError:
        print("bench_cuda_fake: needs torch and pytest (pip install -e '.[torch,test]')")
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_cuda import FakeCuda

    import steptrace
    from steptrace.testing import MemorySink

    patch = MonkeyPatch()
    fake = FakeCuda(patch)
    base = [0]

    def next_base(n: int) -> int:
        base[0] += n
        return base[0] - n

    def plain(n: int, mbs: int) -> float:
        c0 = time.thread_time()
        for _ in range(n):
            for _i in range(mbs):
                fake.run(0.0)
        return time.thread_time() - c0

    def plain_scalar(n: int) -> float:
        c0 = time.thread_time()
        for _ in range(n):
            fake.scalar(1.0)
        return time.thread_time() - c0

    def traced_span(n: int) -> float:
        b = next_base(n)
        c0 = time.thread_time()
        for i in range(n):
            with steptrace.step(b + i):
                with steptrace.span("data"):
                    fake.run(0.0)
        return time.thread_time() - c0

    def traced_log(n: int) -> float:
        b = next_base(n)
        c0 = time.thread_time()
        for i in range(n):
            with steptrace.step(b + i) as s:
                s.log(loss=fake.scalar(1.0))
        return time.thread_time() - c0

    def traced(n: int, mbs: int) -> float:
        b = next_base(n)
        c0 = time.thread_time()
        if mbs == 1:
            for i in range(n):
                with steptrace.step(b + i):
                    fake.run(0.0)
        else:
            for i in range(n):
                with steptrace.step(b + i):
                    for j in range(mbs):
                        with steptrace.microbatch(j, stage=0):
                            fake.run(0.0)
        return time.thread_time() - c0

    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="bench-cuda-fake", backend="torch",
                   prometheus_port=None)
    try:
        traced(200, 1)
        traced(50, 8)
        traced_span(200)
        traced_log(200)
        steptrace.flush()
        per_step, per_mb, per_span, per_log, background = [], [], [], [], []

        def resolver_cpu() -> float:
            return steptrace.stats()["background_cpu_seconds"]["resolver"]

        for _ in range(rounds):
            a = plain(steps, 1)
            r0 = resolver_cpu()
            b = traced(steps, 1)
            steptrace.flush()
            background.append((resolver_cpu() - r0) / steps)
            c = plain(steps // 8, 8)
            d = traced(steps // 8, 8)
            steptrace.flush()
            e = traced_span(steps)
            f = plain_scalar(steps)
            g = traced_log(steps)
            steptrace.flush()
            per_step.append((b - a) / steps)
            # Per microbatch: the step's own share (per_step) taken out.
            per_mb.append(((d - c) / (steps // 8) - (b - a) / steps) / 8)
            per_span.append((e - b) / steps)
            per_log.append((g - f) / steps - (b - a) / steps)
        stats = steptrace.stats()
    finally:
        steptrace.shutdown()
        patch.undo()
    print(f"bench_cuda_fake: {rounds} rounds of {steps} steps, torch {torch.__version__} (CPU, CUDA faked)")
    print(f"  training-thread CPU per step        +{statistics.median(per_step) * 1e6:6.2f} µs")
    print(f"  training-thread CPU per microbatch  +{statistics.median(per_mb) * 1e6:6.2f} µs")
    print(f"  training-thread CPU per span        +{statistics.median(per_span) * 1e6:6.2f} µs (in a step)")
    print(f"  training-thread CPU per s.log       +{statistics.median(per_log) * 1e6:6.2f} µs (a CUDA scalar)")
    print(f"  resolver CPU (GIL) per step          {statistics.median(background) * 1e6:6.2f} µs (no microbatches)")
    total = sum(stats["background_cpu_seconds"].values())
    print(f"  background CPU (resolver + sinks), whole run: {total:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
