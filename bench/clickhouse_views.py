"""How long the per-step cross-rank view takes in chDB (embedded ClickHouse) over STEPS × RANKS spans.

Usage::

    .venv/bin/python bench/clickhouse_views.py                        # 1,000 steps × 4,096 ranks
    .venv/bin/python bench/clickhouse_views.py --steps 200 --ranks 1024 --json out.json

Rows go straight into the contrib ClickHouse exporter's ``otel_traces`` schema
(``steptrace.analysis.clickhouse.OTEL_TRACES_DDL``) with one ``INSERT ... SELECT FROM numbers()``:
one ``train.step`` row per rank and step with the attributes steptrace's exporter writes
(run id, rank, step, world size, attempt, status, compute/interval/idle seconds, the wait in
collectives, a bubble ratio), as strings as the exporter stores them. Rank 7 computes 0.45 s, the others ~0.30 s
every step, so the straggler rule has work to do. Then the per-step view (``cluster_steps_sql``,
what ``steptrace clickhouse views`` installs) runs over the run twice: on the exporter's table
(string maps parsed per query) and on the typed table (``steptrace clickhouse views --typed``,
filled here by its backfill ``INSERT``, timed). The best of ``--repeat`` runs is printed, with the
insert times. Exit 1 unless every step names rank 7. Needs ``pip install chdb``.
"""

from __future__ import annotations

import argparse
import json
import time

from steptrace.analysis import clickhouse as ch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", default=None)
    args = parser.parse_args()
    client = ch.connect("chdb://?database=bench_views")
    client.command(ch.otel_traces_ddl("bench_views"))
    client.command("TRUNCATE TABLE bench_views.otel_traces")
    rows = args.steps * args.ranks
    started = time.perf_counter()
    client.command(f"""
INSERT INTO bench_views.otel_traces (Timestamp, TraceId, SpanId, SpanName, SpanKind, ServiceName, ScopeName,
                                     SpanAttributes, Duration, StatusCode)
SELECT
    toDateTime64(1700000000 + step * 0.5, 9) AS Timestamp,
    hex(cityHash64('bench', step)) AS TraceId,
    hex(cityHash64('bench', step, rank)) AS SpanId,
    'train.step', 'Internal', 'steptrace', 'steptrace',
    map('train.run_id', 'bench', 'train.rank', toString(rank), 'train.step', toString(step),
        'train.world_size', '{args.ranks}', 'train.attempt', '0', 'train.status', 'ok',
        'train.compute_seconds', toString(compute), 'train.interval_seconds', '0.5',
        'train.idle_seconds', toString(0.5 - compute), 'train.collective_wait_seconds', toString(0.5 - compute),
        'train.pipeline.bubble_ratio.0', '0.125') AS SpanAttributes,
    500000000 AS Duration, 'Unset'
FROM (
    SELECT intDiv(number, {args.ranks}) AS step, number % {args.ranks} AS rank,
           if(rank = 7, 0.45, 0.3 + (cityHash64(number) % 1000) / 1e6) AS compute
    FROM numbers({rows})
)""")
    insert_s = time.perf_counter() - started
    create_table, _, backfill = ch.typed_table_sql("bench_views")
    client.command(f"DROP TABLE IF EXISTS bench_views.{ch.TYPED_TABLE}")
    client.command(create_table)
    started = time.perf_counter()
    client.command(backfill)  # what the materialized view does as the exporter inserts
    typed_s = time.perf_counter() - started
    out: dict = {"steps": args.steps, "ranks": args.ranks, "rows": rows, "insert_seconds": round(insert_s, 3),
                 "typed_copy_seconds": round(typed_s, 3)}
    ok = True
    for label, typed_table in (("view", None), ("typed_view", ch.TYPED_TABLE)):
        times = []
        result: list[dict] = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = ch.cluster_steps(client, "bench", typed_table=typed_table)
            times.append(time.perf_counter() - started)
        named = sum(1 for r in result if r["straggler_rank"] == 7)
        ok = ok and len(result) == args.steps and named == args.steps
        out[f"{label}_seconds_best"] = round(min(times), 3)
        out[f"{label}_seconds_all"] = [round(t, 3) for t in times]
        out[f"{label}_steps_naming_rank_7"] = named
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
