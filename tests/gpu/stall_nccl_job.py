"""Two ranks on NCCL; rank 1 stops before step STALL_STEP's all-reduce (tests/gpu/test_stall_nccl_gpu.py).

Rank 0 enqueues the all-reduce and blocks at the loss read that follows; its stall record must carry
the NCCL flight recorder's entries for the collective that rank 1 never joined."""

import os
import sys
import threading

import torch
import torch.distributed as dist

import steptrace

STALL_STEP = 5


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    steptrace.init(run_dir=sys.argv[1], run_id="nccl-hang")
    x = torch.ones(1 << 20, device="cuda")
    for n in range(STALL_STEP + 5):
        with steptrace.step(n):
            if rank == 1 and n == STALL_STEP:
                threading.Event().wait()  # never joins the collective
            dist.all_reduce(x)
            x.sum().item()  # the host waits for the collective here
    steptrace.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    raise SystemExit(main())
