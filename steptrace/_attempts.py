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
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any


def attempts_file(run_dir: str, run_id: str, rank: int) -> str:
    return os.path.join(run_dir, run_id, f"rank-{rank}.attempts")


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


def process_start_time() -> float | None:
    """When this process started (unix seconds), from Linux's /proc; None elsewhere.

    Start-up before ``init()`` (imports, framework and device initialization) is part of an
    attempt's cost: the accounting counts it from here.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            stat = handle.read().decode()
        # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold spaces.
        fields = stat[stat.rindex(")") + 2:].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        # /proc/uptime (10 ms resolution) rather than btime (whole seconds) places it to a tick.
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
