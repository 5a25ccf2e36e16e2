"""Host cost of one instrumented training step, on the training thread and in the background.

Usage::

    .venv/bin/python bench/bench_overhead.py            # 20 rounds x 2000 steps per variant
    .venv/bin/python bench/bench_overhead.py --quick    # 5 rounds x 1000
    .venv/bin/python bench/bench_overhead.py --json out.json

What is timed
-------------
Each variant is a loop of ``--iters`` iterations of one "step" and nothing else:

* ``for-loop only``        ``for n in range(...): pass`` (every row below includes this)
* ``2x perf_counter_ns``   two clock reads
* ``floor``                two clock reads + ``collections.deque.append((t0, t1))``: the least any
                           recorder of step start/end times can do on the training thread
* ``plain Python ctx``     ``with ctx(n) as s: s.wait_for(x)`` where ctx is a do-nothing Python
                           class: the least any API of steptrace's *shape* (a ``with`` + a method call)
                           can cost in pure Python
* ``steptrace disabled``   ``init(enabled=False)``, then ``with steptrace.step(n) as s: s.wait_for(x)``
* ``steptrace ...``        the same, enabled: ``x`` a plain Python object (host device: the step is
                           handed to the resolver at exit) or a ``jax.Array`` that is already computed
                           (the JAX device path: handed over at ``wait_for``, the resolver calls
                           ``jax.block_until_ready`` in the background); records go to a
                           ``MemorySink`` (``jsonl=False``) or to JSONL in a temp dir (no other sink).
                           steptrace's defaults otherwise; because jax is imported in this process,
                           that includes ``annotate=True`` (a profiler-annotation check per step);
                           the ``annotate=False`` rows turn it off to show its share. Each run's first
                           step (its one-time setup) is timed apart, before the loop, and printed once
                           under the table.
* ``host value, Memory, ...`` one feature at a time against ``steptrace host value, MemorySink``
                           (issue 35): the stall watch off, the stall watch and annotations off,
                           one ``s.log(loss=0.5)`` per step, one empty ``steptrace.span("data")`` per step,
                           deep capture armed with every trigger (issue 37; none fires), the per-step
                           calls in Python instead of compiled (steptrace/_hotpath.c; where it is not
                           built both rows run Python, and the header says so).
* ``OpenTelemetry span``   ``with tracer.start_as_current_span("train_step"): pass`` with the SDK
                           ``TracerProvider`` + ``BatchSpanProcessor`` and an exporter that discards
                           (``max_queue_size`` raised so no span is dropped).

Method
------
``--rounds`` rounds; in each round every variant runs once, in the order above (interleaved, so
slow drifts of this noisy machine hit all variants alike). Step numbers increase strictly across the
whole run. For each round and variant:

* **thread ns/step**: wall time of the loop / iterations. During the timed loop the interpreter's
  switch interval is raised to 1 s (and ``gc.collect()`` runs just before, untimed), so the
  background threads (steptrace's resolver and sink threads, OTel's batch thread) cannot take
  the GIL in the middle: the number is the work done *on the training thread* per step.
  Each steptrace loop starts with its resolver idle (as between the steps of a real loop, which
  are milliseconds apart), so every hand-over includes waking it (``threading.Event.set``): in a
  tight loop whether that happens would otherwise depend on a race at the start of the loop.
* **bg ns/step**: then, with the default switch interval, ``steptrace.flush()`` (resp. the
  processor's ``force_flush()``) is timed: the background work those steps left behind
  (resolving, building records, exporting), per step. It is CPU/GIL time the process spends
  anyway, off the training thread. Not part of the thread column.
* **total** = thread + bg: the whole host CPU cost per step.

Reported per variant: median over rounds and p90 over rounds of the per-round ns/step, and the
median over rounds of the per-round ratios to ``floor`` and to the OTel span (paired within a round).

How to read it
--------------
``x floor`` says how many "minimal recorders" one step costs; ``x OTel`` < 1 means cheaper than
one OTel SDK span. The budgets (issue 35) are printed under the table with met/missed: the thread
cost <= 5x the floor with a host value and <= 7x with a ``jax.Array``; background <= 10 us
(MemorySink) and <= 20 us (JSONL) per step, <= 20 / 25 us with a ``jax.Array``; disabled <= 1.2x
the plain Python ctx. The ``per feature`` table gives each feature row's extra cost against
``host value, MemorySink``, paired within a round (median over rounds).
The ``records`` column checks that nothing was dropped (records seen / steps run).

The background work runs under the same GIL: when a step resolves while the training thread is
running Python, the training thread waits for the resolver's share (``bg ns/step``) at that
moment. With steps milliseconds apart this is small next to the step, but it is not free.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

import steptrace  # noqa: E402
from steptrace import _handles, _runtime  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

pc = time.perf_counter_ns
LONG_SWITCH_INTERVAL = 1.0
# The budgets of issue 35, relative to what this machine does in the same run (a slow or contended
# VM slows every row; the ratios much less): the training thread's cost per step in floors (two
# clock reads and a deque.append), the background's (resolver + sinks, off the training thread)
# in microseconds per step, and the disabled step against a do-nothing `with` of the same shape.
BUDGET_THREAD_X_FLOOR = {
    "loop_enabled_host_memory": 5.0, "loop_enabled_host_jsonl": 5.0,
    "loop_enabled_jax_memory": 7.0, "loop_enabled_jax_jsonl": 7.0,
}
BUDGET_BG_NS = {
    "loop_enabled_host_memory": 10_000, "loop_enabled_host_jsonl": 20_000,
    "loop_enabled_jax_memory": 20_000, "loop_enabled_jax_jsonl": 25_000,
}
BUDGET_DISABLED_X_PLAIN_CTX = 1.2
#: The per-feature rows, each against this one (paired within a round).
FEATURE_BASE = "loop_enabled_host_memory"


class _Ctx:
    """The cheapest possible Python object with steptrace's step-handle shape."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False

    def wait_for(self, *values):
        return None


