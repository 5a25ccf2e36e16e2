"""A small, real JAX training loop instrumented with steptrace, next to naive host timing.

What it runs: an MLP (512 -> 1024 -> 1024 -> 10, ~1.6M parameters) trained with
optax Adam on synthetic classification data (a fixed random "teacher" labels
Gaussian inputs), batch 128, with a jitted ``train_step`` that JAX dispatches
asynchronously. Every 7th batch is slow (the "loader" sleeps 50 ms) and a real
orbax checkpoint is written every ``--checkpoint-every`` steps (asynchronously,
orbax's default: the write finishes in the background).

Each step is timed twice:

* **naive**, the way MaxText logs ``completed step: n, seconds: ...``: a host
  ``time.perf_counter()`` read right after ``train_step`` returns, with no
  device sync. Step n's naive time is the host time since the same read in
  iteration n-1. That measures *dispatch*, not execution, and charges a
  checkpoint save to the step logged after it. Like MaxText, the loop then
  logs the *previous* step's loss, which waits for step n-1 and so keeps the
  host at most one step ahead of the device (``--run-ahead`` turns that off:
  then nothing syncs and the host queues steps as fast as it can).
* **steptrace**: ``steptrace.step`` / ``span`` around the same code, and the
  orbax ``CheckpointManager`` instrumented in one line
  (``steptrace.adapters.orbax.instrument``: each save's blocking part and its
  background commit); ``s.wait_for(loss)`` lets a background thread see when
  the device actually finished the step. ``init(flops="auto")`` takes each step's hardware
  FLOPs from XLA's cost analysis of the compiled ``train_step``; the analytic
  ``6 × parameters × batch`` is passed as the model FLOPs. With
  ``--peak-tflops`` (a CPU has no entry in steptrace's peak table) the report
  also shows MFU and HFU with their parts.

After the run it prints both side by side, explains the differences it saw,
and prints the steptrace report of the run (``steptrace report RUN_DIR``).

    python examples/train_jax.py [--steps 30] [--run-dir steptrace-runs] [--run-id demo]
                                 [--checkpoint-every 10] [--run-ahead] [--plot timeline.png]
                                 [--peak-tflops 1.0]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import steptrace
import steptrace.adapters.orbax
import steptrace.report

# Model and data sizes: a step takes ~20 ms on an idle 2-core CPU, less than the slow loader's stall.
IN_DIM = 512
WIDTH = 1024
DEPTH = 2  # hidden layers
CLASSES = 10
BATCH = 128
SLOW_EVERY = 7  # every 7th batch comes from a slow loader...
SLOW_SECONDS = 0.050  # ...that makes the host wait this long
LEARNING_RATE = 1e-3


# --------------------------------------------------------------------------
# Model, optimizer, data
# --------------------------------------------------------------------------


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    sizes = [IN_DIM] + [WIDTH] * DEPTH + [CLASSES]
    params = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({
            "w": jax.random.normal(sub, (fan_in, fan_out), jnp.float32) * fan_in ** -0.5,
            "b": jnp.zeros((fan_out,), jnp.float32),
        })
    return params


def count_params(params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))


def forward(params, x):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return h @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    logits = forward(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


optimizer = optax.adam(LEARNING_RATE)


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss


class SyntheticLoader:
    """Host-side batches (numpy, like a real input pipeline); every ``SLOW_EVERY``-th one is slow."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.teacher = self.rng.standard_normal((IN_DIM, CLASSES), dtype=np.float32)
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n % SLOW_EVERY == SLOW_EVERY - 1:
            time.sleep(SLOW_SECONDS)  # a loader stall: remote storage, decoding, a straggling worker
        self.n += 1
        x = self.rng.standard_normal((BATCH, IN_DIM), dtype=np.float32)
        y = np.argmax(x @ self.teacher, axis=1).astype(np.int32)
        return x, y


# --------------------------------------------------------------------------
# Run directory
# --------------------------------------------------------------------------


