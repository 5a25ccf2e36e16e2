"""Training-thread cost of the torch.distributed.pipelining hooks per hooked call (CPU).

Usage::

    .venv/bin/python bench/bench_pipelining_hooks.py            # 7 rounds x best of 20 loops x 2 steps
    .venv/bin/python bench/bench_pipelining_hooks.py --quick    # 3 rounds x 10 steps
    .venv/bin/python bench/bench_pipelining_hooks.py --json out.json

Why: every microbatch of every schedule goes through two hooked calls (``forward_one_chunk`` and
``backward_one_chunk``; three with a zero-bubble schedule's split backward), so their cost on the
training thread multiplies by microbatches x steps. The target is the Megatron hooks' one: at
most 10 µs per hooked call.

Method: the hooks are built exactly as ``steptrace.adapters.torch_pipelining.install()`` builds
them, around no-op functions with torch 2.13's ``_PipelineStageBase`` method signatures, and called
on an object carrying the attributes they read (``group_rank``, ``group_size``, ``stage_index``,
``num_stages``, ``has_backward``; 2 stages a rank, so ``chunk`` is computed). A loop of 2 steps x
``microbatches`` x (forward, backward) runs with steptrace on (host backend, a sink that discards,
the switch interval at 1 s so background threads stay off the GIL, ``flush()`` between loops) in
four variants interleaved per round: ``bare`` (the no-ops inside ``steptrace.step``), ``microbatch
only`` (the no-ops inside a hand-written ``steptrace.microbatch``: the core's own cost), ``hooked``,
and ``hooked, steptrace off``. Each round keeps each variant's fastest loop; reported: ns per
call above ``bare`` (median over rounds) and its ratio to the core's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import steptrace


class _Discard:
    def export(self, records):
        pass

    def force_flush(self, timeout_s):
        return True

    def shutdown(self, timeout_s):
        pass


def _forward(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
    return None


def _backward(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
    return None


def _loop(fwd, bwd, stage, microbatches: int, first_step: int, by_hand: bool) -> int:
    step, mb = steptrace.step, steptrace.microbatch
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t0 = time.perf_counter_ns()
        for n in range(first_step, first_step + 2):
            with step(n):
                for i in range(microbatches):
                    if by_hand:
                        with mb(i, stage=0, chunk=1, kind="forward"):
                            fwd(stage, i, ())
                        with mb(i, stage=0, chunk=1, kind="backward"):
                            bwd(stage, i, None, True, False)
                    else:
                        fwd(stage, i, ())
                        bwd(stage, i, None, True, False)
        return time.perf_counter_ns() - t0
    finally:
        sys.setswitchinterval(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    opts = ap.parse_args()
    rounds, steps, microbatches = (3, 10, 32) if opts.quick else (7, 40, 32)
    repeats = steps // 2

    import steptrace.adapters.torch_pipelining as hooks

    stage = types.SimpleNamespace(group_rank=0, group_size=2, stage_index=2, num_stages=4, has_backward=True)
    hooked_fwd, hooked_bwd = hooks._hook_forward(_forward), hooks._hook_backward(_backward)
    calls = 2 * microbatches * 2
    per_call: dict[str, list[float]] = {"bare": [], "microbatch only": [], "hooked": [], "hooked, steptrace off": []}
    n = 0
    for _ in range(rounds):
        steptrace.init(jsonl=False, sinks=[_Discard()], backend="host")
        variants = (("bare", _forward, _backward, False), ("microbatch only", _forward, _backward, True),
                    ("hooked", hooked_fwd, hooked_bwd, False))
        for name, f, b, by_hand in variants:
            best = None
            for _ in range(repeats):
                ns = _loop(f, b, stage, microbatches, n, by_hand)
                n += 2
                best = ns if best is None else min(best, ns)
                steptrace.flush()
            per_call[name].append(best / calls)
        steptrace.shutdown()
        per_call["hooked, steptrace off"].append(
            min(_loop(hooked_fwd, hooked_bwd, stage, microbatches, 0, False) for _ in range(repeats)) / calls)
    bare = statistics.median(per_call["bare"])
    core = statistics.median(per_call["microbatch only"]) - bare
    print(f"torch.distributed.pipelining hooks, training-thread cost per hooked call (backend host; "
          f"Python {sys.version.split()[0]}; {rounds} rounds x best of {repeats} loops of 2 steps x {microbatches} "
          "microbatches x fwd+bwd; target <= 10000 ns)")
    print(f"{'variant':24} {'ns/call':>9} {'above bare':>11} {'x core':>7} {'spread':>8}")
    rows = []
    for name, values in per_call.items():
        med = statistics.median(values)
        above = med - bare if name != "bare" else 0.0
        spread = (max(values) - min(values)) / med if med else 0.0
        ratio = above / core if core > 0 and name != "bare" else float("nan")
        rows.append({"variant": name, "ns_per_call": med, "ns_above_bare": above, "x_core": ratio, "spread": spread,
                     "samples": values})
        print(f"{name:24} {med:9.0f} {above:11.0f} {ratio:7.2f} {spread:7.0%}")
    hooked = statistics.median(per_call["hooked"]) - bare
    print(f"hooked call: {hooked:.0f} ns above the bare call, of which steptrace.microbatch itself {core:.0f} ns; "
          f"{'within' if hooked <= 10_000 else 'OVER'} the 10 µs target.")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"rounds": rounds, "steps": steps, "microbatches": microbatches, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
