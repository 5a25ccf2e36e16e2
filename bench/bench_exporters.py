"""Cost of each exporter: training-thread and background time per step, side by side.

Usage::

    .venv/bin/python bench/bench_exporters.py            # 15 rounds x 2000 steps per variant
    .venv/bin/python bench/bench_exporters.py --quick    # 4 rounds x 1000
    .venv/bin/python bench/bench_exporters.py --json out.json

What is timed
-------------
The same loop for every variant, ``with steptrace.step(n, tokens=4096) as s: s.wait_for(x)``
(``x`` a plain Python object: host timing), with these sinks:

* ``no sink``        ``init(jsonl=False)``: the resolver runs, nothing is exported
* ``JSONL``          the embedded default (a file in a temp dir)
* ``Prometheus``     ``prometheus_port=0`` (served on a free port on 127.0.0.1; nothing scrapes it)
* ``OTLP``           ``otlp_endpoint`` = an in-process OTLP/HTTP receiver on 127.0.0.1 that reads
                     each request and answers 200 (the real exporter, the real HTTP round trip)
* ``all three``      JSONL + Prometheus + OTLP

Method (as in ``bench_overhead.py``): rounds interleave the variants. **thread ns/step** is the
loop's wall time per step with the interpreter switch interval raised to 1 s during the loop,
so the background threads cannot take the GIL in the middle: the work on the training
thread. **bg ns/step** is the time ``steptrace.flush()`` then takes: the resolver and sink
work those steps left behind, per step, done off the training thread (but under the same
GIL). ``x none`` is the per-round ratio to the ``no sink`` variant (paired within a round).
The ``records`` column checks that every step reached every sink and nothing was dropped.

How to read it
--------------
Exporters run behind their own bounded queue and thread, so the thread column should not move
with the sink (ratios ~1.0 within noise); what an exporter costs shows up in the bg column.
"""

from __future__ import annotations

import argparse
import gc
import http.server
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

import steptrace  # noqa: E402

pc = time.perf_counter_ns
LONG_SWITCH_INTERVAL = 1.0


class _DiscardOtlp(wl.AcceptOtlp):
    """Reads each OTLP/HTTP request and answers 200; keeps nothing."""

    requests = 0


VARIANTS = [
    ("no sink", {"jsonl": False}),
    ("JSONL", {"jsonl": True}),
    ("Prometheus", {"jsonl": False, "prometheus_port": 0}),
    ("OTLP", {"jsonl": False, "otlp": True}),
    ("all three", {"jsonl": True, "prometheus_port": 0, "otlp": True}),
]


class Bench:
    def __init__(self, iters: int):
        self.iters = iters
        self.next_step = 0
        self.tmp = tempfile.mkdtemp(prefix="steptrace-bench-exporters-")
        self.value = object()
        self.receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DiscardOtlp)
        threading.Thread(target=self.receiver.serve_forever, daemon=True).start()
        self.otlp_endpoint = f"http://127.0.0.1:{self.receiver.server_address[1]}"

    def run_variant(self, settings: dict) -> tuple[int, int, dict]:
        base = self.next_step
        self.next_step += self.iters
        settings = dict(settings)
        if settings.pop("otlp", False):
            settings["otlp_endpoint"] = self.otlp_endpoint
            settings["otlp_metrics_interval_s"] = 3600.0  # metrics export once, at shutdown
        run_id = f"bench-{base}"
        steptrace.init(run_dir=self.tmp, run_id=run_id, strict=False, annotate=False, **settings)
        gc.collect()
        time.sleep(0.02)  # let the fresh resolver go idle, as between the steps of a real loop
        value, iters = self.value, self.iters
        old = sys.getswitchinterval()
        sys.setswitchinterval(LONG_SWITCH_INTERVAL)
        try:
            t = pc()
            for n in range(base, base + iters):
                with steptrace.step(n, tokens=4096) as s:
                    s.wait_for(value)
            thread = pc() - t
        finally:
            sys.setswitchinterval(old)
        t = pc()
        ok = steptrace.flush(60.0)
        bg = pc() - t
        stats = steptrace.stats()
        steptrace.shutdown()
        shutil.rmtree(os.path.join(self.tmp, run_id), ignore_errors=True)
        return thread, bg, {"resolved": stats["steps"], "dropped": stats["dropped"], "flush_ok": ok}

    def close(self) -> None:
        self.receiver.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run(rounds: int, iters: int) -> dict:
    bench = Bench(iters)
    per = {label: {"thread": [], "bg": [], "checks": []} for label, _ in VARIANTS}
    try:
        for _label, settings in VARIANTS:  # untimed warm-up: imports, first-step setup
            bench.run_variant(settings)
        for _ in range(rounds):
            for label, settings in VARIANTS:
                thread, bg, check = bench.run_variant(settings)
                per[label]["thread"].append(thread / iters)
                per[label]["bg"].append(bg / iters)
                per[label]["checks"].append(check)
    finally:
        bench.close()
    base = per["no sink"]
    results = {}
    for label, _ in VARIANTS:
        th, bg = per[label]["thread"], per[label]["bg"]
        checks = per[label]["checks"]
        results[label] = {
            "thread_median_ns": wl.median(th),
            "thread_p90_ns": wl.percentile(th, 90),
            "bg_median_ns": wl.median(bg),
            "x_none_thread": wl.median([a / b for a, b in zip(th, base["thread"])]),
            "x_none_total": wl.median([(a + c) / (b + d) for a, b, c, d in
                                       zip(th, base["thread"], bg, base["bg"])]),
            "all_resolved": all(c["resolved"] == iters and c["flush_ok"] for c in checks),
            "dropped": sum(sum(c["dropped"].values()) for c in checks),
            "thread_ns_per_round": th,
            "bg_ns_per_round": bg,
        }
    return results


def render(results: dict, rounds: int, iters: int) -> str:
    rows = []
    for label, _ in VARIANTS:
        r = results[label]
        rows.append([label, f"{r['thread_median_ns']:.0f}", f"{r['thread_p90_ns']:.0f}",
                     f"{r['x_none_thread']:.2f}", f"{r['bg_median_ns']:.0f}", f"{r['x_none_total']:.2f}",
                     f"{'all' if r['all_resolved'] else 'MISSING'} / {r['dropped']} dropped"])
    table = wl.fmt_table(["variant", "thread ns/step", "p90", "x none", "bg ns/step", "total x none", "records"],
                         rows)
    return (wl.header(f"steptrace exporters: cost per step ({rounds} rounds x {iters} steps, medians)")
            + "\n\n" + table + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds x 1000 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", metavar="PATH", help="also write every number measured")
    args = parser.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 15)
    iters = args.iters or (1000 if args.quick else 2000)
    results = run(rounds, iters)
    print(render(results, rounds, iters))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": wl.machine_info(), "rounds": rounds, "iters": iters, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
