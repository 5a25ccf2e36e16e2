"""The ``steptrace`` command: ``steptrace report RUN_DIR``, ``steptrace timeline RUN_DIR -o trace.json``,
``steptrace compare RUN_A RUN_B``, ``steptrace collector --world-size N --run-dir DIR``,
``steptrace monitoring export DIR``, ``steptrace clickhouse views``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from steptrace import report, timeline
    from steptrace.analysis import compare
    from steptrace._version import __version__

    parser = argparse.ArgumentParser(prog="steptrace", description="steptrace: device-true training step timings.")
    parser.add_argument("--version", action="version", version=f"steptrace {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report_parser = commands.add_parser("report", help="per-step table and summary of a run directory",
                                        description="Per-step table and summary of a run directory.")
    report.add_report_arguments(report_parser)
    report_parser.set_defaults(handler=report.run_report)
    timeline_parser = commands.add_parser("timeline", help="all ranks as a Chrome/Perfetto trace (and a PNG)",
                                          description="Write all ranks' steps, spans, checkpoints and microbatches "
                                                      "as a Chrome/Perfetto trace (Trace Event Format JSON) and/or "
                                                      "a PNG timeline.")
    timeline.add_timeline_arguments(timeline_parser)
    timeline_parser.set_defaults(handler=timeline.run_timeline)
    compare_parser = commands.add_parser("compare", help="two runs side by side, with a verdict on noise",
                                         description="Compare two runs (A, the baseline, and B): steady-state "
                                                     "step times, throughput, idle, checkpoints, memory, with "
                                                     "a noise test per metric that respects drift within a run.")
    compare.add_compare_arguments(compare_parser)
    compare_parser.set_defaults(handler=compare.run_compare)
    # Only argparse until it runs: the collector's dependencies load in run_collector.
    from steptrace.collector import _cli as collector_cli

    collector_parser = commands.add_parser("collector", help="receive OTLP from all ranks and join each step "
                                                             "across ranks (skew, straggler, bubble)",
                                           description=collector_cli.DESCRIPTION)
    collector_cli.add_collector_arguments(collector_parser)
    collector_parser.set_defaults(handler=collector_cli.run_collector)
    from steptrace.collector import _monitoring as monitoring

    monitoring_parser = commands.add_parser("monitoring", help="the dashboards, Prometheus rules and alerts, "
                                                               "Alertmanager, Grafana and otelcol configs",
                                            description=monitoring.DESCRIPTION)
    monitoring.add_monitoring_arguments(monitoring_parser)
    monitoring_parser.set_defaults(handler=monitoring.run_monitoring)
    from steptrace.analysis import clickhouse

    clickhouse_parser = commands.add_parser("clickhouse", help="the per-step cross-rank views as SQL over the "
                                                               "OpenTelemetry Collector's ClickHouse table",
                                            description=clickhouse.DESCRIPTION)
    clickhouse.add_clickhouse_arguments(clickhouse_parser)
    clickhouse_parser.set_defaults(handler=clickhouse.run_clickhouse)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
