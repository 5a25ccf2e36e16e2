"""``steptrace monitoring export DIR``: the monitoring files shipped in the package, ready to mount.

The dashboards, Prometheus config, recording and alerting rules, Alertmanager config, Grafana
provisioning and OpenTelemetry Collector config are package data of ``steptrace.collector``, so
``pip install steptrace`` gives them without cloning the repository. Only the standard library
is used: the command works in an environment without any of steptrace's extras.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

__all__ = ["FILES", "add_monitoring_arguments", "export", "run_monitoring"]

#: Where each file goes under DIR -> the packaged file (relative to ``steptrace.collector``).
FILES = {
    "prometheus/prometheus.yml": "prometheus.yml",
    "prometheus/rules.yml": "rules.yml",
    "prometheus/alerts.yml": "alerts.yml",
    "alertmanager/alertmanager.yml": "alertmanager.yml",
    "grafana/provisioning/datasources/steptrace.yaml": "dashboards/provisioning/datasources.yaml",
    "grafana/provisioning/dashboards/steptrace.yaml": "dashboards/provisioning/dashboards.yaml",
    "grafana/dashboards/steptrace-training.json": "dashboards/steptrace-training.json",
    "grafana/dashboards/steptrace-cluster.json": "dashboards/steptrace-cluster.json",
    "grafana/dashboards/steptrace-clickhouse.json": "dashboards/steptrace-clickhouse.json",
    "grafana/dashboards/steptrace-clickhouse-typed.json": "dashboards/steptrace-clickhouse-typed.json",
    # Not under grafana/provisioning/: it needs the ClickHouse plugin, so it is copied in by choice.
    "grafana/clickhouse/datasources/steptrace-clickhouse.yaml": "dashboards/provisioning/datasources-clickhouse.yaml",
    "otelcol/otelcol.yaml": "otelcol.yaml",
    "otelcol/otelcol-clickhouse.yaml": "otelcol-clickhouse.yaml",
}

DESCRIPTION = ("Write steptrace's monitoring files under DIR, ready to mount: prometheus/ (prometheus.yml, "
               "rules.yml, alerts.yml: promtool check config DIR/prometheus/prometheus.yml), alertmanager/, "
               "grafana/provisioning/ (mount at /etc/grafana/provisioning), grafana/dashboards/ (mount at "
               "/var/lib/grafana/dashboards/steptrace), grafana/clickhouse/ (the ClickHouse data source, to add "
               "to provisioning/datasources/ with the grafana-clickhouse-datasource plugin) and otelcol/ "
               "(otelcol.yaml: to steptrace collectors; otelcol-clickhouse.yaml: to ClickHouse).")

_RUNBOOK = re.compile(r'runbook_url: "docs/alerts\.md(#[a-z]+)"')


def export(directory: str | Path, *, force: bool = False, runbook_url: str | None = None) -> list[Path]:
    """Write every file of :data:`FILES` under ``directory``; returns the paths written.

    Existing files are kept (``FileExistsError`` naming them) unless ``force``. ``runbook_url``
    (the URL where your copy of docs/alerts.md is published) replaces the relative
    ``docs/alerts.md`` of each alert's ``runbook_url``.
    """
    root = Path(directory)
    targets = [root / relative for relative in FILES]
    existing = [str(path) for path in targets if path.exists()]
    if existing and not force:
        raise FileExistsError(f"already there (use --force to overwrite): {', '.join(existing)}")
    package = resources.files("steptrace.collector")
    for target, source in zip(targets, FILES.values()):
        text = package.joinpath(source).read_text(encoding="utf-8")
        if runbook_url is not None and source == "alerts.yml":
            text = _RUNBOOK.sub(lambda m: f'runbook_url: "{runbook_url}{m[1]}"', text)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return targets


def add_monitoring_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="monitoring_command", required=True, metavar="ACTION")
    export_parser = commands.add_parser("export", help="write the dashboards, rules, alerts and configs to DIR",
                                        description=DESCRIPTION)
    export_parser.add_argument("directory", metavar="DIR", help="where to write (created if missing)")
    export_parser.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    export_parser.add_argument("--runbook-url", metavar="URL",
                               help="where your copy of docs/alerts.md is published: each alert's runbook_url "
                                    "becomes URL#<alert> (default: the relative docs/alerts.md#<alert>)")


def run_monitoring(args: argparse.Namespace) -> int:
    try:
        written = export(args.directory, force=args.force, runbook_url=args.runbook_url)
    except (OSError, ValueError) as exc:
        print(f"steptrace monitoring export: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
