"""A small gloo job to run under torchrun: every rank all-reduces a tensor in each of a few steps.

    torchrun --nproc-per-node 2 [--standalone | --master-port P] [--max-restarts 1] \
        tests/distributed_scripts/torchrun_steps.py RUN_DIR [--steps 6] [--fail-rank R --fail-step N]

No run id is given: steptrace takes it from the launch. With ``--fail-rank``, that rank raises at
``--fail-step`` in the agent's first start (``TORCHELASTIC_RESTART_COUNT`` 0), so that torchrun
restarts every worker once (with ``--max-restarts`` >= 1).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=3)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import steptrace

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # The restarted workers' gloo mesh now and then found a stale peer address in the store (connection
    # refused): each start gets its own key prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"start_{restart}", store), rank=rank,
                            world_size=world_size)
    first_start = restart == "0"
    steptrace.init(run_dir=args.run_dir)
    tensor = torch.ones(8)
    for n in range(args.steps):
        with steptrace.step(n):
            if first_start and rank == args.fail_rank and n == args.fail_step:
                raise RuntimeError(f"rank {rank} fails at step {n} (first start only)")
            dist.all_reduce(tensor)
    steptrace.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
