"""The stall watch on NCCL (issue 27): a rank that never joins a collective, and the flight recorder's
view of it in the waiting rank's stall record. Needs two CUDA GPUs; skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch with CUDA")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (the NCCL flight-recorder stall check)", allow_module_level=True)
if not torch.distributed.is_nccl_available():
    pytest.skip("this torch build has no NCCL", allow_module_level=True)

from steptrace.analysis.hangs import job_view  # noqa: E402
from steptrace.analysis.runs import load_run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_joins_an_nccl_collective_is_named_and_the_recorder_shows_the_collective(tmp_path):
    script = Path(__file__).resolve().parent / "stall_nccl_job.py"
    env = {**os.environ, "STEPTRACE_STALL_MIN_S": "2", "STEPTRACE_STALL_FACTOR": "5",
           "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script),
                             str(run_dir)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    files = [run_dir / "nccl-hang" / f"rank-{r}.jsonl" for r in range(2)]

    def stalls() -> dict[int, dict]:
        found = {}
        for rank, f in enumerate(files):
            for line in (f.read_text().splitlines() if f.exists() else []):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("type") == "stall":
                    found[rank] = record
        return found

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(stalls()) < 2:
            time.sleep(0.2)
        found = stalls()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert sorted(found) == [0, 1], found
    collectives = found[0]["collectives"]
    assert collectives, "the waiting rank's record carries the flight recorder's entries"
    assert any("allreduce" in str(c.get("profiling_name", "")).lower() for c in collectives)
    view = job_view(load_run(run_dir / "nccl-hang"))
    assert view["cause_ranks"] == [1], view
