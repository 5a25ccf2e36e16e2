"""End to end: a real Prometheus and a real Alertmanager watch three 4-rank runs; alerts reach a webhook.

Twelve rank processes (tests/alert_rank.py, steptrace with its Prometheus exporter) run three
runs at once: in ``hang`` rank 2 enters a ``data`` span inside step 20 that never ends; in
``slow`` rank 1 takes 3x as long per step; ``healthy`` is healthy. Prometheus (Debian package
``prometheus``) scrapes them with collector/rules.yml and collector/alerts.yml, shortened only
where the test needs seconds instead of minutes (every interval 1 s, every ``for:`` a few
seconds, the stall floor 2 s); Alertmanager (Debian package ``prometheus-alertmanager``) runs
collector/alertmanager.yml with its receiver pointed at a webhook in this test. Alertmanager
must deliver "job stalled" naming rank 2 of ``hang`` and its open span, and "straggler" naming
rank 1 of ``slow``; nothing about ``healthy``. The waits are bounded (``DEADLINE_S``), so the
whole test stays well under 2 minutes.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prometheus_server import PrometheusProcess, ServerProcess, free_port

yaml = pytest.importorskip("yaml", reason="reading the rules needs PyYAML (installed with steptrace[test])")
pytest.importorskip("prometheus_client", reason="the ranks' exporter needs `pip install 'steptrace[prometheus]'`")

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
COLLECTOR = REPO / "collector"
RANK_SCRIPT = Path(__file__).resolve().parent / "alert_rank.py"

WORLD_SIZE = 4
STEP_SECONDS = 0.05
RUNS = {"hang": {2: "hang"}, "slow": {1: "slow"}, "healthy": {}}  # run -> {rank: behaviour}
#: Every wait of the test together stays under this (the issue: delivery within 2 minutes).
DEADLINE_S = 75.0
#: The shortened `for:` of each alert (the shipped ones are minutes).
SHORT_FOR = {"SteptraceJobStalled": "2s", "SteptraceStraggler": "3s"}


def find_binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return ""


class Webhook:
    """An Alertmanager webhook receiver on 127.0.0.1: keeps every alert of every notification."""

    def __init__(self):
        self.notifications: list[dict] = []
        self._lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with received._lock:
                    received.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/steptrace"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def firing(self) -> list[dict]:
        with self._lock:
            return [a for n in self.notifications for a in n["alerts"] if a["status"] == "firing"]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def shortened_rule_files(tmp_path: Path) -> list[str]:
    """rules.yml and alerts.yml as shipped, with seconds where they say minutes."""
    rules = yaml.safe_load((COLLECTOR / "rules.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    alerts = yaml.safe_load((COLLECTOR / "alerts.yml").read_text())
    seen = set()
    for group in alerts["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = SHORT_FOR.get(rule["alert"], "3s")
                seen.add(rule["alert"])
            elif rule["record"] == "steptrace:alert_stall_min_seconds":
                rule["expr"] = "vector(2)"
    assert set(SHORT_FOR) <= seen
    paths = []
    for name, content in (("rules.yml", rules), ("alerts.yml", alerts)):
        (tmp_path / name).write_text(yaml.safe_dump(content, sort_keys=False))
        paths.append(str(tmp_path / name))
    return paths


class Alertmanager(ServerProcess):
    def __init__(self, binary: str, webhook_url: str, tmp_path: Path):
        config = yaml.safe_load((COLLECTOR / "alertmanager.yml").read_text())
        config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        (receiver,) = config["receivers"]
        receiver["webhook_configs"][0]["url"] = webhook_url
        path = tmp_path / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        super().__init__([binary, f"--config.file={path}", f"--storage.path={tmp_path / 'am-data'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                         tmp_path, "alertmanager", port)


def start_ranks(procs: list[subprocess.Popen], deadline: float) -> dict[str, str]:
    """Start every rank of every run (into ``procs``, which the caller stops); {host:port: "run/rank"}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    names = []
    for run_id, behaviours in RUNS.items():
        for rank in range(WORLD_SIZE):
            procs.append(subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT), run_id, str(rank), str(WORLD_SIZE), behaviours.get(rank, "ok"),
                 str(STEP_SECONDS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                env=env, text=True))
            names.append(f"{run_id}/{rank}")
    targets = {}
    for proc, name in zip(procs, names):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("http://"):
            raise RuntimeError(f"rank {name} did not start (exit code {proc.poll()})")
        targets[line.strip().split("//", 1)[1].split("/", 1)[0]] = name
    return targets


def test_a_hung_rank_and_a_straggler_reach_the_webhook_and_a_healthy_run_sends_nothing(tmp_path):
    prometheus = find_binary("prometheus")
    alertmanager = find_binary("prometheus-alertmanager", "alertmanager")
    if not prometheus or not alertmanager:
        pytest.skip("needs the Prometheus server and Alertmanager (Debian packages `prometheus` and "
                    "`prometheus-alertmanager`; .ci/run installs both)")
    started = time.monotonic()
    deadline = started + DEADLINE_S
    webhook = Webhook()
    am = server = None
    procs: list[subprocess.Popen] = []
    try:
        am = Alertmanager(alertmanager, webhook.url, tmp_path)
        assert am.wait_ready(20), am.log_tail()
        targets = start_ranks(procs, deadline)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": shortened_rule_files(tmp_path),
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]},
            "scrape_configs": [{"job_name": "steptrace", "static_configs": [{"targets": sorted(targets)}]}],
        }
        server = PrometheusProcess(prometheus, yaml.safe_dump(config, sort_keys=False), tmp_path)
        assert server.wait_ready(20), server.log_tail()

        def delivered(alertname: str, run_id: str) -> list[dict]:
            return [a for a in webhook.firing()
                    if a["labels"]["alertname"] == alertname and a["labels"]["run_id"] == run_id]

        while time.monotonic() < deadline:
            if delivered("SteptraceJobStalled", "hang") and delivered("SteptraceStraggler", "slow"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"not delivered within {DEADLINE_S} s; webhook got {webhook.firing()}; "
                        f"Prometheus alerts: {server.api('/api/v1/alerts')}\n{server.log_tail()}\n{am.log_tail()}")

        # The hung rank, where it hangs, and no other rank of that run.
        stalled = delivered("SteptraceJobStalled", "hang")
        assert {(a["labels"]["rank"], a["labels"]["span"]) for a in stalled} == {("2", "data")}
        assert stalled[0]["labels"]["severity"] == "critical"
        assert "Rank 2 of run hang" in stalled[0]["annotations"]["description"]
        assert 'in span "data"' in stalled[0]["annotations"]["description"]
        assert stalled[0]["annotations"]["runbook_url"] == "docs/alerts.md#steptracejobstalled"
        # The slowed rank, and only it.
        assert {a["labels"]["rank"] for a in delivered("SteptraceStraggler", "slow")} == {"1"}
        # Nothing about the healthy run: neither delivered nor firing in Prometheus.
        assert not [a for a in webhook.firing() if a["labels"].get("run_id") == "healthy"], webhook.firing()
        firing = server.api("/api/v1/alerts")["data"]["alerts"]
        assert not [a for a in firing if a["labels"].get("run_id") == "healthy" and a["state"] == "firing"]
        assert time.monotonic() - started < 120
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)
            proc.stdout.close()
        if server is not None:
            server.stop()
        if am is not None:
            am.stop()
        webhook.close()
