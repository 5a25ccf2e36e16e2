"""Capture requests: the collector's straggler verdict, handed back to the ranks it names.

When a run's persistent straggler changes to a rank (``steptrace._attribution.StragglerPersistence``,
the verdict of ``steptrace_cluster_persistent_straggler_*``), the collector asks two ranks for a
profiler trace of their next steps (docs/capture.md, the ``straggler`` trigger): the culprit, and a
*reference* rank (the one whose mean time on its own is the median of the others'), so the two traces
can be diffed. A rank whose capture has the ``straggler`` trigger polls
``GET /v1/steptrace/capture?run_id=<run>&rank=<r>`` (the OTLP port and bearer token) and gets each
request once.

Bounded: per run at most one pending request per rank, for at most ``max_runs`` runs (the least
recently asked dropped first); a request not fetched within ``ttl_s`` is dropped (the rank does not
poll: its capture is off). A run gets a new pair only when its verdict changes.

Counted (``count``, the collector's ``steptrace_cluster_capture_requests_total{state}``): ``issued``,
``fetched`` by the rank it names, ``expired`` (not fetched within ``ttl_s``, replaced by the run's next
verdict before its rank asked, or dropped with its run): issued = fetched + expired + pending.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable

#: Seconds a capture request waits for its rank to fetch it.
REQUEST_TTL_S = 600.0


class CaptureRequests:
    """Pending capture requests per run and rank (thread-safe)."""

    def __init__(self, max_runs: int = 64, ttl_s: float = REQUEST_TTL_S):
        self.max_runs = max_runs
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._runs: collections.OrderedDict[str, dict[int, dict[str, Any]]] = collections.OrderedDict()
        self._ids = itertools.count(1)
        #: Requests issued, fetched and expired (the counters below report the same).
        self.issued = 0
        self.fetched = 0
        self.expired = 0
        #: Told ``(run_id, state, n)`` for each change above (the collector's metrics), after this object's
        #: lock is released: the metrics call verdict() under their own lock, so holding ours while taking
        #: theirs (take() on an HTTP thread) would deadlock.
        self.count: Callable[[str, str, int], None] | None = None

    def _counted(self, due: list[tuple[str, str, int]], run_id: str, state: str, n: int) -> None:
        if n > 0:
            setattr(self, state, getattr(self, state) + n)
            due.append((run_id, state, n))

    def _report(self, due: list[tuple[str, str, int]]) -> None:
        if self.count is not None:
            for run_id, state, n in due:
                self.count(run_id, state, n)

    def verdict(self, run_id: str, culprit: int, reference: int | None, step: int, detail: str) -> None:
        """The run's straggler became ``culprit`` at ``step``: ask it and the reference rank."""
        now = time.monotonic()
        due: list[tuple[str, str, int]] = []
        with self._lock:
            ranks = self._runs.pop(run_id, {})
            self._runs[run_id] = ranks
            while len(self._runs) > self.max_runs:
                dropped_run, dropped = self._runs.popitem(last=False)
                self._counted(due, dropped_run, "expired", len(dropped))
            pair = [(culprit, f"the collector named rank {culprit} the run's straggler at step {step} ({detail}): "
                              f"this rank is the culprit" + (f"; rank {reference} is the reference" if reference
                                                             is not None else ""))]
            if reference is not None:
                pair.append((reference, f"the collector named rank {culprit} the run's straggler at step {step} "
                                        f"({detail}): this rank is the reference to compare it with"))
            for rank, reason in pair:
                if rank in ranks:
                    self._counted(due, run_id, "expired", 1)  # the new verdict replaces a request never fetched
                ranks[rank] = {"id": f"{run_id}/{next(self._ids)}", "reason": reason, "step": step, "at": now}
                self._counted(due, run_id, "issued", 1)
        self._report(due)

    def take(self, run_id: str, rank: int) -> dict[str, Any] | None:
        """The pending request for ``rank`` of ``run_id`` (once), or None."""
        now = time.monotonic()
        due: list[tuple[str, str, int]] = []
        with self._lock:
            ranks = self._runs.get(run_id)
            if not ranks:
                return None
            request = ranks.pop(rank, None)
            for other, pending in list(ranks.items()):
                if now - pending["at"] > self.ttl_s:
                    del ranks[other]
                    self._counted(due, run_id, "expired", 1)
            if request is not None:
                fresh = now - request["at"] <= self.ttl_s
                self._counted(due, run_id, "fetched" if fresh else "expired", 1)
                if not fresh:
                    request = None
        self._report(due)
        if request is None:
            return None
        return {"id": request["id"], "reason": request["reason"], "step": request["step"]}