_CTX = _Ctx()


def _plain_ctx(n):
    return _CTX


class Bench:
    def __init__(self, iters: int):
        import jax
        import jax.numpy as jnp

        self.iters = iters
        self.next_step = 0
        self.tmp = tempfile.mkdtemp(prefix="steptrace-bench-")
        self.host_value = object()
        self.jax_value = jnp.ones((), jnp.float32)
        jax.block_until_ready(self.jax_value)
        self.deque: collections.deque = collections.deque()
        self._otel = None

    # -- loops: each returns the elapsed ns of the timed loop only ---------------------
    def _timed(self, loop, collect: bool = True) -> int:
        if collect:
            gc.collect()
        old = sys.getswitchinterval()
        sys.setswitchinterval(LONG_SWITCH_INTERVAL)
        try:
            return loop()
        finally:
            sys.setswitchinterval(old)

    def loop_empty(self):
        def loop():
            t = pc()
            for _n in range(self.iters):
                pass
            return pc() - t
        return self._timed(loop), 0, None

    def loop_clocks(self):
        def loop():
            t = pc()
            for _n in range(self.iters):
                pc()
                pc()
            return pc() - t
        return self._timed(loop), 0, None

    def loop_floor(self):
        d = self.deque

        def loop():
            t = pc()
            for _n in range(self.iters):
                t0 = pc()
                t1 = pc()
                d.append((t0, t1))
            return pc() - t
        elapsed = self._timed(loop)
        d.clear()
        return elapsed, 0, None

    def loop_plain_ctx(self):
        x = self.host_value

        def loop():
            t = pc()
            for n in range(self.iters):
                with _plain_ctx(n) as s:
                    s.wait_for(x)
            return pc() - t
        return self._timed(loop), 0, None

    def _steptrace_loop(self, value, base, body=None):
        # One loop per body, not one loop with a branch: the timed loop holds only what it measures.
        iters = self.iters
        if body == "log":
            def loop():
                t = pc()
                for n in range(base, base + iters):
                    with steptrace.step(n) as s:
                        s.log(loss=0.5)
                        s.wait_for(value)
                return pc() - t
        elif body == "span":
            def loop():
                t = pc()
                for n in range(base, base + iters):
                    with steptrace.step(n) as s:
                        with steptrace.span("data"):
                            pass
                        s.wait_for(value)
                return pc() - t
        else:
            def loop():
                t = pc()
                for n in range(base, base + iters):
                    with steptrace.step(n) as s:
                        s.wait_for(value)
                return pc() - t
        return loop

    def loop_disabled(self):
        steptrace.init(enabled=False)
        base = self.next_step
        self.next_step += self.iters
        elapsed = self._timed(self._steptrace_loop(self.host_value, base))
        steptrace.shutdown()
        return elapsed, 0, None

    def _enabled(self, value, sink: str, body=None, **settings):
        base = self.next_step
        self.next_step += self.iters + 1
        run_id = f"bench-{base}"
        if sink == "memory":
            mem = MemorySink()
            steptrace.init(jsonl=False, sinks=[mem], run_id=run_id, strict=False, **settings)
        else:
            mem = None
            steptrace.init(jsonl=True, run_dir=self.tmp, run_id=run_id, strict=False, **settings)
        # The run's first step does its one-time setup (the run's metadata, the frameworks' hooks): timed
        # apart and reported once, so the per-step columns do not depend on how many steps a round has.
        t = pc()
        with steptrace.step(base) as s:
            s.wait_for(value)
        first_ns = pc() - t
        base += 1
        # Let the fresh resolver go idle first (gc before, not after: a collection can release the
        # GIL). A resolver idle at each step is the steady state of a real loop, whose steps are
        # milliseconds apart: every hand-over then also wakes it (Event.set), and that is timed.
        gc.collect()
        time.sleep(0.02)
        resolver = getattr(steptrace._active, "resolver", None)
        idle_at_start = getattr(resolver, "_sleeping", None)
        elapsed = self._timed(self._steptrace_loop(value, base, body), collect=False)
        t = pc()
        ok = steptrace.flush(60.0)
        bg = pc() - t
        stats = steptrace.stats()
        steptrace.shutdown()
        if mem is not None:
            seen = len(mem.steps())
        else:
            path = os.path.join(self.tmp, run_id, "rank-0.jsonl")
            with open(path) as f:
                seen = sum(1 for line in f if '"type":"step"' in line)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        check = {"steps": self.iters + 1, "records": seen, "resolved": stats["steps"], "first_step_ns": first_ns,
                 "dropped": stats["dropped"], "flush_ok": ok, "resolver_idle_at_start": idle_at_start}
        return elapsed, bg, check

    def loop_enabled_host_memory(self):
        return self._enabled(self.host_value, "memory")

    def loop_enabled_host_jsonl(self):
        return self._enabled(self.host_value, "jsonl")

    def loop_enabled_jax_memory(self):
        return self._enabled(self.jax_value, "memory")

    def loop_enabled_jax_jsonl(self):
        return self._enabled(self.jax_value, "jsonl")

    def loop_enabled_host_memory_noannotate(self):
        return self._enabled(self.host_value, "memory", annotate=False)

    def loop_enabled_jax_memory_noannotate(self):
        return self._enabled(self.jax_value, "memory", annotate=False)

    # -- one feature at a time, against "host value, MemorySink" (issue 35) ----------------
    def loop_enabled_host_memory_nostall(self):
        return self._enabled(self.host_value, "memory", stall_watch=False)

    def loop_enabled_host_memory_bare(self):
        return self._enabled(self.host_value, "memory", stall_watch=False, annotate=False)

    def loop_enabled_host_memory_log(self):
        return self._enabled(self.host_value, "memory", body="log")

    def loop_enabled_host_memory_span(self):
        return self._enabled(self.host_value, "memory", body="span")

    def loop_enabled_host_memory_python(self):
        # The per-step calls in Python (what an install without a C compiler runs; docs/configuration.md),
        # against the compiled ones of "host value, MemorySink".
        if _handles._hotpath is None:
            return self._enabled(self.host_value, "memory")  # not built here: the row is the same loop
        _runtime.compiled_hot_path(False)
        try:
            return self._enabled(self.host_value, "memory")
        finally:
            _runtime.compiled_hot_path(True)

    def loop_enabled_host_memory_pauses(self):
        # Host pauses watched (issue 50): no per-step call on the training thread (the gc callback runs per
        # collection, none here); the resolver reads the thread's /proc counters per step (bg column).
        return self._enabled(self.host_value, "memory", pauses=True)

    def loop_enabled_host_memory_capture(self):
        # Deep capture armed with every trigger (issue 37). The slow-step factor is set out of reach so
        # no capture starts in a loop of microsecond steps: what is timed is the armed cost alone.
        return self._enabled(self.host_value, "memory", capture="slow,stall,request", capture_slow_factor=1e9)

    def _otel_setup(self):
        if self._otel is None:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

            class DiscardExporter(SpanExporter):
                def __init__(self):
                    self.count = 0

                def export(self, spans):
                    self.count += len(spans)
                    return SpanExportResult.SUCCESS

                def shutdown(self):
                    pass

                def force_flush(self, timeout_millis: int = 30000) -> bool:
                    return True

            exporter = DiscardExporter()
            provider = TracerProvider()
            processor = BatchSpanProcessor(exporter, max_queue_size=max(2048, 2 * self.iters))
            provider.add_span_processor(processor)
            self._otel = (provider, processor, exporter, provider.get_tracer("steptrace-bench"))
        return self._otel

    def loop_otel(self):
        provider, processor, exporter, tracer = self._otel_setup()
        before = exporter.count

        def loop():
            t = pc()
            for _n in range(self.iters):
                with tracer.start_as_current_span("train_step"):
                    pass
            return pc() - t
        elapsed = self._timed(loop)
        t = pc()
        processor.force_flush(60_000)
        bg = pc() - t
        return elapsed, bg, {"steps": self.iters, "records": exporter.count - before}

    def close(self):
        if self._otel is not None:
            self._otel[0].shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


