"""Attempts: each process start within a run, numbered so that every rank agrees without talking.

A job that restarts (a crash, a preemption, a clean save-exit-resume) starts new processes with the
same ``run_id``. Each start is an *attempt*; a step redone by a later attempt is a unit of its own
(its trace id includes the attempt, see ``_ids``), and the job-level accounting
(``steptrace.analysis.goodput``) charges the redone work as wasted progress.

The number comes from, in order (``Config.attempt_source`` says which):

1. ``init(attempt=...)`` or ``STEPTRACE_ATTEMPT``: used as given.
2. A launcher's restart count (``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT``): all ranks of
   one launch agree on it.
3. This rank's run directory: ``<run_dir>/<run_id>/rank-<rank>.attempts`` holds one line per attempt
   started; the new attempt is one more than the highest recorded (and never below the launcher's
   count, which restarts at 0 when a job is resubmitted). Every rank counts its own file, so ranks
   agree as long as the run directory outlives the processes (a shared filesystem, or the same node).

Without JSONL and without 1 or 2, every process start is attempt 0 (documented in docs/goodput.md).

A relaunch is an attempt only when the user or the launcher says so: the same run id given again
(``init(run_id=...)``, ``STEPTRACE_RUN_ID``, ``torchrun --rdzv-id``), or a launcher's restart count.
Where neither names the run, the id is derived from the launch (:func:`launch_run_id`), so two
launches are two runs; :func:`settle_run_id` keeps it so when a derived id repeats.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Any

#: Values of a launcher's run id variable that name no run. ``torchrun``'s ``--rdzv-id`` defaults to
#: ``none`` (torch/distributed/run.py), and with the static rendezvous (``--master-port``, or more than
#: one node) every worker of every launch gets ``TORCHELASTIC_RUN_ID=none``.
PLACEHOLDER_RUN_IDS = frozenset({"", "none", "null"})
#: Where a run id derived from the launch came from (``Config.run_id_source``): these can repeat
#: for a launch that is not a restart (an interactive ``srun --pty bash`` step runs many programs).
DERIVED_RUN_ID_SOURCES = ("launcher:SLURM_JOB_ID", "torchelastic_agent")


def attempts_file(run_dir: str, run_id: str, rank: int) -> str:
    return os.path.join(run_dir, run_id, f"rank-{rank}.attempts")


def launch_run_id(env: dict[str, str]) -> tuple[str, str] | None:
    """The run id the launcher gives this process, and its source, or None where it gives none.

    1. ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``; a fresh uuid per launch under
       ``--standalone`` or a one-node c10d rendezvous), unless a placeholder (``none``).
    2. ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (set by ``srun`` for every task of a job step, on
       every node): ``slurm-<job>.<step>``. A requeued job keeps its ids and counts
       ``SLURM_RESTART_COUNT``, so its relaunch is an attempt of the same run.
    3. A torchrun worker whose launch has no id: the agent that started it (:func:`torchelastic_agent`),
       the same for every worker of that agent and for its restarts (``TORCHELASTIC_RESTART_COUNT``),
       new for each launch: ``torchrun-<hash>``.
    """
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic is not None and elastic.strip().lower() not in PLACEHOLDER_RUN_IDS:
        return elastic, "launcher:TORCHELASTIC_RUN_ID"
    job, job_step = (env.get("SLURM_JOB_ID") or "").strip(), (env.get("SLURM_STEP_ID") or "").strip()
    if job and job_step:
        return f"slurm-{job}.{job_step}", "launcher:SLURM_JOB_ID"
    if elastic is not None:
        agent = torchelastic_agent(env)
        if agent is not None:
            import socket

            key = "\0".join((socket.gethostname(), agent, env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")))
            return "torchrun-" + hashlib.sha256(key.encode()).hexdigest()[:12], "torchelastic_agent"
    return None


_ATTEMPT_DIR = re.compile(r"attempt_\d+")


def torchelastic_agent(env: dict[str, str]) -> str | None:
    """What names the torchelastic agent (torchrun) that started this worker, or None.

    The agent's log directory, from ``TORCHELASTIC_ERROR_FILE``: torch's ``DefaultLogsSpecs``
    (torch/distributed/elastic/multiprocessing/api.py) gives each worker
    ``<log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/error.json``, the middle directory
    made once per agent by ``mkdtemp`` (so new for every launch, kept across the agent's restarts,
    shared by its workers whatever wraps them). Without it (logs to ``/dev/null``), the parent
    process, which is the agent for a worker it started directly: its pid and start time (Linux).
    """
    error_file = env.get("TORCHELASTIC_ERROR_FILE") or ""
    parts = error_file.replace("\\", "/").split("/")
    for index, part in enumerate(parts):
        if index > 0 and _ATTEMPT_DIR.fullmatch(part):
            return "logs:" + "/".join(parts[:index])
    parent = os.getppid()
    started = _start_ticks(parent)
    return None if started is None else f"pid:{parent}:{started}"


def settle_run_id(config: Any) -> tuple[Any, str | None]:
    """The configuration with a derived run id made unique among this rank's earlier launches, and a
    warning to give (or None).

    A derived id repeats where the launcher's identity does (two programs in one interactive
    ``srun`` step). A launch that is the launcher's first start (attempt 0) of an id this rank
    already recorded is not a restart: it takes ``<id>-<k>``, the first k whose attempts file this
    rank has not written (ranks agree as long as the run directory outlives the processes, like the
    attempt count). Reads only; JSONL on."""
    if (not config.jsonl or config.run_id_source not in DERIVED_RUN_ID_SOURCES or config.attempt != 0
            or config.attempt_source in ("code", "env")):
        return config, None
    run_id, k = config.run_id, 0
    while os.path.exists(attempts_file(config.run_dir, run_id, config.rank)):
        k += 1
        run_id = f"{config.run_id}-{k}"
    if not k:
        return config, None
    return dataclasses.replace(config, run_id=run_id), (
        f"run {config.run_id!r} (from {config.run_id_source}) was already recorded by an earlier launch that the "
        f"launcher does not call a restart: this launch is run {run_id!r}. To resume a run, give its id "
        f"(init(run_id=...) or STEPTRACE_RUN_ID; docs/goodput.md)")


def settle_attempt(config: Any) -> Any:
    """The configuration with its attempt number settled from the run directory where nothing
    decided it (JSONL on). Reads only: :func:`record_attempt` writes once the sinks started."""
    if not config.jsonl or config.attempt_source in ("code", "env"):
        return config
    recorded = _recorded_attempts(attempts_file(config.run_dir, config.run_id, config.rank))
    if recorded and max(recorded) + 1 > config.attempt:
        return dataclasses.replace(config, attempt=max(recorded) + 1, attempt_source="run_dir")
    return config


def record_attempt(config: Any) -> None:
    """Add this attempt to the rank's attempts file (JSONL on). A file that cannot be written
    costs the next attempt its fallback number, never this run."""
    if not config.jsonl:
        return
    path = attempts_file(config.run_dir, config.run_id, config.rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"attempt": config.attempt, "pid": os.getpid(), "init_time": time.time()}) + "\n")
    except OSError:
        pass


def _recorded_attempts(path: str) -> list[int]:
    found = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    value = json.loads(line).get("attempt")
                except (ValueError, AttributeError):
                    continue  # a torn line from a crash mid-write
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    found.append(value)
    except OSError:
        return []
    return found


def _start_ticks(pid: int) -> int | None:
    """Process *pid*'s start, in clock ticks after boot (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode()
        # Field 22 (starttime); the command name (field 2) may hold spaces and parentheses.
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_start_time() -> float | None:
    """When this process started (unix seconds), from Linux's /proc; None elsewhere.

    Start-up before ``init()`` (imports, framework and device initialization) is part of an
    attempt's cost: the accounting counts it from here.
    """
    ticks = _start_ticks(os.getpid())
    if ticks is None:
        return None
    try:
        started_after_boot = ticks / os.sysconf("SC_CLK_TCK")
        # /proc/uptime (10 ms resolution) rather than btime (whole seconds) places it to a tick.
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
