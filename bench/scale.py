"""What a job of 1k-16k ranks costs its telemetry, part by part, plain and pipeline-parallel.

Usage::

    .venv/bin/python bench/scale.py                  # 1,024 / 4,096 / 16,384 ranks, 1,000 steps (~15 min)
    .venv/bin/python bench/scale.py --quick          # 1,024 / 4,096 ranks, 200 steps (~3 min)
    .venv/bin/python bench/scale.py --ranks 4096 --steps 1000 --json out.json

Each part is measured with the real code, once per kind, then multiplied out to N ranks where
the cost is per rank (what is multiplied is said per column):

* **series per rank**: the samples a default rank serves on a real ``/metrics`` after a real run
  (``bench/prometheus_scale.py``'s capture: tokens, FLOPs with a peak, a data span, an async
  checkpoint; the pipeline rank runs 32 microbatches x 4 chunks x forward/backward). Per job: ×
  N. ``bench/prometheus_scale.py`` loads that many into a real Prometheus (rule evaluation time,
  dashboard query samples).
* **OTLP per rank**: one real step's records (the pipeline step has 256 microbatch records)
  replayed into ``steptrace.otlp.OtlpSink`` against a keep-alive receiver on 127.0.0.1:
  ``time.thread_time()`` of the exporting thread per step (the rank's background CPU) and the
  trace request bytes per step, with records handed over as the SinkWorker does at 10 steps/s
  (``otlp_batch_delay_s`` 0.5 s: 5 steps a request). Per job: bytes × N × steps/s.
* **collector CPU per rank-step**: ``bench/collector_rank_cost.py``'s in-process path (request
  parse, step extraction, join, the cluster_step line) over 8-rank requests; × N is what one
  collector spends on one step, which the trace-id routing cannot split (``docs/collector.md``).
* **ClickHouse (chDB) per-step view**: N ranks × ``--steps`` ``train.step`` rows in the contrib
  exporter's ``otel_traces`` schema, generated inside the engine (``INSERT ... SELECT FROM
  numbers()``, the attributes the SDK writes, the pipeline rows with their microbatch summary),
  then ``steptrace.analysis.clickhouse.cluster_steps_sql`` over all of it: wall seconds of the
  query (best of two) and rows/s. chDB runs in this process on this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

KINDS = ("plain", "pipeline")


# -- the rank ------------------------------------------------------------------------------------

def rank_series(kind: str) -> tuple[int, int]:
    """(samples, bytes) of one default rank's /metrics after a real run of ``kind``."""
    import prometheus_scale

    text = prometheus_scale.capture(kind)
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return len(samples), len(text.encode())


def step_records(kind: str) -> list[dict[str, Any]]:
    """The records of one real step of ``kind`` (microbatches first, then the step), from the public API."""
    import steptrace
    from steptrace.testing import MemorySink, SimulatedDevice

    if kind == "pipeline":
        import bench_otlp_pipeline

        return bench_otlp_pipeline.one_pipeline_step()
    memory = MemorySink()
    device = SimulatedDevice(report_end_times=True)
    steptrace.init(sinks=[memory], jsonl=False, run_id="bench", stall_watch=False, peak_tflops=100.0)
    for n in range(2):
        with steptrace.span("data"):
            time.sleep(0.001)
        with steptrace.step(n, tokens=65536, flops=1e12) as s:
            s.wait_for(device.run(0.002))
    assert steptrace.shutdown(timeout_s=30)
    records = [r for r in memory.records if r.get("step") == 1 and r["type"] in ("span", "step")]
    return sorted(records, key=lambda r: r["type"] == "step")


def otlp_per_step(kind: str, steps: int) -> tuple[float, float]:
    """(export-thread CPU ms, trace KB) per step of ``kind``, 5 steps gathered per request."""
    import http.server

    import bench_otlp_pipeline as otlp

    records = step_records(kind)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), otlp._Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        runs = [otlp.run_variant(url, records, steps, "none", "gzip", k * steps, 5) for k in range(3)]
    finally:
        server.shutdown()
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


