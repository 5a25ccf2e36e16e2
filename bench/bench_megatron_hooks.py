"""Training-thread cost of the Megatron hooks per hooked call, on CPU or on a CUDA GPU.

Usage::

    .venv/bin/python bench/bench_megatron_hooks.py            # 7 rounds x best of 20 loops x 2 steps x 32 microbatches
    .venv/bin/python bench/bench_megatron_hooks.py --quick    # 3 rounds x 10 steps
    .venv/bin/python bench/bench_megatron_hooks.py --json out.json
    python bench/bench_megatron_hooks.py --device cuda        # the GPU figure (auto: cuda when available)

Why: every pipeline microbatch goes through two hooked calls (``schedules.forward_step`` and
``schedules.backward_step``), so their cost on the training thread multiplies by
2 x microbatches x steps. The target is at most 10 µs per hooked call.

Method: the hooks are built exactly as ``install()`` builds them, around no-op functions that
carry megatron-core's real signatures (the installed megatron-core's when importable), and are
called the way Megatron's schedules call them (positional arguments plus
``current_microbatch=``; ``backward_step`` gets back the object ``forward_step`` returned). A
loop of ``steps`` steps x ``microbatches`` x (forward, backward) runs with steptrace on (host
backend, a sink that discards; the switch interval set to 1 s during each loop so the background
threads stay off the GIL, and ``flush()`` between loops) in four variants, interleaved per round:

* ``bare``: the no-op functions, unhooked, inside ``steptrace.step`` (the floor);
* ``microbatch only``: the no-ops inside ``with steptrace.microbatch(...)`` written by hand, what
  steptrace's core costs per unit whoever calls it;
* ``hooked``: the hooks (pairing, argument reads, the microbatch);
* ``hooked, steptrace off``: the hooks after ``steptrace.shutdown()`` (a pass-through).

Each round runs each variant ``steps / 2`` times for 2 steps and keeps the fastest (a shared
machine only ever adds time); reported: ns per call above ``bare`` (median over rounds), and its ratio to the core's
``microbatch only`` cost. With ``--device cuda`` (the default where ``torch.cuda.is_available()``)
steptrace runs its CUDA backend, so each step and microbatch also records its pooled CUDA events
(``cudaEventRecord``, ``is_current_stream_capturing``/``current_stream`` once per unit): that is
the figure the 10 µs target is about. On CPU those records are absent.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
import warnings

import steptrace


class _Discard:
    """A sink that keeps nothing (a growing in-memory sink makes every GC pass slower)."""

    def export(self, records):
        pass

    def force_flush(self, timeout_s):
        return True

    def shutdown(self, timeout_s):
        pass


LONG_SWITCH_INTERVAL = 1.0


def _forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                  config, cp_group_size, collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                  is_first_microbatch=False, current_microbatch=None, vp_stage=None, is_last_stage=True):
    return [input_tensor], 1  # megatron-core 0.16.1's signature and return shape


def _backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    return None


def _originals():
    """No-ops with the installed megatron-core's signatures when it imports, else 0.16.1's."""
    fwd, bwd = _forward_step, _backward_step
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.pipeline_parallel import schedules
        fwd = lambda *a, **k: ([a[4] if len(a) > 4 else None], 1)  # noqa: E731
        fwd.__signature__ = inspect.signature(schedules.forward_step)
        bwd = lambda *a, **k: None  # noqa: E731
        bwd.__signature__ = inspect.signature(schedules.backward_step)
        source = "megatron-core " + getattr(sys.modules.get("megatron.core.package_info"), "__version__", "?")
    except Exception:
        source = "megatron-core 0.16.1 signatures (megatron-core not importable)"
    return fwd, bwd, source


def _backend(device: str) -> str:
    """steptrace's backend for ``--device``: ``torch`` (CUDA events on the current stream) or ``host``."""
    if device == "cpu":
        return "host"
    try:
        import torch
    except ImportError:
        torch = None
    available = torch is not None and torch.cuda.is_available()
    if device == "cuda" and not available:
        sys.exit("bench_megatron_hooks: --device cuda, but torch sees no CUDA GPU")
    if not available:
        return "host"
    torch.cuda.init()  # steptrace times with CUDA events once torch has initialized CUDA
    torch.zeros(1, device="cuda")
    return "torch"