VARIANTS = [
    ("for-loop only", "loop_empty"),
    ("2x perf_counter_ns", "loop_clocks"),
    ("floor: 2 clocks + deque.append", "loop_floor"),
    ("plain Python ctx + wait_for", "loop_plain_ctx"),
    ("steptrace disabled", "loop_disabled"),
    ("steptrace host value, MemorySink", "loop_enabled_host_memory"),
    ("steptrace host value, JSONL", "loop_enabled_host_jsonl"),
    ("steptrace host value, Memory, annotate=False", "loop_enabled_host_memory_noannotate"),
    ("steptrace jax.Array, MemorySink", "loop_enabled_jax_memory"),
    ("steptrace jax.Array, JSONL", "loop_enabled_jax_jsonl"),
    ("steptrace jax.Array, Memory, annotate=False", "loop_enabled_jax_memory_noannotate"),
    ("host value, Memory, stall_watch=False", "loop_enabled_host_memory_nostall"),
    ("host value, Memory, no stall watch, no annotate", "loop_enabled_host_memory_bare"),
    ("host value, Memory, + s.log(loss=0.5)", "loop_enabled_host_memory_log"),
    ("host value, Memory, + one span in the step", "loop_enabled_host_memory_span"),
    ("host value, Memory, capture armed (slow,stall,request)", "loop_enabled_host_memory_capture"),
    ("host value, Memory, pauses=True (gc, preempted, faults)", "loop_enabled_host_memory_pauses"),
    ("host value, Memory, per-step calls in Python", "loop_enabled_host_memory_python"),
    ("OpenTelemetry SDK span (batch, discard)", "loop_otel"),
]
FLOOR = "loop_floor"
OTEL = "loop_otel"