def clean_run_dir(path: Path) -> None:
    """Remove a previous run of the same id, but only if it looks like one of ours."""
    if not path.exists():
        return
    if not path.is_dir():
        sys.exit(f"train_jax.py: {path} exists and is not a directory; pick another --run-id")
    foreign = [p.name for p in path.iterdir()
               if not (p.name == "ckpt" or (p.name.startswith("rank-") and p.name.endswith((".jsonl", ".attempts"))))]
    if foreign:
        sys.exit(f"train_jax.py: {path} holds files that are not a steptrace run ({', '.join(sorted(foreign)[:5])}); "
                 "refusing to delete it. Pick another --run-id or --run-dir")
    shutil.rmtree(path)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def train(args: argparse.Namespace) -> tuple[list[float], int, float]:
    """Run the instrumented loop; returns (naive seconds per step, params, model flops per step)."""
    run_path = Path(args.run_dir) / args.run_id
    # flops="auto": hardware FLOPs per step from the compiler (XLA cost analysis of train_step,
    # read once as it compiles inside step 0). A CPU has no peak in steptrace's table: MFU and HFU
    # need --peak-tflops.
    steptrace.init(run_dir=args.run_dir, run_id=args.run_id, flops="auto", peak_tflops=args.peak_tflops)

    state = {"params": init_params(jax.random.PRNGKey(0)), "step": jnp.zeros((), jnp.int32)}
    state["opt_state"] = optimizer.init(state["params"])
    n_params = count_params(state["params"])
    # Model FLOPs of one step, analytically: a dense layer costs 2 FLOPs (multiply + add) per weight
    # per example forward and 4 backward (gradients w.r.t. inputs and weights), so fwd+bwd is
    # ~6 * params * batch. Biases, activations, the loss and Adam's update are ignored (<1%); the
    # compiler's count (hardware FLOPs) includes them.
    flops_per_step = 6.0 * n_params * BATCH
    tokens_per_step = BATCH  # one "token" per example for an MLP

    # One line: every save is a checkpoint record (its blocking part, and its asynchronous commit,
    # never charged to a step), a wait for a commit a `checkpoint` span.
    manager = steptrace.adapters.orbax.instrument(ocp.CheckpointManager(
        (run_path / "ckpt").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    ))
    loader = SyntheticLoader()
    naive: list[float] = []
    losses: list[float] = []
    prev_loss = None
    last = time.perf_counter()
    try:
        for n in range(args.steps):
            with steptrace.step(n, tokens=tokens_per_step, samples=BATCH, flops=flops_per_step) as s:
                with steptrace.span("data"):
                    x, y = next(loader)
                state, loss = train_step(state, x, y)  # async: returns once the work is queued
                s.wait_for(loss)  # steptrace waits for it on a background thread
            # Naive timing, as MaxText does it: host clock right after the step is dispatched, no sync.
            now = time.perf_counter()
            naive.append(now - last)
            last = now
            if not args.run_ahead and prev_loss is not None:
                # Log the previous step's loss, as MaxText writes step n-1's metrics during step n.
                # It waits for step n-1 only, which keeps the host at most one step ahead.
                losses.append(float(prev_loss))
            prev_loss = loss
            if n > 0 and n % args.checkpoint_every == 0:
                # Blocks while the state is copied off the device; orbax writes it in the background.
                manager.save(n, args=ocp.args.StandardSave(state))
        final_loss = float(loss)  # after the loop: waits for the last step
    finally:
        manager.close()
        steptrace.shutdown()
    first = f"{losses[0]:.4f} -> " if losses else ""
    print(f"trained {args.steps} steps: {n_params:,} parameters, batch {BATCH}, "
          f"{flops_per_step / 1e9:.2f} model GFLOP/step, loss {first}{final_loss:.4f}")
    return naive, n_params, flops_per_step


# --------------------------------------------------------------------------
# Naive vs steptrace
# --------------------------------------------------------------------------


def _top_idle(record: dict) -> tuple[str, float]:
    breakdown = record.get("idle_breakdown") or {}
    if not breakdown:
        return "", 0.0
    reason = max(breakdown, key=lambda k: breakdown[k])
    return reason, breakdown[reason]


def _tflops(flops: float, seconds: float | None) -> str:
    if not seconds or seconds <= 0:
        return "—"
    return f"{flops / seconds / 1e12:.3f}"


def comparison_table(steps: list[dict], naive: list[float], flops: float):
    from rich.table import Table

    table = Table(title="naive host timing vs steptrace (seconds)", title_justify="left")
    for name in ("step", "naive s", "naive TFLOP/s", "steptrace interval s", "compute s",
                 "idle s (top reason)", "steptrace TFLOP/s"):
        table.add_column(name, justify="left" if name.startswith("idle") else "right")
    for record in steps:
        n = record["step"]
        naive_s = naive[n] if n < len(naive) else None
        reason, _ = _top_idle(record)
        idle = record.get("idle_seconds") or 0.0
        idle_cell = f"{idle:.4f} {reason}" if reason and idle > 0.0005 else f"{idle:.4f}"
        tf = record.get("tflops_per_second")
        table.add_row(
            str(n),
            "—" if naive_s is None else f"{naive_s:.4f}",
            _tflops(flops, naive_s),
            f"{record['interval_seconds']:.4f}",
            f"{record['compute_seconds']:.4f}",
            idle_cell,
            "—" if tf is None else f"{tf:.3f}",
        )
    return table


