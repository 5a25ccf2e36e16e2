"""Training throughput (steps/s) of a real JAX CPU loop: uninstrumented vs steptrace vs sync-every-step.

Usage::

    .venv/bin/python bench/bench_throughput.py            # 30 groups of blocks of 8 steps
    .venv/bin/python bench/bench_throughput.py --quick    # 10 groups
    .venv/bin/python bench/bench_throughput.py --json out.json

The loop is the steady state of bench_accuracy's loop (same jitted workload from
``_workload.py``, normal steps of ~25 ms, single-core XLA "device"), with a host-side data
load of ``--data-ms`` (5 ms, ``time.sleep``: I/O-bound loading that an asynchronous loop overlaps
with device compute) and lagged metric logging (``float(loss)`` of the previous step)::

    for n in block:
        [with steptrace.step(n) as s:]
            [with steptrace.span("data"):] time.sleep(data)
            x, loss = train_step(x, w, reps)
            [s.wait_for(x, loss)]                 # steptrace variant
            [jax.block_until_ready((x, loss))]    # sync-every-step variant
        float(previous loss)

Variants: ``uninstrumented`` (U); ``steptrace`` (S; steptrace's defaults: JSONL sink into a
temp run dir, profiler-annotation check on; ``init`` once before and ``shutdown`` after the
timed part, so its background threads are alive throughout); ``sync every step`` (Y;
``block_until_ready`` at the end of each step, the usual fix for wrong step times). The
function is compiled before timing.

Method: this machine's speed drifts by tens of percent over seconds (other processes share its
2 cores), so whole runs per variant cannot resolve 1%. Instead one long sequence of short
blocks (``--block`` steps, ~0.2 s) runs ``U S U Y U S U Y ... U``; each block starts from an idle
device and ends with ``block_until_ready`` on its last output (the drain is inside the block's
time, the same for every variant). Block throughput = steps / block time. Each S or Y block is
compared with the mean of the two U blocks around it (bracketing cancels linear drift); the
median of those ratios is reported, with their p25..p75 range.

How to read it: ``ratio`` 1.000 = as fast as uninstrumented; the target for steptrace is
within 1% (ratio >= 0.99). The sync variant shows what a per-step sync costs: the host can no
longer load the next batch while the device computes, and the device idles during every dispatch.
When the p25..p75 range is wider than the effect, the machine was too noisy to resolve it: a ratio
inside the noise range means "no measurable difference", not a precise value.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

XLA_FLAGS = wl.configure_xla()  # before jax: a single-core "device" (see _workload.configure_xla)

import jax  # noqa: E402

import steptrace  # noqa: E402

perf = wl.perf
VARIANTS = ["uninstrumented", "steptrace", "sync every step"]
TARGET_RATIO = 0.99


def run_block(variant: str, fn, x, w, r, n0: int, steps: int, data_s: float):
    """One block from an idle device to its last output being ready: (seconds, last x)."""
    prev = None
    t0 = perf()
    if variant == "steptrace":
        for n in range(n0, n0 + steps):
            with steptrace.step(n) as s:
                with steptrace.span("data"):
                    time.sleep(data_s)
                x, loss = fn(x, w, r)
                s.wait_for(x, loss)
            if prev is not None:
                float(prev)
            prev = loss
    elif variant == "sync every step":
        for _n in range(steps):
            time.sleep(data_s)
            x, loss = fn(x, w, r)
            jax.block_until_ready((x, loss))
            if prev is not None:
                float(prev)
            prev = loss
    else:
        for _n in range(steps):
            time.sleep(data_s)
            x, loss = fn(x, w, r)
            if prev is not None:
                float(prev)
            prev = loss
    jax.block_until_ready(x)
    return perf() - t0, x


CODE = {"U": "uninstrumented", "S": "steptrace", "Y": "sync every step"}


class Loader:
    """A data loader on a Python thread (as a thread-pool loader decoding in Python): each batch costs
    ``ms`` of bytecode, two are kept ready. ``get()`` is the training thread's wait for the next."""

    def __init__(self, ms: float):
        import queue
        import threading

        self.queue: queue.Queue = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        # Bytecode of about ``ms`` (calibrated here): a loop that CPython can switch out of anywhere.
        t0, n = perf(), 0
        while perf() - t0 < 0.05:
            n += self._decode(1000)
        self._trips = max(1, round(n * ms / 50.0))
        self._thread = threading.Thread(target=self._run, name="loader", daemon=True)
        self._thread.start()

    @staticmethod
    def _decode(trips: int) -> int:
        total = 0
        for i in range(trips):
            total += i % 7
        return trips

    def _run(self) -> None:
        import queue

        while not self._stop.is_set():
            self._decode(self._trips)
            while not self._stop.is_set():
                try:
                    self.queue.put(object(), timeout=0.1)
                    break
                except queue.Full:
                    continue

    def get(self) -> object:
        return self.queue.get()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run_switch_block(fn, x, w, r, n0: int, steps: int, loader: Loader):
    """One steptrace block whose data comes from ``loader``: (seconds, last x)."""
    prev = None
    t0 = perf()
    for n in range(n0, n0 + steps):
        with steptrace.step(n) as s:
            with steptrace.span("data"):
                loader.get()
            x, loss = fn(x, w, r)
            s.wait_for(x, loss)
        if prev is not None:
            float(prev)
        prev = loss
    jax.block_until_ready(x)
    return perf() - t0, x


