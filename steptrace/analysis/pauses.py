"""The job-level garbage-collection finding (issue 50, docs/pauses.md): what the ranks' collections cost the
job, whether they were aligned, and what coordinated collection every N steps would cost instead, from the
ranks' step records of one run (``pauses=True``: ``host_pauses`` and ``idle_breakdown["gc"]``).

In synchronous training a rank paused by its collector makes every other rank wait for it in the next
collective, so a step costs the job its *longest* collection across ranks: ``Σ_steps max_rank gc``. When the
ranks collect at different steps, the job pays each rank's collections one after the other; collected at
the same steps (``steptrace.gc_every(n)``), it pays each period's longest one once. The estimate for every
N steps: ``((steps - 1) // N) × max over ranks of its typical full collection`` (the median of its long
collections), N defaulting to the ranks' own period between long collections (so the heap each
collection meets is about the same).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from steptrace._attribution import STRAGGLER_MIN_SECONDS

__all__ = ["gc_finding", "gc_sentence"]

#: A collection long enough to make the other ranks wait visibly (the straggler rule's fixed floor).
LONG_GC_SECONDS = STRAGGLER_MIN_SECONDS


def _gc(record: dict) -> float | None:
    if not isinstance(record.get("host_pauses"), dict):
        return None
    value = (record.get("idle_breakdown") or {}).get("gc", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def gc_finding(records_by_rank: dict[int, Sequence[dict]], every_steps: int | None = None) -> dict[str, Any] | None:
    """The finding, or None where fewer than two ranks measured their pauses in common steps.

    ``job_gc_seconds``: Σ over the steps every rank reported of the longest collection charged on any rank;
    ``long_collections`` and ``aligned_share`` (of the steps where some rank collected for at least
    :data:`LONG_GC_SECONDS`, the share where every rank did); ``waited_seconds``: the other ranks' median
    wait in collectives in the steps where one rank alone collected that long (the wait that lines up with
    it, where the ranks measure their wait); ``every_steps`` (the N: given, else the ranks' median period
    between long collections) and ``coordinated_estimate_seconds``; ``saving_seconds``."""
    ranks = sorted(records_by_rank)
    if len(ranks) < 2:
        return None
    by_step: dict[int, dict[int, dict]] = {}
    for rank in ranks:
        for record in records_by_rank[rank]:
            if record.get("type") == "step" and record.get("status") == "ok" and _gc(record) is not None:
                by_step.setdefault(record["step"], {})[rank] = record
    steps = sorted(n for n, records in by_step.items() if len(records) == len(ranks))
    if not steps:
        return None
    job = 0.0
    long_steps = aligned = 0
    waited = 0.0
    long_by_rank: dict[int, list[float]] = {rank: [] for rank in ranks}
    for n in steps:
        records = by_step[n]
        gcs = {rank: _gc(record) or 0.0 for rank, record in records.items()}
        job += max(gcs.values())
        collectors = [rank for rank, seconds in gcs.items() if seconds >= LONG_GC_SECONDS]
        for rank in collectors:
            long_by_rank[rank].append(gcs[rank])
        if not collectors:
            continue
        long_steps += 1
        if len(collectors) == len(ranks):
            aligned += 1
        elif len(collectors) == 1:
            waits = [records[r].get("collective_wait_seconds") for r in ranks if r != collectors[0]]
            known = [w for w in waits if isinstance(w, (int, float))]
            if known:
                waited += min(statistics.median(known), gcs[collectors[0]])
    typical = {rank: statistics.median(v) for rank, v in long_by_rank.items() if v}
    periods = [len(steps) / len(v) for v in long_by_rank.values() if v]
    n_every = every_steps if every_steps is not None else (max(1, round(statistics.median(periods))) if periods
                                                            else None)
    estimate = None
    if n_every is not None and typical:
        # gc_every(N) collects before steps N, 2N, ... (its first collection, at setup, meets a clean heap).
        estimate = ((len(steps) - 1) // n_every) * max(typical.values())
    return {
        "steps": len(steps),
        "job_gc_seconds": job,
        "long_collections": {str(rank): len(v) for rank, v in long_by_rank.items()},
        "steps_with_long_collection": long_steps,
        "aligned_share": aligned / long_steps if long_steps else None,
        "waited_seconds": waited,
        "typical_collection_seconds": {str(rank): v for rank, v in typical.items()},
        "every_steps": n_every,
        "coordinated_estimate_seconds": estimate,
        "saving_seconds": None if estimate is None else job - estimate,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def gc_sentence(finding: dict[str, Any] | None) -> str | None:
    """The report's GC line, or None where there is nothing to say (no long collection)."""
    if not finding or not finding["steps_with_long_collection"]:
        return None
    aligned = finding["aligned_share"]
    line = (f"garbage collection cost the job {_ms(finding['job_gc_seconds'])} over {finding['steps']} steps; "
            f"{aligned * 100:.0f} % of the {finding['steps_with_long_collection']} steps with a collection over "
            f"{_ms(LONG_GC_SECONDS)} had every rank collecting")
    if finding["waited_seconds"]:
        line += f" (the other ranks waited {_ms(finding['waited_seconds'])} for one rank's collections)"
    estimate = finding["coordinated_estimate_seconds"]
    if estimate is not None and aligned is not None and aligned < 1.0:
        line += (f"; coordinated collection every {finding['every_steps']} steps (steptrace.gc_every"
                 f"({finding['every_steps']})) would cost about {_ms(estimate)}")
    return line
