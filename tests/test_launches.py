"""One run per launch unless the user or the launcher says otherwise (issue 33, item 4).

torchrun's ``--rdzv-id`` defaults to ``none``: with the static rendezvous (``--master-port``, or several
nodes) every worker of every launch gets ``TORCHELASTIC_RUN_ID=none``, and steptrace used to file a
second, unrelated launch as a restart of the first (wasted steps, downtime, a job goodput of 1.6 %).
The unit tests give ``resolve_config`` the environment torchrun's agent gives its workers
(torch/distributed/elastic/agent/server/local_elastic_agent.py ``_start_workers`` and
multiprocessing/api.py ``DefaultLogsSpecs.reify``); the integration tests run torchrun itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import steptrace
from steptrace import SteptraceWarning, _config
from steptrace._attempts import PLACEHOLDER_RUN_IDS, launch_run_id, settle_attempt, settle_run_id
from steptrace._config import resolve_config
from steptrace.analysis.goodput import job_accounting
from steptrace.analysis.runs import load_run

from conftest import have

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed_scripts" / "torchrun_steps.py"


def worker_env(agent_dir: str, *, rank: int = 0, restart: int = 0, run_id: str = "none", **extra: str) -> dict:
    """What torchrun's agent sets for a worker (torch 2.13): the run id, the restart count, and the
    error file under the agent's own log directory (``<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>``)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": "1",
            "TORCHELASTIC_ERROR_FILE": f"/tmp/torchelastic_x1/{agent_dir}/attempt_{restart}/{rank}/error.json",
            **extra}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_config, "_WARNED", set())


def test_a_placeholder_run_id_is_never_the_run_id_and_each_agent_names_its_own_launch():
    with pytest.warns(SteptraceWarning, match="torchrun without --rdzv-id") as caught:
        first = [resolve_config(worker_env("none_abc123", rank=r)) for r in (0, 1)]
    assert len(caught) == 1  # once per process, not once per init
    assert first[0].run_id == first[1].run_id != "none"  # the ranks of one launch agree without talking
    assert first[0].run_id.startswith("torchrun-") and first[0].run_id_source == "torchelastic_agent"
    # The agent's restart: the same run, the next attempt, as the launcher says.
    restarted = resolve_config(worker_env("none_abc123", rank=1, restart=1))
    assert restarted.run_id == first[0].run_id
    assert (restarted.attempt, restarted.attempt_source) == (1, "launcher:TORCHELASTIC_RESTART_COUNT")
    # Another launch (another agent, even on the same master port): another run.
    with pytest.warns(SteptraceWarning):
        second = resolve_config(worker_env("none_def456"))
    assert second.run_id != first[0].run_id
    for placeholder in ("NONE", "", " none "):
        with pytest.warns(SteptraceWarning, match=repr(placeholder)):
            assert resolve_config(worker_env("none_abc123", run_id=placeholder)).run_id == first[0].run_id
    assert {"", "none"} <= PLACEHOLDER_RUN_IDS


def test_a_named_run_is_kept_from_code_env_or_the_launcher_and_says_where_it_came_from():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        assert (resolve_config(worker_env("a_1", run_id="job-7")).run_id,
                resolve_config(worker_env("a_1", run_id="job-7")).run_id_source) == (
            "job-7", "launcher:TORCHELASTIC_RUN_ID")
        env = worker_env("a_1", STEPTRACE_RUN_ID="mine")
        assert (resolve_config(env).run_id, resolve_config(env).run_id_source) == ("mine", "env")
        assert (resolve_config(env, run_id="code").run_id, resolve_config(env, run_id="code").run_id_source) == (
            "code", "code")
        # srun: every task of a job step, on every node, has the same job and step ids; a requeued job
        # keeps them and counts SLURM_RESTART_COUNT: an attempt of the same run.
        slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "RANK": "3", "WORLD_SIZE": "8"}
        assert (resolve_config(slurm).run_id, resolve_config(slurm).run_id_source) == (
            "slurm-4242.0", "launcher:SLURM_JOB_ID")
        requeued = resolve_config({**slurm, "SLURM_RESTART_COUNT": "1"})
        assert (requeued.run_id, requeued.attempt) == ("slurm-4242.0", 1)
        # A batch script without srun has no step id: nothing shared to derive from.
        assert launch_run_id({"SLURM_JOB_ID": "4242"}) is None
    with pytest.raises(ValueError, match="run_id_source"):
        resolve_config({}, run_id_source="code")


