"""A 4-rank DDP job on gloo in which rank 2 blocks forever inside its data fetch at step STALL_STEP
(tests/test_hangs.py). The other ranks enter the step's all-reduce and wait for it; nothing times
out within the test, which kills the job once every rank has written its stall record."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import steptrace

STALL_STEP = int(os.environ.get("STALL_STEP", "20"))
STALL_RANK = int(os.environ.get("STALL_RANK", "2"))


def get_batch(rank: int, n: int) -> torch.Tensor:
    if rank == STALL_RANK and n == STALL_STEP:
        threading.Event().wait()  # a reader that never returns
    time.sleep(0.002)
    return torch.randn(32, 64)


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steptrace.init(run_dir=sys.argv[1], run_id="hang")
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for n in range(STALL_STEP + 10):
        with steptrace.step(n):
            with steptrace.span("data"):
                x = get_batch(rank, n)
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    steptrace.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