def explain(run, naive: list[float], flops: float) -> list[str]:
    """A few sentences about what the two columns disagree on, with this run's numbers."""
    steps = run.steps()
    by_step = {r["step"]: r for r in steps}
    data_seconds = {r.get("step"): r.get("seconds", 0.0) for r in run.records("span", 0) if r.get("name") == "data"}
    lines: list[str] = []
    computes = sorted(r["compute_seconds"] for r in steps if r["step"] > 0)
    typical = computes[len(computes) // 2] if computes else None

    if 0 in by_step and naive:
        r0 = by_step[0]
        compile_s = (r0.get("idle_breakdown") or {}).get("compile", 0.0)
        lines.append(
            f"Step 0: the naive clock reads {naive[0]:.3f} s and calls all of it step time "
            f"({_tflops(flops, naive[0])} TFLOP/s). Most of it is JIT compilation on the host, while the device "
            f"sat idle: steptrace charges {compile_s:.3f} s to idle 'compile' and measures "
            f"{r0['compute_seconds']:.4f} s of device compute"
            + (f" (a typical step: {typical:.4f} s; the first execution of a program is slower)." if typical else "."))

    if typical:
        fast = [n for n, t in enumerate(naive) if n > 0 and t < 0.5 * typical]
        if fast:
            peak = max(flops / naive[n] / 1e12 for n in fast)
            lines.append(
                f"Steps {_list(fast)}: the naive time is less than half of what the device needs for a step "
                f"(~{typical:.4f} s). The host only queued the work and moved on, so naive TFLOP/s (up to "
                f"{peak:.3f}) overstates what this machine does, and the time shows up in a neighbouring step "
                f"instead. steptrace's TFLOP/s comes from device compute (median "
                f"{flops / typical / 1e12:.3f}).")

    for ck in run.checkpoints():
        n = ck.get("after_step", ck["step"])  # the step the save followed (this loop names it so)
        after = by_step.get(n + 1) if n is not None else None
        if after is None or n + 1 >= len(naive):
            continue
        ck_idle = (after.get("idle_breakdown") or {}).get("checkpoint", 0.0)
        commit = ck.get("async_seconds")
        background = (f" orbax then wrote it in the background for {commit:.3f} s more, while the next steps "
                      "ran: no step is charged for that." if commit is not None else "")
        lines.append(
            f"Checkpoint after step {n}: the save held the loop for {ck['host_seconds']:.3f} s, of which "
            f"{ck['blocking_seconds']:.3f} s came after step {n}'s device work had finished (before that it "
            f"waited for step {n});{background} The naive clock puts all of the held time into step {n + 1} "
            f"({naive[n + 1]:.3f} s, {_tflops(flops, naive[n + 1])} TFLOP/s). steptrace keeps it out of "
            f"compute: step {n + 1} shows {ck_idle:.3f} s idle 'checkpoint' next to "
            f"{after['compute_seconds']:.4f} s of compute.")

    slow = [n for n in range(len(naive)) if n % SLOW_EVERY == SLOW_EVERY - 1 and n in by_step]
    if slow:
        stall = [data_seconds.get(n, 0.0) for n in slow]
        waited = [(by_step[n].get("idle_breakdown") or {}).get("data", 0.0) for n in slow]
        hidden = sum(max(0.0, s - w) for s, w in zip(stall, waited))
        lines.append(
            f"Slow batches (steps {_list(slow)}): the loader took {_list(f'{s:.3f}' for s in stall)} s. The "
            f"naive clock adds all of it to the step, as if the model had slowed down. steptrace shows the "
            f"device waited on 'data' for {_list(f'{w:.3f}' for w in waited)} s: for the other "
            f"{hidden:.3f} s in total it was still running the step queued before, so that part of the stall "
            f"cost nothing.")
    return lines


def _list(items) -> str:
    return ", ".join(str(i) for i in items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--run-dir", default="steptrace-runs", help="steptrace run_dir (default steptrace-runs)")
    parser.add_argument("--run-id", default="demo",
                        help="run id (default demo); an earlier run with this id is deleted first")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                        help="save an orbax checkpoint after every K-th step (default 10)")
    parser.add_argument("--run-ahead", action="store_true",
                        help="do not log the previous step's loss each step: nothing syncs, the host runs "
                             "ahead of the device as far as JAX lets it")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="also write a per-step timeline PNG")
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                        help="the device's peak TFLOP/s, for MFU and HFU (a CPU has no entry in steptrace's table)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error("--peak-tflops must be > 0")
    if not args.run_id or "/" in args.run_id or args.run_id in (".", ".."):
        parser.error("--run-id must be a plain name")

    run_path = Path(args.run_dir) / args.run_id
    clean_run_dir(run_path)
    naive, _, flops = train(args)

    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped (CI, make, tests): do not squeeze the tables to 80 columns
        console = Console(width=max(console.width, 120))
    run = steptrace.report.load_run(run_path)
    steps = run.steps()
    # Naive and steptrace TFLOP/s divide the same count: the compiler's where steptrace has it.
    hardware = [r["hardware_flops"] for r in steps if r.get("hardware_flops")]
    if hardware:
        flops = hardware[-1]
    console.print()
    console.print(comparison_table(steps, naive, flops))
    for line in explain(run, naive, flops):
        console.print(f"• {line}", highlight=False)
    wall = sum(r["interval_seconds"] for r in steps)
    console.print(f"• Totals: the naive column sums to {sum(naive):.3f} s, from the start of the loop to when the "
                  f"host queued the last step; steptrace's intervals sum to {wall:.3f} s, ending when the device "
                  "finished it. Each steptrace second is either compute or idle with a reason.", highlight=False)
    console.print()
    steptrace.report.render_report(run, max_rows=0, console=console)
    if args.plot:
        written = steptrace.report.plot_timeline(run, args.plot)
        console.print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
