"""``steptrace monitoring export DIR``: the monitoring files ship in the wheel and come out ready to mount.

A wheel built from this repository is installed into a fresh virtualenv with ``--no-deps`` (the
command needs nothing beyond the standard library); every file must come out byte-equal to the
repository's and pass ``promtool check`` (Prometheus config, recording and alerting rules) and
``amtool check-config`` (Alertmanager) where those are installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from steptrace.collector._monitoring import FILES, export

REPO = Path(__file__).resolve().parents[1]
COLLECTOR = REPO / "collector"


def cli(*args, python=sys.executable, cwd=None):
    return subprocess.run([python, "-m", "steptrace", "monitoring", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_export_writes_every_shipped_file_as_in_the_repository(tmp_path):
    written = export(tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in written) == sorted(FILES)
    for relative, source in FILES.items():
        assert (tmp_path / "out" / relative).read_bytes() == (COLLECTOR / source).read_bytes(), relative


def test_the_shipped_files_are_every_monitoring_file_of_the_repository():
    """A new dashboard or config under collector/ must be added to FILES (and so to the wheel)."""
    in_repo = {p.relative_to(COLLECTOR).as_posix() for pattern in ("*.yml", "*.yaml", "dashboards/*.json",
                                                                   "dashboards/provisioning/*.yaml")
               for p in COLLECTOR.glob(pattern)}
    assert set(FILES.values()) == in_repo


def test_the_command_keeps_existing_files_unless_forced(tmp_path):
    out = tmp_path / "out"
    first = cli("export", str(out))
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.split()) == len(FILES)
    (out / "prometheus" / "alerts.yml").write_text("mine")
    again = cli("export", str(out))
    assert again.returncode == 2
    assert "already there" in again.stderr and "--force" in again.stderr
    assert (out / "prometheus" / "alerts.yml").read_text() == "mine"
    forced = cli("export", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "prometheus" / "alerts.yml").read_bytes() == (COLLECTOR / "alerts.yml").read_bytes()


def test_runbook_url_points_every_alert_at_the_published_runbooks(tmp_path):
    export(tmp_path, runbook_url="https://wiki.example/steptrace/alerts")
    text = (tmp_path / "prometheus" / "alerts.yml").read_text()
    assert "docs/alerts.md" not in text.replace("in docs/alerts.md", "")
    assert text.count('runbook_url: "https://wiki.example/steptrace/alerts#steptrace') == \
        (COLLECTOR / "alerts.yml").read_text().count("runbook_url:")


# -- as a user gets it: the wheel, in a fresh virtualenv ----------------------------------------------

_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "steptrace-runs")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, a fresh virtualenv's python with only that wheel installed, --no-deps)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)  # never write build/ into the working tree
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{built.stdout}\n{built.stderr}")
    (wheel,) = (tmp / "dist").glob("steptrace-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    python = tmp / "venv" / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    return wheel, python


def test_the_wheel_holds_every_monitoring_file(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {f"steptrace/collector/{source}" for source in FILES.values()} - names
    assert not missing


@pytest.fixture(scope="module")
def exported(installed, tmp_path_factory):
    _, python = installed
    out = tmp_path_factory.mktemp("exported") / "monitoring"
    # The console script, from outside the repository: only the installed wheel can answer.
    result = subprocess.run([str(python.parent / "steptrace"), "monitoring", "export", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=out.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_every_file_comes_out_of_the_installed_wheel(exported):
    for relative, source in FILES.items():
        assert (exported / relative).read_bytes() == (COLLECTOR / source).read_bytes(), relative
    for dashboard in (exported / "grafana" / "dashboards").glob("*.json"):
        assert json.loads(dashboard.read_text())["uid"]


def test_the_exported_prometheus_config_and_rules_pass_promtool(exported):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    config = subprocess.run([promtool, "check", "config", str(exported / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stdout + config.stderr
    # check config loads every rule file it names: both must be found beside it and pass.
    assert "SUCCESS: 2 rule files found" in config.stdout
    rules = subprocess.run([promtool, "check", "rules", str(exported / "prometheus" / "rules.yml"),
                            str(exported / "prometheus" / "alerts.yml")], capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_the_exported_alertmanager_config_passes_amtool(exported):
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (Debian package `prometheus-alertmanager`; .ci/run installs it)")
    result = subprocess.run([amtool, "check-config", str(exported / "alertmanager" / "alertmanager.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
