"""What one refresh of the ClickHouse dashboard (collector/dashboards/steptrace-clickhouse.json) costs in chDB.

Usage::

    .venv/bin/python bench/bench_clickhouse_dashboard.py                      # 4,096 ranks x 200 steps
    .venv/bin/python bench/bench_clickhouse_dashboard.py --quick              # 1,024 ranks x 100 steps
    .venv/bin/python bench/bench_clickhouse_dashboard.py --ranks 16384 --steps 100 --json out.json

What is timed
-------------
``RANKS x STEPS`` ``train.step`` rows of one run are written into the exporter's ``otel_traces``
table (steptrace/analysis/clickhouse.py's DDL; the typed table of ``steptrace clickhouse views
--typed`` and its materialized view exist first) by one ``INSERT ... SELECT`` from ``numbers()``,
with the attributes a rank sends (run, rank, step, world size, compute, interval, collective wait,
a bubble per stage; rank 7 is slow, rank 3 misses step 5). Then every ClickHouse query of the
dashboard (both builds: over ``otel_traces``, over the typed table) runs as Grafana sends it
(variables substituted, the plugin's macros expanded, as tests/test_dashboards_clickhouse.py does;
a time bucket of STEPS/100 s), best of ``--rounds``.
**per refresh** is the sum over the dashboard's queries; **one query per panel** is what it would
be if every panel ran its source's query itself instead of sharing it ("-- Dashboard --").
chDB runs in this process, on this machine's cores: a ClickHouse server divides these times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_dashboards_clickhouse as dash  # noqa: E402  (the dashboard, and Grafana's expansion of its SQL)

from steptrace.analysis import clickhouse as ch  # noqa: E402


def load(client, ranks: int, steps: int) -> float:
    start = time.perf_counter()
    client.command(f"""
INSERT INTO otel_traces
    (Timestamp, TraceId, SpanId, SpanName, SpanKind, ServiceName, SpanAttributes, Duration, StatusCode)
SELECT fromUnixTimestamp64Nano(toInt64(({dash.T0} + step - 0.5) * 1e9)), hex(step), hex(number), 'train.step',
       'Internal', 'steptrace',
       map('train.run_id', 'r', 'train.rank', toString(rank), 'train.step', toString(step),
           'train.world_size', '{ranks}', 'train.attempt', '0',
           'train.compute_seconds', toString(if(rank = 7, 0.9, 0.5)), 'train.interval_seconds', '1',
           'train.collective_wait_seconds', toString(if(rank = 7, 0.05, 0.45)),
           'train.pipeline.bubble_ratio.' || toString(rank % 4), '0.1'),
       1000000000, 'Unset'
FROM (SELECT number, intDiv(number, {ranks}) AS step, number % {ranks} AS rank FROM numbers({ranks * steps}))
WHERE NOT (rank = 3 AND step = 5)""")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1,024 ranks x 100 steps, 1 round")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every number measured")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps, args.rounds = 1024, 100, 1

    client = ch.connect("chdb://?database=bench_dashboard")
    client.command(ch.otel_traces_ddl("bench_dashboard"))
    for statement in ch.typed_table_sql("bench_dashboard"):
        client.command(statement)
    inserted = load(client, args.ranks, args.steps)
    rows = client.query("SELECT count() AS n FROM otel_traces")[0]["n"]
    print(f"{args.ranks} ranks x {args.steps} steps: {rows:,} train.step rows inserted in {inserted:.2f} s")

    results = {}
    for name in dash.NAMES:
        dashboard = dash.load(name)
        print(name)
        seconds: dict[str, float] = {}
        for title, target in dash.targets(dashboard):
            sql = dash.as_sent(target["rawSql"], run="r", interval_s=max(1, args.steps // 100))
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                client.query(sql)
                best = min(best, time.perf_counter() - start)
            seconds[title] = best
            print(f"  {best:7.3f} s  {title}")
        per_panel = sum(seconds[dash.source_of(p, dashboard)["title"]] for p in dash.panels(dashboard))
        print(f"  per refresh: {len(seconds)} queries, {sum(seconds.values()):.2f} s; "
              f"one query per panel: {len(dash.panels(dashboard))} queries, {per_panel:.2f} s")
        results[name] = {"query_seconds": seconds, "refresh_seconds": sum(seconds.values()),
                         "one_query_per_panel_seconds": per_panel}
    if args.json:
        args.json.write_text(json.dumps({
            "ranks": args.ranks, "steps": args.steps, "rows": rows, "insert_seconds": inserted,
            "dashboards": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