# -- the collector -------------------------------------------------------------------------------

def collector_cost(kind: str, quick: bool) -> float:
    """Collector CPU seconds per rank-step for ``kind``, as the SDK sends it by default (a pipeline
    step's microbatches as its summary): bench/collector_rank_cost.py's path, 64 ranks, 8 a request."""
    import collector_rank_cost as cost

    ranks, steps = 64, 5 if quick else 20
    data = cost.bodies(ranks, steps, 8, kind == "pipeline", microbatch_spans=False)
    return statistics.median(cost.collector_path(data, ranks)[0] / (ranks * steps) for _ in range(3))


# -- ClickHouse ----------------------------------------------------------------------------------

_SUMMARY_FIELDS = ("count", "compute_seconds_sum", "compute_seconds_min", "compute_seconds_max",
                   "first_start_time", "last_end_time")


def _generate_sql(table: str, ranks: int, steps: int, kind: str) -> str:
    """``INSERT ... SELECT`` of ranks × steps ``train.step`` rows as the exporter writes them."""
    extra = ""
    if kind == "pipeline":  # 1 stage x 4 chunks x 2 kinds summarised, and the stage's bubble
        extra = "".join(f", 'train.microbatch_summary.0.{c}.{k}.{f}', toString(rand() % 1000 / 1e4)"
                        for c in range(4) for k in ("forward", "backward") for f in _SUMMARY_FIELDS)
        extra += ", 'train.pipeline.bubble_ratio.0', toString(0.1 + (rank % 5) / 100)"
    return f"""
INSERT INTO {table} (Timestamp, TraceId, SpanId, SpanName, SpanKind, ServiceName, ResourceAttributes,
                     ScopeName, SpanAttributes, Duration, StatusCode)
SELECT toDateTime64(1764000000 + step * 0.5, 9), lower(hex(cityHash64('scale', step))),
       lower(hex(cityHash64('scale', step, rank))), 'train.step', 'Internal', 'steptrace',
       map('service.name', 'steptrace', 'service.instance.id', concat('scale/rank-', toString(rank))), 'steptrace',
       map('train.run_id', 'scale', 'train.rank', toString(rank), 'train.attempt', '0',
           'train.step', toString(step), 'train.world_size', '{ranks}', 'train.status', 'ok',
           'train.backend', 'torch', 'train.interval_seconds', '0.5',
           'train.compute_seconds', toString(0.375 + (rank % 7) / 1000),
           'train.idle_seconds', toString(0.125 - (rank % 7) / 1000), 'train.tokens', '65536',
           'train.flops', '1.2e+15', 'train.tokens_per_second', '131072', 'train.tflops_per_second', '2400',
           'train.mfu', '0.41', 'train.collective_wait_seconds', toString(0.05 + (rank % 3) / 1000),
           'train.own_seconds', toString(0.45 - (rank % 3) / 1000), 'train.idle.data_seconds', '0.1'{extra}),
       500000000, 'Unset'
FROM (SELECT intDiv(number, {ranks}) AS step, number % {ranks} AS rank FROM numbers({ranks * steps}))"""


_CLIENT: Any = None


