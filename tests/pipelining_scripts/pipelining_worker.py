"""One rank of a tiny model run through torch.distributed.pipelining's real schedules on CPU (gloo).

Launched by tests/test_torch_pipelining.py with ``python -m torch.distributed.run``. No shim: the
schedules run on CPU tensors and gloo as shipped. Work per microbatch is a fixed sleep on top of a
small matmul (forward FORWARD_S; backward FORWARD_S for the input gradient and FORWARD_S for the
weight gradient, so a zero-bubble schedule's split backward has two halves of known length), so the
pipeline's timing is deterministic on a 2-core machine.

For each schedule named in --schedules: one step without steptrace's hooks (the reference
gradients), then --steps steps with them (GPipe and 1F1B then one ``schedule.eval``), each in its
own steptrace run (run id = the schedule's name). Writes ``<out>/rank<R>.pt``: per schedule, the
reference and the hooked step 0's gradients, and the compute actions the schedule planned for this
rank (``pipeline_order_with_comms``, the list ``_PipelineScheduleRuntime._step_microbatches``
executes), for the multi-stage schedules.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import pipelining as pp

p = argparse.ArgumentParser()
p.add_argument("--schedules", required=True, help="comma-separated: gpipe,1f1b,interleaved1f1b,zb,zbv")
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--forward-s", type=float, default=0.01)
p.add_argument("--slow-rank", type=int, default=None, help="this rank's forward takes --slow-s longer")
p.add_argument("--slow-s", type=float, default=0.0)
p.add_argument("--run-dir", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
HIDDEN, BATCH = 8, 8
FORWARD_S = args.forward_s
SLOW_S = args.slow_s if rank == args.slow_rank else 0.0


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps FORWARD_S: a stand-in for device work on the path it sits on."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()  # not a view: the zero-bubble schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, grad):
        time.sleep(FORWARD_S)
        return grad


class Block(torch.nn.Module):
    def __init__(self, stage_index):
        super().__init__()
        torch.manual_seed(1234 + stage_index)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        time.sleep(FORWARD_S + SLOW_S)
        # The weight's path and the activation's path each sleep once in backward: a split backward's
        # input half (I) and weight half (W) then take FORWARD_S each, a full backward 2 x FORWARD_S.
        weight = _SleepInBackward.apply(self.linear.weight)
        return _SleepInBackward.apply(torch.tanh(torch.nn.functional.linear(x, weight, self.linear.bias)))


def loss_fn(output, target):
    return (output - target).pow(2).mean()


def stage_indices(name):
    if name in ("gpipe", "1f1b"):
        return [rank]
    if name == "zbv":  # V-shaped placement: rank r holds stages r and 2P - 1 - r
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]  # looped placement


def build(name):
    indices = stage_indices(name)
    num_stages = world * len(indices)
    stages = [pp.PipelineStage(Block(i), i, num_stages, torch.device("cpu")) for i in indices]
    M = args.microbatches
    if name == "gpipe":
        schedule = pp.ScheduleGPipe(stages[0], M, loss_fn=loss_fn)
    elif name == "1f1b":
        schedule = pp.Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    elif name == "interleaved1f1b":
        schedule = pp.ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    elif name == "zb":
        schedule = pp.ScheduleInterleavedZeroBubble(stages, M, loss_fn=loss_fn)
    elif name == "zbv":
        schedule = pp.ScheduleZBVZeroBubble(stages, M, loss_fn=loss_fn)
    else:
        raise SystemExit(f"unknown schedule {name}")
    return stages, schedule, num_stages


def run_step(stages, schedule, num_stages, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, HIDDEN, generator=g)
    target = torch.randn(BATCH, HIDDEN, generator=g)
    for s in stages:
        s.submod.zero_grad(set_to_none=True)
    held = {s.stage_index for s in stages}
    call_args = (x,) if 0 in held else ()
    kwargs = {"target": target} if num_stages - 1 in held else {}
    schedule.step(*call_args, **kwargs)
    return {s.stage_index: {n: p.grad.clone() for n, p in s.submod.named_parameters()} for s in stages}


def planned_order(schedule):
    """This rank's compute actions as the runtime schedule will execute them: (kind letter, mb, stage)."""
    plan = getattr(schedule, "pipeline_order_with_comms", None)
    if plan is None:
        return None
    out = []
    for action in plan[rank]:
        subs = action.sub_actions or () if action.computation_type.value == "OVERLAP_F_B" else (action,)
        for a in subs:
            if a.computation_type.value in ("F", "B", "I", "W"):
                out.append((a.computation_type.value, a.microbatch_index, a.stage_index))
    return out


names = args.schedules.split(",")
results = {}
for name in names:  # the reference: no hooks installed
    stages, schedule, num_stages = build(name)
    dist.barrier()
    results[name] = {"plain": run_step(stages, schedule, num_stages, 0), "order": planned_order(schedule)}

import steptrace  # noqa: E402
import steptrace.adapters.torch_pipelining  # noqa: E402

for name in names:
    steptrace.init(run_dir=args.run_dir, run_id=name, rank=rank, world_size=world, backend="host")
    hooked = steptrace.adapters.torch_pipelining.install()
    assert len(hooked) == 5, hooked
    stages, schedule, num_stages = build(name)
    for step in range(args.steps):
        dist.barrier()  # the optimizer step between iterations syncs the pipeline group
        grads = run_step(stages, schedule, num_stages, step)
        if step == 0:
            results[name]["hooked"] = grads
    if name in ("gpipe", "1f1b"):  # schedule.eval(): forward only, an `eval` span and no step
        dist.barrier()
        g = torch.Generator().manual_seed(99)
        x, target = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)
        with torch.no_grad():
            schedule.eval(*((x,) if rank == 0 else ()), **({"target": target} if rank == world - 1 else {}))
    steptrace.shutdown()
    steptrace.adapters.torch_pipelining.uninstall()

os.makedirs(args.out, exist_ok=True)
torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
