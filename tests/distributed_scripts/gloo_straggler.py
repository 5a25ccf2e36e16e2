"""Four real ranks on gloo (torch.multiprocessing), DDP on a small model, steptrace on every rank.

    python tests/distributed_scripts/gloo_straggler.py RUN_DIR [--world-size 4] [--steps 40]
        [--scenarios forward,backward,data,none] [--delay-s 0.03] [--slow-rank 2]

One run per scenario (run id = the scenario's name), each rank writing its JSONL under RUN_DIR:

* ``forward``: the slow rank sleeps ``--delay-s`` before its forward pass every step;
* ``backward``: the slow rank sleeps ``--delay-s`` inside its backward pass, between two layers;
* ``data``: the slow rank's data loading (a ``steptrace.span("data")`` inside the step: idle time,
  not compute) takes ``--delay-s`` longer;
* ``none``: no rank is slowed.

Every rank also does ``--work-s`` of its own work per step (a sleep, so four ranks on two cores do
not fight over them) and all-reduces its loss from Python after the backward (as training loops do
for logging): DDP's gradient all-reduce and the loss all-reduce are both measured by steptrace
(source ``ddp+torch.distributed``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleep(seconds: float) -> float:
    """Sleeps and returns how long it really slept: on a loaded machine a 30 ms sleep wakes up late, and
    the lateness is cost the slowed rank really imposed (the straggler's true delay, step by step)."""
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import steptrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    slow = rank == args.slow_rank

    class SlowInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            if ctx_slow[0]:
                time.sleep(args.delay_s)
            return grad

    ctx_slow = [False]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
            self.second = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def forward(self, x):  # type: ignore[override]
            return self.second(SlowInBackward.apply(self.first(x)))

    for scenario in args.scenarios.split(","):
        torch.manual_seed(0)
        model = Model()
        # Small buckets: the gradients go out in several all-reduces, as in a real model.
        # No steptrace call for DDP: its gradient all-reduce is tracked at the model's first forward
        # (steptrace installs that at the first step, seeing a gloo process group).
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randn(32, 64)
        steptrace.init(run_dir=args.run_dir, run_id=scenario, rank=rank, world_size=args.world_size,
                       jsonl=True)
        ctx_slow[0] = slow and scenario == "backward"
        dist.barrier()
        for n in range(args.steps):
            with steptrace.step(n) as s:
                with steptrace.span("data"):
                    if slow and scenario == "data":
                        s.log(delay_slept_seconds=_sleep(args.delay_s))
                if slow and scenario == "forward":
                    s.log(delay_slept_seconds=_sleep(args.delay_s))
                time.sleep(args.work_s)
                loss = ddp(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                logged = loss.detach().clone()
                dist.all_reduce(logged)
        steptrace.shutdown()
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--scenarios", default="forward,backward,data,none")
    parser.add_argument("--delay-s", type=float, default=0.03)
    parser.add_argument("--work-s", type=float, default=0.02)
    parser.add_argument("--slow-rank", type=int, default=2)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(args, _free_port()), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
