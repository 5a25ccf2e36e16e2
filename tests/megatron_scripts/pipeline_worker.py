"""One rank of a tiny model run through Megatron's real pipeline schedules on CPU (gloo).

Launched by tests/test_megatron.py with ``python -m torch.distributed.run``. Megatron's
schedules assume CUDA in three places; the shims below (test-side only, steptrace itself
has none) make them run on CPU. Work per microbatch is a fixed sleep (forward
FORWARD_S, backward twice that) on top of a small matmul, so the pipeline's timing is
deterministic on a 2-core machine and bubbles can be predicted.

Writes ``<out>/grads-rank<R>.pt`` (per step: loss on the last stage, every chunk's
parameter gradients) so a run with hooks can be compared with one without.
"""

import argparse
import os
import time

import torch

# -- CPU shims for megatron-core's pipeline schedules -------------------------------------
_zeros = torch.zeros


def _cpu_zeros(*args, **kwargs):
    device = kwargs.get("device")
    if device is not None and str(device).startswith("cuda"):
        kwargs["device"] = "cpu"
    return _zeros(*args, **kwargs)


torch.zeros = _cpu_zeros
torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None

p = argparse.ArgumentParser()
p.add_argument("--pp", type=int, required=True)
p.add_argument("--vp", type=int, default=None)
p.add_argument("--microbatches", type=int, required=True)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--forward-s", type=float, default=0.02)
p.add_argument("--hooks", type=int, default=1)
p.add_argument("--slow-rank", type=int, default=None, help="this rank's forward takes --slow-s longer")
p.add_argument("--slow-s", type=float, default=0.0)
p.add_argument("--run-dir", required=True)
p.add_argument("--run-id", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

if args.hooks:
    import steptrace
    import steptrace.adapters.megatron

    steptrace.init(run_dir=args.run_dir, run_id=args.run_id, rank=rank, world_size=world, backend="host")
    hooked = steptrace.adapters.megatron.install()
    assert any(h.endswith("schedules.forward_step") for h in hooked), hooked

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

parallel_state.initialize_model_parallel(pipeline_model_parallel_size=args.pp,
                                         virtual_pipeline_model_parallel_size=args.vp)
pp_rank = parallel_state.get_pipeline_model_parallel_rank()
chunks = args.vp or 1
SEQ, MBS, HIDDEN = 4, 2, 16
FORWARD_S = args.forward_s


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 2 × FORWARD_S: a stand-in for device work."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * FORWARD_S)
        return grad


class Chunk(torch.nn.Module):
    def __init__(self, config, layer, first, last):
        super().__init__()
        torch.manual_seed(1234 + layer)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.first, self.last = first, last
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x):
        if not self.first:
            x = self.input_tensor
        time.sleep(FORWARD_S + (args.slow_s if rank == args.slow_rank else 0.0))
        return _SlowBackward.apply(torch.tanh(self.linear(x)))


# batch_p2p_comm=False: batched isend/irecv over gloo computes wrong results when interleaving.
config = TransformerConfig(num_layers=args.pp * chunks, hidden_size=HIDDEN, num_attention_heads=1,
                           pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vp,
                           pipeline_dtype=torch.float32, batch_p2p_comm=False)
model = []
for c in range(chunks):
    layer = c * args.pp + pp_rank  # Megatron's interleaved layout: chunk c of rank r is block c*P + r
    model.append(Chunk(config, layer, first=(layer == 0), last=(layer == chunks * args.pp - 1)))


def batches(step):
    g = torch.Generator().manual_seed(step)
    return iter([torch.randn(SEQ, MBS, HIDDEN, generator=g) for _ in range(args.microbatches)])


def forward_step_func(data_iterator, chunk):
    x = next(data_iterator) if chunk.first else None
    out = chunk(x)

    def loss_func(output):
        loss = output.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


results = []
for step in range(args.steps):
    for m in model:
        m.zero_grad(set_to_none=True)
    data = [batches(step) for _ in range(chunks)]
    dist.barrier()  # Megatron's optimizer step syncs the model-parallel group between iterations
    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=forward_step_func,
                              data_iterator=data if args.vp else data[0],
                              model=model if args.vp else model[0],
                              num_microbatches=args.microbatches, seq_length=SEQ, micro_batch_size=MBS,
                              forward_only=False)
    results.append({"losses": [d["loss"].clone() for d in losses],
                    "grads": [{n: p.grad.clone() for n, p in m.named_parameters()} for m in model]})

os.makedirs(args.out, exist_ok=True)
torch.save(results, os.path.join(args.out, f"grads-rank{rank}.pt"))
if args.hooks:
    steptrace.shutdown()
dist.barrier()
dist.destroy_process_group()
