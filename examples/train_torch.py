"""A small GPT-style PyTorch training loop instrumented with steptrace, written as people write them.

What it runs: a 2-layer decoder-only transformer (~0.2M parameters) learning next-token prediction
on a synthetic token stream, AdamW, with the habits of real loops (nanoGPT's among them):

* the next batch is fetched *right after the forward pass is dispatched* (on a GPU the fetch runs
  while the device computes the forward), inside ``steptrace.span("data")``;
* gradient accumulation over ``--grad-accum`` micro-steps;
* an evaluation at iteration 0 (before the first step) and every ``--eval-every`` steps;
* a checkpoint (``torch.save``) every ``--checkpoint-every`` steps, on rank 0;
* ``torchrun --nproc-per-node N`` runs it as DDP (gloo on CPU, NCCL on GPUs).

The loop is instrumented without re-indenting it: ``steptrace.begin_step(n)`` at the top of an
iteration, ``steptrace.end_step(wait_for=loss)`` at the bottom. steptrace reads the rank and world
size from torchrun's environment. At the end rank 0 prints the report of the run.

    python examples/train_torch.py [--steps 40] [--run-dir steptrace-runs] [--run-id torch-demo]
    torchrun --nproc-per-node 2 examples/train_torch.py --run-id torch-ddp
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import steptrace
import steptrace.report

VOCAB = 64
BLOCK = 32  # context length
LAYERS = 2
HEADS = 4
WIDTH = 64
BATCH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tokens(idx) + self.positions(positions))
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def token_stream(seed: int, length: int = 50_000) -> torch.Tensor:
    """A learnable synthetic corpus: a noisy repeating pattern of tokens."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, VOCAB, (97,), generator=generator)
    stream = pattern.repeat(length // 97 + 1)[:length]
    noise = torch.rand(length, generator=generator) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, (length,), generator=generator), stream)


def get_batch(data: torch.Tensor, device: torch.device, generator: torch.Generator,
              loader_delay_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the stream; ``loader_delay_s`` stands in for a slow reader or tokenizer."""
    if loader_delay_s:
        time.sleep(loader_delay_s)
    starts = torch.randint(0, len(data) - BLOCK - 1, (BATCH,), generator=generator)
    x = torch.stack([data[s:s + BLOCK] for s in starts])
    y = torch.stack([data[s + 1:s + BLOCK + 1] for s in starts])
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, device: torch.device, batches: int) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    losses = [model(*get_batch(data, device, generator, 0.0))[1].item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--loader-delay-ms", type=float, default=2.0, help="extra time per batch fetch")
    parser.add_argument("--run-dir", default="steptrace-runs")
    parser.add_argument("--run-id", default="torch-demo")
    parser.add_argument("--no-report", action="store_true", help="do not print the report at the end")
    args = parser.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1)  # several ranks share this machine's cores
    torch.manual_seed(0)

    # Rank and world size come from torchrun's RANK/WORLD_SIZE.
    steptrace.init(run_dir=args.run_dir, run_id=args.run_id)

    data = token_stream(seed=0)
    model = TinyGPT().to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(100 + rank)
    tokens_per_step = BATCH * BLOCK * args.grad_accum
    delay = args.loader_delay_ms / 1000.0
    checkpoint_dir = Path(args.run_dir) / args.run_id / "checkpoints"

    x, y = get_batch(data, device, generator, delay)
    loss = torch.zeros(())
    for n in range(args.steps):
        if n % args.eval_every == 0:
            with steptrace.span("eval"):
                val = evaluate(model, data, device, args.eval_batches)
            if rank == 0:
                print(f"step {n}: eval loss {val:.3f}")
        if n and n % args.checkpoint_every == 0 and rank == 0:
            with steptrace.checkpoint(n - 1):
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": n - 1},
                           checkpoint_dir / "latest.pt")

        steptrace.begin_step(n, tokens=tokens_per_step)
        for micro in range(args.grad_accum):
            if distributed:
                model.require_backward_grad_sync = micro == args.grad_accum - 1
            _, loss = model(x, y)
            loss = loss / args.grad_accum
            # Fetch the next batch while the device works on the forward pass.
            with steptrace.span("data"):
                x, y = get_batch(data, device, generator, delay)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steptrace.end_step(wait_for=loss)

    final = evaluate(model, data, device, args.eval_batches)
    steptrace.shutdown()
    if distributed:
        dist.barrier()  # every rank's file is complete before rank 0 reads the run
    if rank == 0:
        print(f"final eval loss {final:.3f} (a uniform guess is {math.log(VOCAB):.3f})")
        if not args.no_report:
            steptrace.report.main([str(Path(args.run_dir) / args.run_id), "--max-rows", "12"])
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