def test_several_nodes_of_a_placeholder_launch_are_told_to_name_the_run():
    with pytest.warns(SteptraceWarning, match="Ranks on other nodes have other agents"):
        resolve_config(worker_env("none_n1", GROUP_WORLD_SIZE="2", WORLD_SIZE="4"))


def test_without_the_agents_log_directory_the_parent_process_names_the_launch(monkeypatch):
    env = worker_env("x")
    env["TORCHELASTIC_ERROR_FILE"] = ""  # torchrun --log-dir /dev/null
    with pytest.warns(SteptraceWarning) as caught:
        config = resolve_config(env)
    assert config.run_id in str(caught[0].message)
    # This process's parent stands for the agent: its pid and start time.
    assert config.run_id_source == "torchelastic_agent"
    assert resolve_config(env).run_id == config.run_id
    monkeypatch.setattr(os, "getppid", lambda: 1)
    with pytest.warns(SteptraceWarning):
        assert resolve_config(env).run_id != config.run_id


def test_a_derived_id_that_an_earlier_launch_recorded_is_a_new_run_unless_the_launcher_says_restart(tmp_path):
    """Two programs in one interactive ``srun --pty bash`` step share the SLURM ids: the second is a
    run of its own (``-1``), and each rank finds the same suffix in its own attempts file."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "WORLD_SIZE": "2"}
    run_dir = str(tmp_path)
    first = resolve_config(slurm, run_dir=run_dir)
    assert settle_run_id(first) == (first, None)  # nothing recorded yet
    (tmp_path / "slurm-77.0").mkdir()
    for rank in (0, 1):
        (tmp_path / "slurm-77.0" / f"rank-{rank}.attempts").write_text('{"attempt": 0}\n')
    for rank in (0, 1):
        settled, warning = settle_run_id(resolve_config({**slurm, "RANK": str(rank)}, run_dir=run_dir))
        assert settled.run_id == "slurm-77.0-1" and "already recorded" in warning
        assert settle_attempt(settled).attempt == 0
    # A requeue (the launcher's restart count) is the same run's next attempt.
    requeued, warning = settle_run_id(resolve_config({**slurm, "SLURM_RESTART_COUNT": "1"}, run_dir=run_dir))
    assert (requeued.run_id, warning, settle_attempt(requeued).attempt) == ("slurm-77.0", None, 1)
    # A run id the user gave is theirs to resume: the next attempt of it, never renamed.
    named, warning = settle_run_id(resolve_config({"STEPTRACE_RUN_ID": "slurm-77.0"}, run_dir=run_dir))
    assert (named.run_id, warning, settle_attempt(named).attempt) == ("slurm-77.0", None, 1)


def test_two_launches_under_a_placeholder_id_are_two_runs_end_to_end(tmp_path, monkeypatch):
    """In process, as the workers of two torchrun launches would: each run records one attempt."""
    for agent in ("none_first", "none_second"):
        for key, value in worker_env(agent, rank=0).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("WORLD_SIZE", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SteptraceWarning)
            steptrace.init(run_dir=str(tmp_path), backend="host")
        for n in range(3):
            with steptrace.step(n):
                pass
        steptrace.shutdown()
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 2 and all(p.name.startswith("torchrun-") for p in runs)
    for path in runs:
        records = load_run(path).records_by_rank[0]
        attempts = [r for r in records if r["type"] == "attempt"]
        assert [(a["attempt"], a["run_id_source"]) for a in attempts] == [(0, "torchelastic_agent")]
        job = job_accounting(records)
        assert (len(job["attempts"]), job["badput"]["wasted"], job["badput"]["downtime"]) == (1, 0.0, 0.0)


# -- torchrun itself ----------------------------------------------------------------------------------
needs_torch = pytest.mark.skipif(not have("torch"), reason="needs torch (pip install 'steptrace[torch]')")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(run_dir: Path, *launcher: str, script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 LAUNCHER... torchrun_steps.py RUN_DIR``, with no run id anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPTRACE_", "TORCHELASTIC_", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *launcher,
                             str(SCRIPT), str(run_dir), *script_args], capture_output=True, text=True, timeout=240,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _runs(run_dir: Path) -> list[Path]:
    return sorted((p for p in run_dir.iterdir() if p.is_dir()), key=lambda p: (p / "rank-0.jsonl").stat().st_mtime)


@pytest.mark.integration
@needs_torch
@pytest.mark.parametrize("launcher", ["--standalone", "plain", "--master-port"])
def test_two_torchrun_launches_without_a_run_id_are_two_runs(tmp_path, launcher):
    """``--standalone`` and plain one-node torchrun name each launch with a fresh uuid; with
    ``--master-port`` (the static rendezvous, as on several nodes) every launch is ``none``, which
    steptrace replaces with the agent's identity. Either way the second launch is a run of its own:
    one attempt, nothing wasted, no downtime."""
    run_dir = tmp_path / "runs"
    args = {"--standalone": ("--standalone",), "plain": (), "--master-port": ("--master-port", str(_free_port()))}
    torchrun(run_dir, *args[launcher])
    second = torchrun(run_dir, *args[launcher])
    runs = _runs(run_dir)
    assert len(runs) == 2, runs
    if launcher == "--master-port":
        assert all(p.name.startswith("torchrun-") for p in runs)
        assert second.stderr.count("torchrun without --rdzv-id") == 2  # once on each rank
    for rank in (0, 1):
        records = load_run(runs[1]).records_by_rank[rank]
        assert [(a["attempt"], a["attempt_source"]) for a in records if a["type"] == "attempt"] == [
            (0, "launcher:TORCHELASTIC_RESTART_COUNT")]
        job = job_accounting(records)
        assert len(job["attempts"]) == 1 and job["kept_steps"] == 6
        assert (job["badput"]["wasted"], job["badput"]["downtime"], job["wasted_steps"]) == (0.0, 0.0, 0)


@pytest.mark.integration
@needs_torch
@pytest.mark.parametrize("launcher", ["--standalone", "--rdzv-endpoint"])
def test_a_worker_that_torchrun_restarts_is_the_next_attempt_of_the_same_run(tmp_path, launcher):
    """``--max-restarts 1`` and rank 1 failing at step 3 of the first start: torchrun restarts both
    workers (``TORCHELASTIC_RESTART_COUNT=1``); one run, two attempts on each rank. With a c10d
    rendezvous at a given endpoint and no ``--rdzv-id``, the run id is ``none`` and steptrace's comes
    from the agent. (The static rendezvous, ``--master-port``, cannot restart gloo workers in torch
    2.13: the restarted ranks time out connecting to each other.)"""
    run_dir = tmp_path / "runs"
    args = ("--standalone",) if launcher == "--standalone" else (
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}")
    torchrun(run_dir, *args, "--max-restarts", "1", script_args=("--fail-rank", "1", "--fail-step", "3"))
    (run,) = _runs(run_dir)
    assert run.name.startswith("torchrun-") == (launcher == "--rdzv-endpoint")
    for rank in (0, 1):
        records = load_run(run).records_by_rank[rank]
        assert [(a["attempt"], a["attempt_source"]) for a in records if a["type"] == "attempt"] == [
            (0, "launcher:TORCHELASTIC_RESTART_COUNT"), (1, "launcher:TORCHELASTIC_RESTART_COUNT")]
        job = job_accounting(records)
        assert len(job["attempts"]) == 2 and job["attempts"][1]["status"] == "clean"
        assert [r["step"] for r in load_run(run).steps(rank)] == list(range(6))