def _loop(fwd, bwd, steps: int, microbatches: int, first_step: int, by_hand: bool = False) -> int:
    """ns for ``steps`` steps of ``microbatches`` forward+backward calls."""
    step, mb = steptrace.step, steptrace.microbatch
    old = sys.getswitchinterval()
    # Keep steptrace's background threads off the GIL during the loop (as bench_overhead does):
    # the number is the training thread's own work. flush() between loops lets them catch up.
    sys.setswitchinterval(LONG_SWITCH_INTERVAL)
    try:
        return _timed_loop(fwd, bwd, steps, microbatches, first_step, by_hand, step, mb)
    finally:
        sys.setswitchinterval(old)


def _timed_loop(fwd, bwd, steps, microbatches, first_step, by_hand, step, mb) -> int:
    t0 = time.perf_counter_ns()
    for n in range(first_step, first_step + steps):
        with step(n):
            for i in range(microbatches):
                x = object()
                if by_hand:
                    with mb(i, stage=0, kind="forward"):
                        out, _ = fwd(None, None, None, microbatches, x, [], None, 1, False, None, i == 0,
                                     current_microbatch=i)
                    with mb(i, stage=0, kind="backward"):
                        bwd(None, out, None, None, None)
                else:
                    out, _ = fwd(None, None, None, microbatches, x, [], None, 1, False, None, i == 0,
                                 current_microbatch=i)
                    bwd(None, out, None, None, None)
    return time.perf_counter_ns() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cuda: steptrace's CUDA-event backend (auto: cuda when torch sees a GPU)")
    opts = ap.parse_args()
    backend = _backend(opts.device)
    rounds, steps, microbatches = (3, 10, 32) if opts.quick else (7, 40, 32)
    repeats = steps // 2  # short loops of 2 steps each; a round keeps the fastest (timeit's rule)

    import steptrace.adapters.megatron as hooks

    fwd, bwd, source = _originals()
    hooked_fwd, hooked_bwd = hooks._hook_forward_step(fwd), hooks._hook_backward_step(bwd)
    calls = 2 * microbatches * 2
    per_call: dict[str, list[float]] = {"bare": [], "microbatch only": [], "hooked": [], "hooked, steptrace off": []}
    n = 0
    for _ in range(rounds):
        steptrace.init(jsonl=False, sinks=[_Discard()], backend=backend)
        variants = [("bare", fwd, bwd, False), ("microbatch only", fwd, bwd, True),
                    ("hooked", hooked_fwd, hooked_bwd, False)]
        for name, f, b, by_hand in variants:
            best = None
            for _ in range(repeats):
                ns = _loop(f, b, 2, microbatches, n, by_hand)
                n += 2
                best = ns if best is None else min(best, ns)
                steptrace.flush()
            per_call[name].append(best / calls)
        steptrace.flush()
        steptrace.shutdown()
        per_call["hooked, steptrace off"].append(
            min(_loop(hooked_fwd, hooked_bwd, 2, microbatches, 0) for _ in range(repeats)) / calls)
    bare = statistics.median(per_call["bare"])
    core = statistics.median(per_call["microbatch only"]) - bare
    rows = []
    print(f"Megatron hooks, training-thread cost per hooked call ({source}; backend {backend}; "
          f"Python {sys.version.split()[0]}; "
          f"{rounds} rounds x best of {repeats} loops of 2 steps x {microbatches} microbatches x fwd+bwd; "
          "target <= 10000 ns)")
    print(f"{'variant':24} {'ns/call':>9} {'above bare':>11} {'x core':>7} {'spread':>8}")
    for name, values in per_call.items():
        med = statistics.median(values)
        above = med - bare if name != "bare" else 0.0
        spread = (max(values) - min(values)) / med if med else 0.0
        ratio = above / core if core > 0 and name != "bare" else float("nan")
        rows.append({"variant": name, "ns_per_call": med, "ns_above_bare": above, "x_core": ratio,
                     "spread": spread, "samples": values})
        print(f"{name:24} {med:9.0f} {above:11.0f} {ratio:7.2f} {spread:7.0%}")
    hooked = statistics.median(per_call["hooked"]) - bare
    print(f"hooked call: {hooked:.0f} ns above the bare call, of which steptrace.microbatch itself {core:.0f} ns; "
          f"{'within' if hooked <= 10_000 else 'OVER'} the 10 µs target. "
          + ("CUDA event records included." if backend == "torch" else
             "CUDA event records are not included (CPU run; --device cuda on a GPU machine includes them)."))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"source": source, "backend": backend, "rounds": rounds, "steps": steps,
                       "microbatches": microbatches, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