def run(rounds: int, iters: int) -> dict:
    bench = Bench(iters)
    per = {m: {"thread": [], "bg": [], "checks": []} for _, m in VARIANTS}
    try:
        # One untimed warm-up round: first-step setup (jax adapter import, listener), OTel import.
        for _, m in VARIANTS:
            getattr(bench, m)()
        for _round in range(rounds):
            for _, m in VARIANTS:
                thread_ns, bg_ns, check = getattr(bench, m)()
                per[m]["thread"].append(thread_ns / iters)
                per[m]["bg"].append(bg_ns / iters)
                if check is not None:
                    per[m]["checks"].append(check)
    finally:
        bench.close()
    results = {}
    for label, m in VARIANTS:
        th, bg = per[m]["thread"], per[m]["bg"]
        tot = [a + b for a, b in zip(th, bg)]
        results[m] = {
            "label": label,
            "thread_ns_per_round": th,
            "bg_ns_per_round": bg,
            "thread_median_ns": wl.median(th),
            "thread_p90_ns": wl.percentile(th, 90),
            "bg_median_ns": wl.median(bg),
            "total_median_ns": wl.median(tot),
            "x_floor": wl.median([a / b for a, b in zip(th, per[FLOOR]["thread"])]),
            "x_plain_ctx": wl.median([a / b for a, b in zip(th, per["loop_plain_ctx"]["thread"])]),
            "x_otel": wl.median([a / b for a, b in zip(th, per[OTEL]["thread"])]),
            "total_x_otel": wl.median([a / b for a, b in zip(tot, [x + y for x, y in zip(per[OTEL]["thread"],
                                                                                      per[OTEL]["bg"])])]),
            "checks": per[m]["checks"],
        }
    return results


def first_step_line(results: dict) -> str:
    """The one-time cost of a run's first step (its setup), timed apart from the per-step loop."""
    firsts = [c["first_step_ns"] for r in results.values() for c in r["checks"] if "first_step_ns" in c]
    if not firsts:
        return ""
    return (f"  a run's first step (one-time setup: metadata, framework hooks), timed apart from the loops above: "
            f"median {wl.median(firsts) / 1e3:.0f} us over {len(firsts)} runs")


