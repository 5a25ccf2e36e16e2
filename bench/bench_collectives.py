"""Training-thread cost of timing a collective (steptrace.adapters.torch_distributed), on CPU.

Usage::

    .venv/bin/python bench/bench_collectives.py            # 15 rounds x 20000 calls per variant
    .venv/bin/python bench/bench_collectives.py --quick    # 5 rounds x 5000
    .venv/bin/python bench/bench_collectives.py --json out.json

What is timed
-------------
The target (issue 20): at most 2 µs per collective on the training thread on CPU. A real gloo
all-reduce costs tens of µs even in a one-rank group, with more jitter than 2 µs, so the wrapper is
measured on its own first, then next to the real collective:

* ``no-op``                 a Python function that returns None (what a synchronous collective returns)
* ``no-op, wrapped``        the same function wrapped by steptrace's collective wrapper, inside an open
                            ``steptrace.step`` (the wait is timed and added to the step)
* ``no-op, wrapped, no step`` the wrapper between steps (the wait is kept for the next step)
* ``all_reduce``            ``torch.distributed.all_reduce`` of a 1-element CPU tensor in a one-rank
                            gloo group, unwrapped
* ``all_reduce, wrapped``   the same through the wrapper, inside a step
* ``no-op, 1000 a step``    the no-op, 1000 calls per ``steptrace.step`` (the baseline of the next row)
* ``no-op, device-timed``   the no-op through the NCCL path's wrapper (:func:`_device_timed`: a group
                            name, a sequence number, two timing events and a handle kept for the
                            resolver), 1000 calls per step (the step keeps at most 4096), with the
                            CUDA events replaced by a do-nothing stand-in: the wrapper's own Python
                            cost. On a GPU add two ``torch.cuda.Event(enable_timing=True)`` and two
                            ``record()`` calls per collective, which only a GPU can time
* ``DDP step``              a one-rank gloo DDP step (forward and backward of 8 ``Linear(64, 64)``
                            layers, 8 gradient buckets) inside ``steptrace.step``, untracked and with
                            :func:`track_ddp` (a hook per parameter, a callback per backward), per step

Every variant runs once per round, interleaved; reported: median and p90 over rounds of ns per call,
and the wrapper's cost = wrapped − unwrapped, paired within each round (median over rounds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 15)
    iters = args.iters or (5000 if args.quick else 20000)

    import torch
    import torch.distributed as dist

    import steptrace
    from steptrace.adapters import torch_distributed
    from steptrace.testing import MemorySink

    torch.set_num_threads(1)
    store_dir = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0,
                            world_size=1)
    tensor = torch.ones(1)
    raw_all_reduce = dist.all_reduce

    def noop(*_args, **_kwargs):
        return None

    wrapped_noop = torch_distributed._timed(noop)

    class NoEvent:  # stands in for torch.cuda.Event: the device-timed wrapper's own cost, events excluded
        __slots__ = ()

        def record(self, stream=None):
            return None

        def query(self):
            return True

        def elapsed_time(self, end):
            return 0.0

    torch_distributed._timing_event = NoEvent
    device_timed_noop = torch_distributed._device_timed(noop)
    wrapped_all_reduce = torch_distributed._timed(raw_all_reduce)
    steptrace.init(sinks=[MemorySink()], jsonl=False, run_id="bench-collectives")

    def in_step(fn, *fn_args):
        def run(n: int) -> None:
            with steptrace.step(n):
                for _ in range(iters):
                    fn(*fn_args)
        return run

    def between_steps(fn, *fn_args):
        def run(n: int) -> None:
            for _ in range(iters):
                fn(*fn_args)
        return run

    def in_steps_of_1000(fn, *fn_args):
        def run(n: int) -> None:
            for k in range(max(1, iters // 1000)):  # step numbers n .. n + 999 are this run's
                with steptrace.step(n + k):
                    for _ in range(1000):
                        fn(*fn_args)
        return run

    from torch.nn.parallel import DistributedDataParallel

    def ddp_model(tracked: bool):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]),
                                        bucket_cap_mb=0.01)
        if tracked:
            torch_distributed.track_ddp(model)
        return model

    ddp_iters = max(1, iters // 100)
    x = torch.randn(8, 64)

    def ddp_steps(model):
        def run(n: int) -> None:
            with steptrace.step(n):
                for _ in range(ddp_iters):
                    model(x).sum().backward()
        return run

    variants = {
        "no-op": in_step(noop),
        "no-op, wrapped": in_step(wrapped_noop),
        "no-op, wrapped, no step": between_steps(wrapped_noop),
        "no-op, 1000 a step": in_steps_of_1000(noop),
        "no-op, device-timed": in_steps_of_1000(device_timed_noop),
        "all_reduce": in_step(raw_all_reduce, tensor),
        "all_reduce, wrapped": in_step(wrapped_all_reduce, tensor),
        "DDP step": ddp_steps(ddp_model(False)),
        "DDP step, tracked": ddp_steps(ddp_model(True)),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    step = 0
    switch = sys.getswitchinterval()
    for _ in range(rounds):
        for name, run in variants.items():
            gc.collect()
            sys.setswitchinterval(1.0)  # keep steptrace's background threads off the GIL meanwhile
            start = time.perf_counter_ns()
            run(step)
            elapsed = time.perf_counter_ns() - start
            sys.setswitchinterval(switch)
            step += 1000
            results[name].append(elapsed / (ddp_iters if name.startswith("DDP") else iters))
    steptrace.shutdown()
    dist.destroy_process_group()

    def paired(wrapped: str, plain: str) -> float:
        return statistics.median(w - p for w, p in zip(results[wrapped], results[plain]))

    print(f"bench_collectives: {rounds} rounds x {iters} calls, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}")
    print(f"{'variant':<28}{'median ns/call':>16}{'p90 ns/call':>14}   (DDP rows: ns per step)")
    for name, values in results.items():
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        print(f"{name:<28}{statistics.median(values):>16.0f}{p90:>14.0f}")
    costs = {"wrapper, in a step (no-op)": paired("no-op, wrapped", "no-op"),
             "wrapper, between steps (no-op)": paired("no-op, wrapped, no step", "no-op"),
             "wrapper, in a step (all_reduce)": paired("all_reduce, wrapped", "all_reduce"),
             "device-timed wrapper (no-op, no events)": paired("no-op, device-timed", "no-op, 1000 a step"),
             "DDP tracking, per backward (8 buckets)": paired("DDP step, tracked", "DDP step")}
    print("\nwrapper cost per collective (paired within rounds, median), target <= 2000 ns:")
    for name, ns in costs.items():
        print(f"  {name:<36}{ns:>8.0f} ns")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "iters": iters, "ns_per_call": results, "wrapper_cost_ns": costs}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
