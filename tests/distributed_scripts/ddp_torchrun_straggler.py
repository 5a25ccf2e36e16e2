"""One rank of a DDP job on gloo under torchrun, steptrace on every rank: the straggler checks of issue 33.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/distributed_scripts/ddp_torchrun_straggler.py RUN_DIR --run-id ID [--steps 60]
        [--slow-rank 2 --extra-compute-s 0.025]

Each step is real CPU work on every rank: a small MLP's forward and backward (``torch.set_num_threads(1)``)
and DDP's gradient all-reduce, then a loss all-reduce from Python as training loops do for logging. With
``--slow-rank R`` rank R also computes ``--extra-compute-s`` more per step before its forward (small
matrix products until its thread has used that much CPU time: compute, not a sleep, so a loaded machine
stretches it as it stretches the rest of the rank's work), and writes how long that extra work took in
wall time, per step, to ``RUN_DIR/ID/extra-rank-R.json``: the slowdown the job must be charged with.
Rank, world size and the rendezvous come from torchrun's environment; the run id is given (how a run
id is derived under torchrun is another part of issue 33: this script does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--extra-compute-s", type=float, default=0.025)
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP (its compute per step)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import steptrace

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(256, width, generator=generator) for _ in range(4)]
    spin_a = torch.randn(32, 32)
    slow = rank == args.slow_rank
    extra: list[float] = []

    steptrace.init(run_dir=args.run_dir, run_id=args.run_id, rank=rank, world_size=world_size, jsonl=True)
    dist.barrier()
    for n in range(args.steps):
        with steptrace.step(n):
            x = batches[n % len(batches)]
            if slow:
                # Compute, not a sleep: this thread's CPU time, so on a loaded machine the extra work
                # is stretched like the rest of the rank's work; its wall time is what the job loses.
                started, cpu_started = time.perf_counter(), time.thread_time()
                while time.thread_time() - cpu_started < args.extra_compute_s:
                    spin_a = torch.tanh(spin_a @ spin_a)
                extra.append(time.perf_counter() - started)
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
    steptrace.shutdown()
    if slow:
        out = Path(args.run_dir) / args.run_id / f"extra-rank-{rank}.json"
        out.write_text(json.dumps({"rank": rank, "extra_compute_seconds": extra}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