def switch_compare(args, fn, x, w, r, B: int, groups: int) -> int:
    """steptrace's default against ``init(jax_switch_interval_s=...)`` on the same loop with a GIL-bound
    loader thread (issue 49: can init() choose the accurate setting by default?): blocks ``D W D W ... D``,
    each W bracketed by the D blocks around it; each block runs under its own init() (outside its time)."""
    loader = Loader(args.loader_ms)
    tmp = tempfile.mkdtemp(prefix="steptrace-bench-switch-")
    seq = list("DW" * groups) + ["D"]
    secs: list[float] = []
    n0 = 0
    try:
        for i, v in enumerate(seq):
            steptrace.init(run_dir=tmp, run_id=f"switch-{i}", strict=False, backend="jax",
                           jax_switch_interval_s=args.switch_s if v == "W" else None)
            run_switch_block(fn, x, w, r, n0, 2, loader)  # the resolver started, off the clock
            t, x = run_switch_block(fn, x, w, r, n0 + 2, B, loader)
            steptrace.shutdown()
            secs.append(t)
    finally:
        loader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [B / secs[i] / ((B / secs[i - 1] + B / secs[i + 1]) / 2) for i, v in enumerate(seq) if v == "W"]
    med = wl.median(ratios)
    print(f"steps/s with init(jax_switch_interval_s={args.switch_s}) / steptrace's default, JAX CPU loop, device "
          f"step ~{args.step_ms:.0f} ms, a loader thread of {args.loader_ms:.0f} ms of bytecode a batch, {groups} "
          f"bracketed pairs of {B}-step blocks: median {med:.3f} (p25..p75 {wl.percentile(ratios, 25):.3f}.."
          f"{wl.percentile(ratios, 75):.3f}); default {wl.median([B / t for v, t in zip(seq, secs) if v == 'D']):.2f} "
          f"steps/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "throughput-switch", "switch_s": args.switch_s, "loader_ms": args.loader_ms,
                       "sequence": "".join(seq), "block_seconds": secs, "ratios": ratios, "median_ratio": med}, f)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 groups")
    ap.add_argument("--groups", type=int, default=None, help="groups of U S U Y blocks (default 30, quick 10)")
    ap.add_argument("--block", type=int, default=8, help="steps per block")
    ap.add_argument("--step-ms", type=float, default=25.0, help="target device time of a step")
    ap.add_argument("--data-ms", type=float, default=5.0, help="host data-loading time per step")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--switch-s", type=float, default=None,
                    help="instead: steptrace's default against init(jax_switch_interval_s=SWITCH_S), with the data "
                         "from a loader thread that runs Python (--loader-ms of bytecode a batch)")
    ap.add_argument("--loader-ms", type=float, default=10.0, help="with --switch-s: the loader's bytecode per batch")
    args = ap.parse_args(argv)
    groups = args.groups or (10 if args.quick else 30)
    B = args.block
    wall0 = perf()

    x, w = wl.make_inputs()
    fn = wl.make_step_fn()
    reps, per_rep = wl.calibrate(fn, x, w, args.step_ms / 1000.0)
    r = wl.reps_arg(reps)
    if args.switch_s is not None:
        return switch_compare(args, fn, x, w, r, B, groups)
    tmp = tempfile.mkdtemp(prefix="steptrace-bench-tp-")
    data_s = args.data_ms / 1000.0
    seq = list("USUY" * groups) + ["U"]
    secs: list[float] = []
    n0 = 0
    try:
        _, x = run_block("uninstrumented", fn, x, w, r, 0, 2, data_s)  # warm-up
        steptrace.init(run_dir=tmp, run_id="bench-throughput", strict=False)
        for v in seq:
            t, x = run_block(CODE[v], fn, x, w, r, n0, B, data_s)
            if v == "S":
                n0 += B
            secs.append(t)
        steptrace.flush(60.0)
        stats = steptrace.stats()
        steptrace.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    sps_all = [B / t for t in secs]
    sps = {CODE[c]: [s_ for v, s_ in zip(seq, sps_all) if v == c] for c in "USY"}
    ratios = {CODE[c]: [] for c in "USY"}
    for i, v in enumerate(seq):
        if v == "U":
            ratios["uninstrumented"].append(1.0)
        else:
            ratios[CODE[v]].append(sps_all[i] / ((sps_all[i - 1] + sps_all[i + 1]) / 2))

    rows = []
    results = {}
    for v in VARIANTS:
        med = wl.median(ratios[v])
        results[v] = {"steps_per_s": sps[v], "median_steps_per_s": wl.median(sps[v]), "ratios": ratios[v],
                      "median_ratio": med, "ratio_p25": wl.percentile(ratios[v], 25),
                      "ratio_p75": wl.percentile(ratios[v], 75)}
        rows.append([v, len(sps[v]), f"{results[v]['median_steps_per_s']:.2f}",
                     f"{1e3 / results[v]['median_steps_per_s']:.1f}",
                     "-" if v == "uninstrumented" else f"{med:.3f}",
                     "-" if v == "uninstrumented" else f"{results[v]['ratio_p25']:.3f}..{results[v]['ratio_p75']:.3f}",
                     "-" if v == "uninstrumented" else f"{100 * (med - 1):+.1f}%"])
    table = wl.fmt_table(["variant", "blocks", "steps/s", "ms/step", "ratio", "ratio p25..p75", "vs uninstr."], rows)
    st = results["steptrace"]
    verdict = "YES" if st["median_ratio"] >= TARGET_RATIO else "NO"
    ok = stats["steps"] == groups * B and not stats["dropped"]
    out = [
        wl.header("steptrace bench_throughput: steps/s of a JAX CPU loop (async dispatch)"),
        f"  {groups} groups of U S U Y blocks of {B} steps (medians over blocks; ratios bracketed by the U "
        f"blocks around each); device step ~{args.step_ms:.0f} ms (reps {reps}), host data {args.data_ms:.0f} ms/step "
        f"(sleep), lagged metric read",
        f"  XLA_FLAGS={XLA_FLAGS!r}; target: steptrace >= {TARGET_RATIO:.2f} x uninstrumented",
        "",
        table,
        "",
        f"  steptrace within 1% of uninstrumented (median bracketed ratio >= {TARGET_RATIO}): {verdict}"
        f" (median {st['median_ratio']:.3f}, p25..p75 {st['ratio_p25']:.3f}..{st['ratio_p75']:.3f})",
        f"  sync every step costs {100 * (1 - results['sync every step']['median_ratio']):.1f}% of throughput",
        f"  steptrace records: {stats['steps']} steps resolved of {groups * B}, dropped {stats['dropped'] or 'none'}",
    ]
    if not ok:
        out.append("  WARNING: steptrace missed or dropped steps")
    out.append(f"  (wall {perf() - wall0:.0f} s)")
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "throughput", "machine": wl.machine_info(), "groups": groups, "block": B,
                       "sequence": "".join(seq), "block_seconds": secs,
                       "step_ms_target": args.step_ms, "data_ms": args.data_ms, "reps": reps,
                       "xla_flags": XLA_FLAGS, "results": results, "target_ratio": TARGET_RATIO,
                       "steptrace_within_target": verdict == "YES", "steptrace_stats": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
