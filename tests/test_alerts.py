"""The alerting rules (collector/alerts.yml): their shape, their runbooks, and their promtool unit tests.

``promtool test rules tests/alerts/alerts_test.yml`` evaluates every alert on synthetic series
(with collector/rules.yml, which several alerts read); this file runs it and checks that every
alert is tested both firing and not firing. The end-to-end test with a real Prometheus and
Alertmanager is tests/test_alerts_e2e.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="reading the rules needs PyYAML (installed with steptrace[test])")

REPO = Path(__file__).resolve().parents[1]
ALERTS_YML = REPO / "collector" / "alerts.yml"
ALERTS_TEST = REPO / "tests" / "alerts" / "alerts_test.yml"
ALERTS_MD = REPO / "docs" / "alerts.md"

ALERT_NAMES = {
    "SteptraceJobStalled", "SteptraceRankSilent", "SteptraceStraggler", "SteptraceGoodputLow",
    "SteptraceStepTimeRegression", "SteptraceCheckpointStall", "SteptraceRestartLoop", "SteptraceTelemetryLoss",
    "SteptraceStragglerGpu",
}
# Alerts about one rank name it; the others are about a whole run.
RANK_ALERTS = {"SteptraceJobStalled", "SteptraceRankSilent", "SteptraceStraggler", "SteptraceTelemetryLoss",
               "SteptraceStragglerGpu"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS_YML.read_text())["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def parameters() -> dict[str, float]:
    """The thresholds: constant series steptrace:alert_* = vector(value)."""
    found = {}
    for rule in rules():
        if rule.get("record", "").startswith("steptrace:alert_"):
            match = re.fullmatch(r"vector\(([0-9.]+)\)", rule["expr"].strip())
            assert match, rule
            found[rule["record"]] = float(match[1])
    return found


def test_the_alerts_are_the_documented_set():
    assert set(alerts()) == ALERT_NAMES


@pytest.mark.parametrize("name", sorted(ALERT_NAMES))
def test_every_alert_has_for_severity_summary_description_and_a_runbook(name):
    rule = alerts()[name]
    assert "for" in rule, name
    assert rule["labels"]["severity"] in ("critical", "warning")
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    for text in (annotations["summary"], annotations["description"]):
        assert "{{ $labels.run_id }}" in text
        if name in RANK_ALERTS:
            assert "{{ $labels.rank }}" in text
    assert annotations["runbook_url"] == f"docs/alerts.md#{name.lower()}"


@pytest.mark.parametrize("name", sorted(ALERT_NAMES))
def test_every_runbook_anchor_is_a_section_of_docs_alerts_md(name):
    """GitHub's anchor of a heading `## SteptraceJobStalled` is #steptracejobstalled."""
    headings = re.findall(r"^## (\w+)$", ALERTS_MD.read_text(), flags=re.M)
    assert name in headings
    section = ALERTS_MD.read_text().split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
    # Each runbook says what the alert means and lists the first three things to check.
    assert re.search(r"^1\. .+^2\. .+^3\. ", section, flags=re.M | re.S), name


def test_every_threshold_parameter_is_read_and_documented_with_its_default():
    text = ALERTS_YML.read_text()
    doc = ALERTS_MD.read_text()
    params = parameters()
    assert len(params) >= 6
    for name, default in params.items():
        assert f"scalar({name})" in text, f"{name} is never read"
        assert re.search(rf"\| `{re.escape(name)}` \| `?{default:g}`? \|", doc), f"{name} = {default:g} in docs"


def test_every_alert_is_unit_tested_firing_and_not_firing():
    fired, quiet = set(), set()
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fired == ALERT_NAMES, ALERT_NAMES - fired
    assert quiet == ALERT_NAMES, ALERT_NAMES - quiet


def test_the_unit_tests_load_the_shipped_rule_files():
    files = yaml.safe_load(ALERTS_TEST.read_text())["rule_files"]
    assert {(ALERTS_TEST.parent / f).resolve() for f in files} == {
        ALERTS_YML.resolve(), (REPO / "collector" / "rules.yml").resolve()}


@pytest.fixture
def promtool():
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    return binary


def test_promtool_checks_the_alerting_rules(promtool):
    result = subprocess.run([promtool, "check", "rules", str(ALERTS_YML)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_every_alert_pass(promtool):
    result = subprocess.run([promtool, "test", "rules", ALERTS_TEST.name], capture_output=True, text=True,
                            timeout=120, cwd=ALERTS_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


def test_the_unit_tests_fail_when_an_alert_threshold_changes(promtool, tmp_path):
    """The promtool tests can fail: a stall factor of 100 (threshold 1000 s) keeps the hung rank quiet."""
    (tmp_path / "collector").mkdir()
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "collector" / "rules.yml", tmp_path / "collector" / "rules.yml")
    text = ALERTS_YML.read_text()
    old = "- record: steptrace:alert_stall_factor\n        expr: vector(10)"
    assert old in text
    (tmp_path / "collector" / "alerts.yml").write_text(text.replace(old, old.replace("10", "100")))
    test_file = tmp_path / "tests" / "alerts_test.yml"
    test_file.write_text(ALERTS_TEST.read_text().replace("../../collector/", "../collector/"))
    result = subprocess.run([promtool, "test", "rules", test_file.name], capture_output=True, text=True,
                            timeout=120, cwd=test_file.parent)
    assert result.returncode != 0
    assert "alertname: SteptraceJobStalled" in result.stdout + result.stderr


def served_metric_names() -> set[str]:
    """Every series name a rank's /metrics and a steptrace collector's /metrics serve."""
    pytest.importorskip("prometheus_client", reason="the exporters need `pip install 'steptrace[prometheus]'`")
    from prometheus_client.parser import text_string_to_metric_families

    from steptrace.collector._metrics import ClusterMetrics
    from steptrace.prometheus import PrometheusSink

    sink = PrometheusSink(0, run_id="r", rank=0)
    try:
        sink.attach_position(lambda: (1, True, 1.0, None))
        sink.export([{"type": "step", "step": 0, "status": "ok", "interval_seconds": 1.0, "compute_seconds": 0.5,
                      "idle_breakdown": {"data": 0.5}, "collective_wait_seconds": 0.2, "own_seconds": 0.8},
                     {"type": "checkpoint", "step": 0, "status": "ok", "blocking_seconds": 1.0}])
        with urllib.request.urlopen(sink.endpoint, timeout=5) as response:
            text = response.read().decode()
    finally:
        sink.shutdown(1)
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    for family in ClusterMetrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def test_every_series_an_alert_reads_is_served_or_recorded():
    """Catches a renamed metric or recording rule that would leave an alert silently empty."""
    from test_dashboards import PROMQL_WORDS, metric_names

    recorded = {rule["record"] for path in (ALERTS_YML, REPO / "collector" / "rules.yml")
                for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]
                if "record" in rule}
    defined = served_metric_names() | recorded | {"up"}
    words = PROMQL_WORDS | {"quantile_over_time"}
    for rule in rules():
        read = metric_names(rule["expr"]) - words
        assert read <= defined, (rule.get("alert") or rule.get("record"), read - defined)