def render(results: dict, rounds: int, iters: int) -> str:
    rows = []
    for _, m in VARIANTS:
        r = results[m]
        checks = r["checks"]
        if checks:
            seen = sum(c["records"] for c in checks)
            want = sum(c["steps"] for c in checks)
            dropped = sum(sum(c.get("dropped", {}).values()) for c in checks)
            rec = f"{seen}/{want}" + (f" drop={dropped}" if dropped else "")
        else:
            rec = "-"
        has_bg = any(r["bg_ns_per_round"])
        rows.append([
            r["label"],
            f"{r['thread_median_ns']:.0f}",
            f"{r['thread_p90_ns']:.0f}",
            f"{r['x_floor']:.2f}",
            f"{r['x_otel']:.2f}",
            f"{r['bg_median_ns']:.0f}" if has_bg else "-",
            f"{r['total_median_ns']:.0f}" if has_bg else "-",
            f"{r['total_x_otel']:.2f}" if has_bg else "-",
            rec,
        ])
    table = wl.fmt_table(
        ["variant", "thread ns/step", "p90", "x floor", "x OTel", "bg ns/step", "total ns", "total x OTel",
         "records"], rows)
    lines = [
        wl.header("steptrace bench_overhead: host cost per step"),
        f"  {rounds} rounds x {iters} steps per variant, variants interleaved per round; medians over rounds",
        "  per-step calls: " + ("compiled (steptrace/_hotpath.c)" if _handles._hotpath is not None
                                else "in Python (the C extension is not built here, or STEPTRACE_PURE_PYTHON=1)"),
        "  budgets (issue 35): thread <= 5x floor (host value), <= 7x (jax.Array); background <= 10 / 20 us "
        "(Memory / JSONL), <= 20 / 25 us (jax.Array); disabled <= 1.2x plain ctx",
        "",
        table,
        "",
        "  per feature, against 'host value, MemorySink' (paired within a round, median over rounds):",
        feature_table(results),
        "",
        "  budgets:",
        *budget_lines(results),
        first_step_line(results),
        "  thread = training-thread cost (switch interval 1 s during the loop); bg = flush()/force_flush() time "
        "per step afterwards (background threads' work); total = thread + bg",
    ]
    return "\n".join(lines)


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def budget_lines(results: dict) -> list[str]:
    """One line per budget of issue 35: the figure, the budget, met or missed."""
    lines = []
    for m, budget in BUDGET_THREAD_X_FLOOR.items():
        r = results[m]
        lines.append(f"    thread {r['label'].replace('steptrace ', '')}: {r['x_floor']:.2f}x floor "
                     f"({r['thread_median_ns']:.0f} ns) <= {budget:.0f}x: {_verdict(r['x_floor'] <= budget)}")
    for m, budget in BUDGET_BG_NS.items():
        r = results[m]
        lines.append(f"    background {r['label'].replace('steptrace ', '')}: {r['bg_median_ns'] / 1000:.1f} us "
                     f"<= {budget / 1000:.0f} us: {_verdict(r['bg_median_ns'] <= budget)}")
    dis = results["loop_disabled"]
    lines.append(f"    disabled: {dis['x_plain_ctx']:.2f}x plain ctx ({dis['thread_median_ns']:.0f} ns vs "
                 f"{results['loop_plain_ctx']['thread_median_ns']:.0f} ns) <= {BUDGET_DISABLED_X_PLAIN_CTX}x: "
                 f"{_verdict(dis['x_plain_ctx'] <= BUDGET_DISABLED_X_PLAIN_CTX)}")
    return lines


def feature_table(results: dict) -> str:
    """Each row's extra thread and background cost over FEATURE_BASE, paired per round."""
    base = results[FEATURE_BASE]
    floor = results[FLOOR]["thread_ns_per_round"]
    rows = []
    for _, m in VARIANTS:
        if not m.startswith("loop_enabled") or m == FEATURE_BASE:
            continue
        r = results[m]
        d_thread = [a - b for a, b in zip(r["thread_ns_per_round"], base["thread_ns_per_round"])]
        d_floor = [d / f for d, f in zip(d_thread, floor)]
        d_bg = [a - b for a, b in zip(r["bg_ns_per_round"], base["bg_ns_per_round"])]
        rows.append([r["label"], f"{wl.median(d_thread):+.0f}", f"{wl.median(d_floor):+.2f}",
                     f"{wl.median(d_bg) / 1000:+.1f}"])
    return wl.fmt_table(["variant", "thread ns/step", "x floor", "bg us/step"], rows)