def clickhouse_view_seconds(ranks: int, steps: int, kind: str) -> dict[str, float]:
    """Insert ranks × steps rows into chDB, then time the per-step view over them, on the exporter's
    table and on the typed table (``steptrace clickhouse views --typed``)."""
    global _CLIENT
    from steptrace.analysis import clickhouse as ch

    if _CLIENT is None:  # chDB runs one engine per process: one client for every configuration
        _CLIENT = ch.connect("chdb://?database=scale")
        _CLIENT.command(ch.otel_traces_ddl("scale"))
    client = _CLIENT
    client.command("TRUNCATE TABLE scale.otel_traces")
    start = time.perf_counter()
    client.command(_generate_sql("scale.otel_traces", ranks, steps, kind))
    out = {"insert_s": time.perf_counter() - start}
    create_table, _, backfill = ch.typed_table_sql("scale")
    client.command(f"DROP TABLE IF EXISTS scale.{ch.TYPED_TABLE}")
    client.command(create_table)
    start = time.perf_counter()
    client.command(backfill)  # what the materialized view does as the exporter inserts
    out["typed_copy_s"] = time.perf_counter() - start
    for label, typed_table in (("query_s", None), ("typed_query_s", ch.TYPED_TABLE)):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            rows = ch.cluster_steps(client, "scale", typed_table=typed_table)
            times.append(time.perf_counter() - start)
            assert len(rows) == steps and all(r["ranks_reporting"] == ranks for r in rows), "the view lost rows"
        out[label] = min(times)
    return out


# -- the table -----------------------------------------------------------------------------------

def _si(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (default 1024,4096,16384)")
    parser.add_argument("--steps", type=int, default=None, help="steps in the ClickHouse view (default 1000)")
    parser.add_argument("--no-clickhouse", action="store_true", help="skip the chDB part")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ranks = [int(n) for n in (args.ranks or ("1024,4096" if args.quick else "1024,4096,16384")).split(",")]
    steps = args.steps or (200 if args.quick else 1000)

    per_kind: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        series, scrape_bytes = rank_series(kind)
        cpu_ms, wire_kb = otlp_per_step(kind, 15 if args.quick else 40)
        per_kind[kind] = {"series": series, "scrape_kb": scrape_bytes / 1e3, "otlp_cpu_ms": cpu_ms,
                          "otlp_kb": wire_kb, "collector_us": collector_cost(kind, args.quick) * 1e6}

    results = []
    for n in ranks:
        for kind in KINDS:
            k = per_kind[kind]
            row: dict[str, Any] = {"ranks": n, "kind": kind, **k, "series_job": k["series"] * n,
                                   "otlp_mb_s_10": k["otlp_kb"] * n * 10 / 1e3,
                                   "collector_s_per_step": k["collector_us"] * n / 1e6}
            if not args.no_clickhouse:
                row.update(clickhouse_view_seconds(n, steps, kind))
            results.append(row)
            print(f"  measured {n} {kind}", file=sys.stderr, flush=True)

    print(wl.header(f"Telemetry at scale: per rank measured, per job multiplied out; ClickHouse over {steps} steps"))
    headers = ["ranks", "kind", "series/rank", "series/job", "/metrics KB/rank", "rank OTLP cpu ms/step",
               "OTLP KB/step/rank", "OTLP MB/s/job @10 st/s", "collector us/rank-step", "1 collector s/step"]
    if not args.no_clickhouse:
        headers += ["chDB view s (otel_traces)", "chDB view s (typed)", "typed rows/s"]
    rows = []
    for r in results:
        line = [f"{r['ranks']:,}", r["kind"], r["series"], _si(r["series_job"]), f"{r['scrape_kb']:.1f}",
                f"{r['otlp_cpu_ms']:.2f}", f"{r['otlp_kb']:.2f}", f"{r['otlp_mb_s_10']:.1f}",
                f"{r['collector_us']:.1f}", f"{r['collector_s_per_step']:.2f}"]
        if not args.no_clickhouse:
            line += [f"{r['query_s']:.1f}", f"{r['typed_query_s']:.1f}", _si(r["ranks"] * steps / r["typed_query_s"])]
        rows.append(line)
    print(wl.fmt_table(headers, rows))
    print("\n'1 collector s/step' is what one steptrace collector spends joining one step of N ranks "
          "(trace-id routing sends a whole step to one instance): above 1 s, a 1 step/s job outruns it.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "per_kind": per_kind, "results": results}, f, indent=1)
    return 0 if all(math.isfinite(r["otlp_cpu_ms"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
