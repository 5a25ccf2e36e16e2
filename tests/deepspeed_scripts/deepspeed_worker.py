"""A tiny model trained by DeepSpeed's real engine on CPU (its CPU accelerator, gloo), with steptrace's hooks.

Launched by tests/test_deepspeed.py with ``python -m torch.distributed.run``. Two modes:

- ``engine`` (1 process): ``deepspeed.initialize`` a linear model (ZeRO stage --zero), gradient
  accumulation 2, --steps optimizer updates through ``engine(x)``/``engine.backward``/``engine.step``,
  ``save_checkpoint``, then a new engine ``load_checkpoint``s it and trains one more update. Forward
  sleeps FORWARD_S (a stand-in for device work). Writes ``<out>/engine.json``: the global steps and
  whether the restored weights equal the saved ones.
- ``pipe`` (2 processes): a 2-stage ``PipelineModule`` (one sleeping layer a stage) trained with
  ``train_batch`` for --steps steps of --microbatches micro-batches, then one ``eval_batch``.
  Writes ``<out>/pipe-rank<R>.json``: the losses.
"""

import argparse
import contextlib
import json
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["engine", "pipe"], required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--zero", type=int, default=0)
p.add_argument("--forward-s", type=float, default=0.02)
p.add_argument("--hooks", type=int, default=1)
p.add_argument("--steps-per-print", type=int, default=10 ** 9, help="DeepSpeed's own throughput log every N steps")
p.add_argument("--data-s", type=float, default=0.0, help="the loop's wait for each micro-batch, in a data span")
p.add_argument("--run-dir", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
FORWARD_S = args.forward_s

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.hooks:
    import steptrace
    import steptrace.adapters.deepspeed

    hooked = steptrace.adapters.deepspeed.install(run_dir=args.run_dir, run_id=args.mode, rank=rank,
                                                  world_size=world, backend="host")
os.makedirs(args.out, exist_ok=True)


class Sleepy(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(FORWARD_S)
        return torch.tanh(self.linear(x))


def config(gas):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": args.zero},
            "zero_allow_untested_optimizer": True, "steps_per_print": args.steps_per_print}


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(n)]


if args.mode == "engine":
    def build():
        model = Sleepy(0)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(2))
        return engine

    def update(engine, data):
        for x, y in data:
            if args.data_s:
                with steptrace.span("data") if args.hooks else contextlib.nullcontext():
                    time.sleep(args.data_s)
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()

    engine = build()
    data = batches(2 * args.steps)
    for n in range(args.steps):
        update(engine, data[2 * n:2 * n + 2])
    timer = engine.tput_timer  # DeepSpeed's own throughput figure, read before the save and resume
    throughput = {"avg_samples_per_sec": timer.avg_samples_per_sec(), "start_step": timer.start_step,
                  "global_step_count": timer.global_step_count, "total_elapsed_time": timer.total_elapsed_time,
                  "batch_size": timer.batch_size}
    engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag="t")
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    steps_before = engine.global_steps
    engine = build()
    engine.load_checkpoint(os.path.join(args.out, "ckpt"), tag="t")
    equal = all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
    steps_loaded = engine.global_steps
    update(engine, batches(2, seed=1))
    result = {"steps_before": steps_before, "steps_loaded": steps_loaded, "restored_equal": equal,
              "steps_after": engine.global_steps, "throughput_timer": throughput}
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump(result, f)
else:
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=[Sleepy(1), Sleepy(2)], num_stages=2,
                            loss_fn=lambda out, y: (out - y).pow(2).mean(), partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=config(args.microbatches))
    data = iter(batches(args.steps * args.microbatches))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(args.steps)]
    engine.eval_batch(iter(batches(args.microbatches, seed=7)))  # an `eval` span, no step
    with open(os.path.join(args.out, f"pipe-rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "stage": engine.stage_id}, f)

if args.hooks:
    steptrace.shutdown()
dist.barrier()
dist.destroy_process_group()
