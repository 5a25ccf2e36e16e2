"""The ranks' stalls side by side: which rank is the cause of a hang (docs/hangs.md).

Each rank's stall watch sends a ``train.stall`` span (and ``train.stall_end`` when it moves again)
on the stalled step's trace, with its training thread's stack as text. The collector keeps each
run's newest stall per rank and, when the picture changed, writes a ``cluster_stall`` record to the
run's ``cluster.jsonl``: the same job view ``steptrace report`` builds from the rank files
(``steptrace.analysis.hangs.view_of``), with the cause rank(s) and their frame.

Bounded like everything the collector holds: at most ``max_runs`` runs (the least recently
stalled is forgotten first) and one stall per rank below the collector's rank limit; a record per
run at most every ``interval_s``.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from steptrace.analysis.hangs import view_of


class StallBoard:
    def __init__(self, *, max_runs: int = 64, interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.max_runs = max_runs
        self.interval_s = interval_s
        self._clock = clock
        self._wall = wall_clock
        #: run → rank → the newest stall (dict as from _decode), in stall arrival order of runs
        self._runs: collections.OrderedDict[str, dict[int, dict[str, Any]]] = collections.OrderedDict()
        self._changed: dict[str, float] = {}  # run → when its picture changed (not yet written)
        self._written: dict[str, float] = {}  # run → when its last record was written

    def add(self, stalls: list[dict[str, Any]]) -> None:
        """Take the stall spans of one request (the caller holds the collector's lock)."""
        now = self._clock()
        for stall in stalls:
            run_id, rank = stall["run_id"], stall["rank"]
            ranks = self._runs.get(run_id)
            if stall["type"] == "stall_end":
                held = ranks.get(rank) if ranks else None
                if held is not None and (held["attempt"], held["step"]) == (stall["attempt"], stall["step"]):
                    held["ended_after"] = stall.get("open_seconds")
                    self._changed.setdefault(run_id, now)
                continue
            if ranks is None:
                ranks = self._runs[run_id] = {}
                while len(self._runs) > self.max_runs:
                    forgotten, _ = self._runs.popitem(last=False)
                    self._changed.pop(forgotten, None)
                    self._written.pop(forgotten, None)
            else:
                self._runs.move_to_end(run_id)
            # A new episode (a later step or attempt) replaces the rank's older stall.
            ranks[rank] = dict(stall, ended_after=None)
            self._changed.setdefault(run_id, now)

    def due(self) -> list[dict[str, Any]]:
        """``cluster_stall`` records of the runs whose picture changed, at most one per run per interval."""
        now = self._clock()
        records = []
        for run_id in list(self._changed):
            if now - self._written.get(run_id, -float("inf")) < self.interval_s:
                continue
            del self._changed[run_id]
            self._written[run_id] = now
            ranks = self._runs.get(run_id)
            if not ranks:
                continue
            # The newest attempt's stalls only: an older attempt's processes are gone.
            attempt = max(s["attempt"] for s in ranks.values())
            current = {rank: s for rank, s in ranks.items() if s["attempt"] == attempt}
            view = view_of(current)
            records.append({"type": "cluster_stall", "run_id": run_id, "attempt": attempt,
                            "time": self._wall(), "ranks": view["ranks"], "cause_ranks": view["cause_ranks"],
                            "reason": view["reason"], "summary": view["summary"],
                            "where": {str(r): w for r, w in view["where"].items()},
                            "step": {str(r): s for r, s in view["step"].items()},
                            "span": {str(r): s for r, s in view["span"].items()},
                            "ended_after": {str(r): e for r, e in view["ended_after"].items()}})
        return records