#: The Python-heavy loop of the gc row: container objects kept alive for a step, so CPython's young
#: generation fills ~100 times a step (threshold 700 allocations), then dropped.
GC_HEAVY_OBJECTS = 70_000
#: Issue 50's budget for the gc callback on that loop: its share of the loop's time.
BUDGET_GC_CALLBACK_SHARE = 0.005


def gc_callback_cost(rounds: int, steps: int = 10) -> dict:
    """The gc callback's cost on a loop whose steps run ~100 young collections each. Two measures: (1) the
    loop's steps with steptrace's watch in gc.callbacks (armed on this thread, as init(pauses=True) does)
    and without, alternating step by step (the medians' ratio), and with a plain Python callback for
    scale; (2) what the watch adds to one collection (gc.collect(0) with and without it, in alternating
    blocks) times the collections per step, over the step: the same share with far less of a shared
    machine's noise."""
    from steptrace._pauses import HostPauses, _PyGcWatch

    compiled = HostPauses(_handles._hotpath).watch
    compiled.arm()
    python = _PyGcWatch()
    python.arm()

    def one_step(callback) -> float:
        if callback is not None:
            gc.callbacks.append(callback)
        try:
            t = pc()
            keep = [[] for _ in range(GC_HEAVY_OBJECTS)]
            del keep
            return pc() - t
        finally:
            if callback is not None:
                gc.callbacks.remove(callback)

    times: dict[str, list[float]] = {"base": [], "compiled": [], "python": []}
    before = gc.get_stats()[0]["collections"]
    one_step(None)  # warm-up
    for _ in range(rounds * steps):
        times["base"].append(one_step(None))
        times["compiled"].append(one_step(compiled))
        times["python"].append(one_step(python))
        compiled.take()
        python.take()
    young = (gc.get_stats()[0]["collections"] - before) / (3 * rounds * steps + 1)
    base = wl.median(times["base"])
    # Per collection, everything the callback adds (CPython builds the info dict and calls it twice only
    # while gc.callbacks is not empty): gc.collect(0) of a near-empty young generation, in blocks with and
    # without the watch, alternating; the median block difference.
    n = 200
    diffs = []
    for _ in range(rounds * 40):
        t = pc()
        for _ in range(n):
            gc.collect(0)
        plain = pc() - t
        gc.callbacks.append(compiled)
        t = pc()
        for _ in range(n):
            gc.collect(0)
        watched = pc() - t
        gc.callbacks.remove(compiled)
        compiled.take()
        diffs.append((watched - plain) / n)
    per_collection_ns = max(0.0, wl.median(diffs))
    return {"step_ns": base, "young_per_step": young,
            "compiled_share": wl.median(times["compiled"]) / base - 1.0,
            "python_share": wl.median(times["python"]) / base - 1.0,
            "per_collection_ns": per_collection_ns,
            "direct_share": per_collection_ns * young / base,
            "compiled": type(compiled).__module__ != "steptrace._pauses"}


def render_gc(r: dict) -> str:
    return (f"  gc callback on a Python-heavy loop ({r['young_per_step']:.0f} young collections a step, "
            f"{r['step_ns'] / 1e6:.1f} ms a step): {'C' if r['compiled'] else 'Python'} watch adds "
            f"{r['per_collection_ns']:.0f} ns a collection = {r['direct_share'] * 100:.3f} % of the step (budget <= "
            f"{BUDGET_GC_CALLBACK_SHARE * 100:.1f} %: {_verdict(r['direct_share'] <= BUDGET_GC_CALLBACK_SHARE)}); "
            f"steps timed with it {r['compiled_share'] * 100:+.2f} %, with a plain Python callback "
            f"{r['python_share'] * 100:+.2f} % (alternating steps, medians: the machine's noise)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds x 1000 steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 20)
    iters = args.iters or (1000 if args.quick else 2000)
    t0 = time.perf_counter()
    results = run(rounds, iters)
    print(render(results, rounds, iters))
    gc_row = gc_callback_cost(rounds)
    results["gc_callback"] = gc_row
    print(render_gc(gc_row))
    print(f"  (wall {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "overhead", "machine": wl.machine_info(), "rounds": rounds, "iters": iters,
                       "budgets": {"thread_x_floor": BUDGET_THREAD_X_FLOOR, "bg_ns": BUDGET_BG_NS,
                                   "disabled_x_plain_ctx": BUDGET_DISABLED_X_PLAIN_CTX},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
