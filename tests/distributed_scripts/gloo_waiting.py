"""Two (or more) gloo ranks under torchrun, DDP on a small model, one rank slowed: who waits for whom.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_scripts/gloo_waiting.py \
        RUN_DIR [--steps 30] [--delay-s 0.025] [--slow-rank 1] [--work-s 0.02]

Every rank does ``--work-s`` of work of its own per step (a sleep, so ranks on two cores do not fight
over them); the slow rank does ``--delay-s`` more, inside the step (compute, on CPU). DDP's gradient
all-reduce and a loss all-reduce after the backward make every rank's step as long as the slow one's:
the others wait in them, and steptrace measures that wait (``collective_wait_seconds``). One run,
``waiting``, under RUN_DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--delay-s", type=float, default=0.025)
    parser.add_argument("--work-s", type=float, default=0.02)
    parser.add_argument("--slow-rank", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import steptrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    # rank and world size come from torchrun's environment
    steptrace.init(run_dir=args.run_dir, run_id="waiting", jsonl=True)
    dist.barrier()
    for n in range(args.steps):
        with steptrace.step(n):
            time.sleep(args.work_s + (args.delay_s if rank == args.slow_rank else 0.0))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
    steptrace.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
