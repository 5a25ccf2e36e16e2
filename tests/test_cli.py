"""The ``steptrace`` command on a run recorded by the real SDK."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import steptrace
from steptrace.testing import SimulatedDevice


@pytest.fixture
def recorded_run(tmp_path):
    device = SimulatedDevice()
    steptrace.init(run_dir=str(tmp_path), run_id="cli")
    for n in range(5):
        with steptrace.step(n, tokens=1000, flops=1e9) as s:
            with steptrace.span("data"):
                time.sleep(0.002)
            s.wait_for(device.run(0.01))
        if n == 2:
            with steptrace.checkpoint(n):
                time.sleep(0.03)
    steptrace.shutdown()
    device.close()
    return tmp_path


def test_python_m_steptrace_report_summarises_a_real_run(recorded_run):
    out = subprocess.run([sys.executable, "-m", "steptrace", "report", str(recorded_run), "--json"],
                         capture_output=True, text=True, check=True).stdout
    summary = json.loads(out)
    assert summary["steps"] == 5 and summary["checkpoints"] == 1
    assert summary["checkpoint_blocking_seconds"] > 0
    assert "checkpoint" in summary["idle_breakdown_totals"]
    assert 0 < summary["goodput"] <= 1


def test_console_script_report_prints_tables(recorded_run):
    exe = shutil.which("steptrace", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the steptrace console script is not installed in this environment")
    out = subprocess.run([exe, "report", str(recorded_run / "cli")], capture_output=True, text=True,
                         check=True, env={**os.environ, "COLUMNS": "160"}).stdout
    assert "goodput" in out.lower() and "checkpoint" in out


def test_report_on_a_missing_directory_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "steptrace", "report", str(tmp_path / "nope")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert str(tmp_path / "nope") in result.stderr and "steptrace report:" in result.stderr
