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
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

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
        #: Requests issued and fetched (for tests and the docs' numbers).
        self.issued = 0
        self.fetched = 0

    def verdict(self, run_id: str, culprit: int, reference: int | None, step: int, detail: str) -> None:
        """The run's straggler became ``culprit`` at ``step``: ask it and the reference rank."""
        now = time.monotonic()
        with self._lock:
            ranks = self._runs.pop(run_id, {})
            self._runs[run_id] = ranks
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
            pair = [(culprit, f"the collector named rank {culprit} the run's straggler at step {step} ({detail}): "
                              f"this rank is the culprit" + (f"; rank {reference} is the reference" if reference
                                                             is not None else ""))]
            if reference is not None:
                pair.append((reference, f"the collector named rank {culprit} the run's straggler at step {step} "
                                        f"({detail}): this rank is the reference to compare it with"))
            for rank, reason in pair:
                ranks[rank] = {"id": f"{run_id}/{next(self._ids)}", "reason": reason, "step": step, "at": now}
                self.issued += 1

    def take(self, run_id: str, rank: int) -> dict[str, Any] | None:
        """The pending request for ``rank`` of ``run_id`` (once), or None."""
        now = time.monotonic()
        with self._lock:
            ranks = self._runs.get(run_id)
            if not ranks:
                return None
            request = ranks.pop(rank, None)
            for other, pending in list(ranks.items()):
                if now - pending["at"] > self.ttl_s:
                    del ranks[other]
            if request is None or now - request["at"] > self.ttl_s:
                return None
            self.fetched += 1
            return {"id": request["id"], "reason": request["reason"], "step": request["step"]}
