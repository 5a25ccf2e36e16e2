"""Who slowed the job: the straggler of each step and what it cost, from the ranks' own files or
from the collector's ``cluster.jsonl``.

In synchronous training every rank's step is as long as the slowest's, so per-rank step times
cannot name the culprit. Where the ranks measured their wait in collectives
(``collective_wait_seconds``, ``own_seconds``), the straggler of a step is the rank with the most
time on its own, named only when it stands out (``steptrace._attribution.find_straggler``, the same
rule the collector applies), and what it cost the job is the other ranks' median wait less its own.

:func:`straggler_steps` joins the ranks' step records by step number (the collector does the same
over OTLP); :func:`summarize_stragglers` reads either those or the collector's ``cluster_step``
records; :func:`straggler_sentence` says it in one line, e.g. "rank 2 cost the job 30 ms per step,
45 % of its step time".
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from steptrace._attribution import (
    STRAGGLER_MIN_RATIO,
    STRAGGLER_MIN_SECONDS,
    StragglerScores,
    find_straggler,
    straggler_step_seconds,
)

__all__ = ["straggler_sentence", "straggler_steps", "summarize_stragglers"]


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def straggler_steps(records_by_rank: dict[int, Sequence[dict]], world_size: int | None = None, *,
                    min_seconds: float = STRAGGLER_MIN_SECONDS,
                    min_ratio: float = STRAGGLER_MIN_RATIO) -> list[dict]:
    """One record per step that every rank (``0 .. world_size-1``, default: the ranks given) reported
    with status ok: ``step``, ``complete`` (True), ``interval_median_seconds``, ``rank_own_seconds``,
    ``straggler_rank`` (None when no rank stands out), ``straggler_cost_seconds``,
    ``straggler_excess_seconds``: the keys of the collector's ``cluster_step`` records."""
    ranks = sorted(records_by_rank) if world_size is None else list(range(world_size))
    if len(ranks) < 2 or any(r not in records_by_rank for r in ranks):
        return []
    by_step: dict[int, dict[int, dict]] = {}
    for rank in ranks:
        for record in records_by_rank[rank]:
            step = record.get("step")
            if record.get("type") == "step" and record.get("status") == "ok" and isinstance(step, int) \
                    and not isinstance(step, bool):
                by_step.setdefault(step, {})[rank] = record
    out = []
    for step in sorted(by_step):
        records = by_step[step]
        if len(records) != len(ranks):
            continue
        computes = {r: _seconds(rec.get("compute_seconds")) for r, rec in records.items()}
        intervals = [_seconds(rec.get("interval_seconds")) for rec in records.values()]
        if any(v is None for v in computes.values()) or any(v is None for v in intervals):
            continue
        own: dict[int, float] = {}
        waits: dict[int, float | None] = {}
        for rank, record in records.items():
            wait = _seconds(record.get("collective_wait_seconds"))
            mine = _seconds(record.get("own_seconds"))
            waits[rank] = wait
            own[rank] = mine if wait is not None and mine is not None else computes[rank]  # type: ignore[assignment]
        interval_median = statistics.median(v for v in intervals if v is not None)
        compute_median = statistics.median(v for v in computes.values() if v is not None)
        measured = all(w is not None for w in waits.values())
        found = find_straggler({r: (own[r], waits[r]) for r in records},
                               straggler_step_seconds(interval_median, compute_median, measured),
                               min_seconds=min_seconds, min_ratio=min_ratio)
        out.append({
            "step": step, "complete": True, "interval_median_seconds": interval_median,
            "rank_own_seconds": {str(r): own[r] for r in sorted(own)},
            "straggler_rank": None if found is None else found.rank,
            "straggler_cost_seconds": None if found is None else found.cost_seconds,
            "straggler_excess_seconds": None if found is None else found.excess_seconds,
        })
    return out


def summarize_stragglers(steps: Iterable[dict], *, window_steps: int = 100) -> dict:
    """Per rank named: steps, share of complete steps, median cost and median share of the step's
    interval; the top straggler; and the per-rank scores over the last ``window_steps`` steps
    (``relative``, ``individual``: see ``steptrace._attribution.StragglerScores``)."""
    complete = [s for s in steps if s.get("complete") is True]
    scores = StragglerScores(window_steps)
    named: dict[int, list[dict]] = {}
    for step in complete:
        own = step.get("rank_own_seconds")
        if isinstance(own, dict):
            scores.add({int(r): float(v) for r, v in own.items() if _seconds(v) is not None})
        rank = step.get("straggler_rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            named.setdefault(rank, []).append(step)
    ranks = {}
    for rank, named_steps in sorted(named.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        costs = [c for c in (_seconds(s.get("straggler_cost_seconds")) for s in named_steps) if c is not None]
        excess = [c for c in (_seconds(s.get("straggler_excess_seconds")) for s in named_steps) if c is not None]
        shares = [c / i for c, i in ((_seconds(s.get("straggler_cost_seconds")),
                                      _seconds(s.get("interval_median_seconds"))) for s in named_steps)
                  if c is not None and i]
        ranks[str(rank)] = {
            "steps": len(named_steps),
            "share_of_steps": len(named_steps) / len(complete),
            "cost_median_seconds": statistics.median(costs) if costs else None,
            "cost_total_seconds": sum(costs) if costs else None,
            "cost_share_of_step": statistics.median(shares) if shares else None,
            "excess_median_seconds": statistics.median(excess) if excess else None,
        }
    return {
        "complete_steps": len(complete),
        "steps_with_straggler": sum(len(v) for v in named.values()),
        "ranks": ranks,
        "top": next(iter(ranks), None),
        "scores": {str(r): {"relative": rel, "individual": ind} for r, (rel, ind) in sorted(scores.scores().items())},
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def straggler_sentence(summary: dict) -> str | None:
    """The report's one line, or None when there were no complete steps."""
    complete = summary.get("complete_steps") or 0
    if not complete:
        return None
    top = summary.get("top")
    if top is None:
        return f"no rank stood out in {complete} step{'' if complete == 1 else 's'} joined across ranks"
    facts = summary["ranks"][top]
    share = f"named in {facts['share_of_steps'] * 100:.0f} % of {complete} steps"
    if facts["cost_median_seconds"] is not None:
        line = f"rank {top} cost the job {_ms(facts['cost_median_seconds'])} per step"
        if facts["cost_share_of_step"] is not None:
            line += f", {facts['cost_share_of_step'] * 100:.0f} % of its step time"
        return f"{line} ({share})"
    return (f"rank {top} was the slowest by {_ms(facts['excess_median_seconds'] or 0.0)} per step ({share}; its "
            "cost to the job is unknown: the ranks did not measure their wait in collectives)")
