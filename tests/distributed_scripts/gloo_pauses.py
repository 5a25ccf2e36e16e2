"""Real ranks on gloo (torch.multiprocessing) with host pauses measured (``init(pauses=True)``, issue 50).

    python tests/distributed_scripts/gloo_pauses.py RUN_DIR [--world-size 2] [--steps 24]
        [--scenarios gc,preempted,none] [--slow-rank 1] [--gc-steps 8,13,18] [--cycles 150000]

One run per scenario (run id = the scenario's name), each rank writing its JSONL under RUN_DIR:

* ``gc``: the slow rank holds a large cyclic heap (built before the first step, one per chosen step) and,
  at each of ``--gc-steps``, drops one and runs ``gc.collect()``: a full collection of a heap of cycles;
* ``preempted``: every rank spins ``--work-s`` of CPU a step; the slow rank's process is pinned to one
  CPU together with a process that never sleeps (``os.sched_setaffinity``, what ``taskset`` does), at
  ``--slow-nice`` (default 5: the fair scheduler gives it a third of the spinner's share, so it waits on
  the run queue however busy the machine is with other work; a nice value cannot be lowered back, so run
  this scenario last);
* ``none``: no rank is slowed;
* ``gc-staggered``: every rank leaves ``--garbage`` reference cycles of garbage a step with automatic
  collection off, and collects them every ``--period`` steps, each rank at another step of the period (as
  uncoordinated automatic collections fall): one rank pauses while the others wait for it;
* ``gc-every``: the same garbage, collected by ``steptrace.gc_every(--period)`` before the same step on
  every rank (coordinated collection).

Every rank all-reduces a tensor at the end of each step (measured by steptrace as its wait in
collectives, source ``torch.distributed``) and records, with a plain ``gc.callbacks`` entry of its own
(the documented protocol only), the seconds its training thread spent in collections during each step:
``RUN_DIR/<scenario>/gc-reference-<rank>.json``, step -> seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reference:
    """The training thread's collection time by step, from gc.callbacks as Python documents it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.step: int | None = None
        self.by_step: dict[int, float] = {}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self.thread or self.step is None:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.by_step[self.step] = self.by_step.get(self.step, 0.0) + time.perf_counter() - self._start


def _cycles(n: int) -> list:
    heap = []
    for _ in range(n):
        a: list = []
        b = [a]
        a.append(b)
        heap.append(a)
    return heap


def _spin(seconds: float) -> None:
    # CPU time, not wall time: a preempted thread takes longer to burn it.
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    import steptrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    slow = rank == args.slow_rank
    gc_steps = [int(s) for s in args.gc_steps.split(",") if s]
    cpus = sorted(os.sched_getaffinity(0))
    for scenario in args.scenarios.split(","):
        heaps = {step: _cycles(args.cycles) for step in gc_steps} if slow and scenario == "gc" else {}
        busy = None
        if scenario.startswith("gc-") and len(cpus) >= args.world_size:
            os.sched_setaffinity(0, {cpus[rank]})  # a core per rank, as on a real node: collections do not contend
        if scenario == "preempted":
            # Each rank on its own CPU where there are two; the slow one shares its CPU with a spinner.
            cpu = cpus[rank % len(cpus)]
            os.sched_setaffinity(0, {cpu})
            if slow:
                # The spinner first: a child inherits its parent's nice value, and a spinner at the rank's own
                # nice would take only half the CPU from it.
                busy = subprocess.Popen([sys.executable, "-c",
                                         f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
                os.nice(args.slow_nice)
                time.sleep(0.3)
        sched = None
        if scenario == "gc-every":
            sched = steptrace.gc_every(args.period)
        elif scenario == "gc-staggered":
            gc.disable()
        offset = rank * args.period // args.world_size
        garbage: list = []
        reference = Reference()
        gc.callbacks.append(reference)
        out = Path(args.run_dir) / scenario
        steptrace.init(run_dir=args.run_dir, run_id=scenario, rank=rank, world_size=args.world_size,
                       jsonl=True, pauses=True)
        tensor = torch.ones(4)
        dist.barrier()
        for n in range(args.steps):
            reference.step = n
            if sched is not None:
                sched(n)
            elif scenario == "gc-staggered" and n % args.period == offset:
                gc.collect()
            with steptrace.step(n):
                if scenario.startswith("gc-"):
                    garbage = _cycles(args.garbage)
                    del garbage
                if scenario == "preempted":
                    _spin(args.work_s)
                else:
                    time.sleep(args.work_s)
                heap = heaps.pop(n, None)
                if heap is not None:
                    del heap
                    gc.collect()
                dist.all_reduce(tensor)
            reference.step = None
        steptrace.shutdown()
        gc.callbacks.remove(reference)
        if sched is not None:
            sched.close()
        gc.enable()
        if busy is not None:
            busy.kill()
            busy.wait()
        os.sched_setaffinity(0, cpus)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gc-reference-{rank}.json").write_text(json.dumps(reference.by_step))
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--scenarios", default="gc,preempted,none")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--gc-steps", default="8,13,18")
    parser.add_argument("--cycles", type=int, default=150_000)
    parser.add_argument("--work-s", type=float, default=0.02)
    parser.add_argument("--period", type=int, default=6)
    parser.add_argument("--slow-nice", type=int, default=5)
    parser.add_argument("--garbage", type=int, default=20_000)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(args, _free_port()), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
