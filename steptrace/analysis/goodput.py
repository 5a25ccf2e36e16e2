"""Goodput: where every second of a job went, from the first process start, across attempts and ranks.

**Goodput** (the one figure steptrace calls goodput; ``docs/goodput.md``)::

    goodput = productive / wall
    productive = Σ own compute of the steps that were kept: compute_seconds less the time the rank
                 waited for other ranks in collectives (collective_wait_seconds, where it is measured)
    wall       = last record's end - first attempt's process start, per rank

For one rank that is the rank's goodput; for the job, both sums run over every rank (rank-seconds),
so a rank that waits for a slow one never looks more productive than it.

One rank's records (every attempt in its run file) are accounted from the first attempt's process
start to the last record, and each second lands in exactly one place::

    total       = last record's end - first attempt's process start
    productive  = Σ own compute of the steps that were kept (not failed, not thrown away)
    badput      = startup + compile + data + checkpoint + restore + eval + custom + other
                  + collective_wait (waiting for other ranks in collectives: exposed communication)
                  + wasted (every second of steps a later attempt threw away, or that failed)
                  + downtime (end of attempt k's last record -> start of attempt k+1)
    productive + Σ badput = total, to float rounding (checked by the tests)

Within an attempt: process start -> init() is startup; init() -> the first step is the first step's
``before_step_breakdown`` (``startup`` for what no span covers, ``restore``, ``eval``, ...); each kept
step's interval is its own compute (productive), its wait in collectives and its ``idle_breakdown``
by reason less the wait that fell in it (the first step after a restore: its own compute above the
run's typical step interval is ``startup``, see ``summary.after_restore_costs``); a wasted step's
whole interval is wasted progress; after the attempt's last step, checkpoints and spans by name and
``other`` for the rest. Reasons map to buckets by name; span names of your own are ``custom``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from steptrace._attribution import HostSpan, breakdown, idle_segments
from steptrace.analysis.runs import kept_and_wasted, split_attempts
from steptrace.analysis.summary import after_restore_costs, as_number, step_split

#: The badput buckets, in the order reports list them.
BUCKETS = ("startup", "compile", "data", "checkpoint", "restore", "eval", "custom", "other", "collective_wait",
           "wasted", "downtime")
_BUCKET_OF_REASON = {"startup": "startup", "compile": "compile", "data": "data", "checkpoint": "checkpoint",
                     "restore": "restore", "eval": "eval", "other": "other"}
#: What the headline goodput divides, in words (printed beside it).
GOODPUT_DEFINITION = ("productive = own compute of the kept steps (not time waiting for other ranks in "
                      "collectives); wall = process start to last record, every attempt")


def bucket_of(reason: str) -> str:
    """The badput bucket an idle reason (a span name) belongs to: its own, or ``custom``."""
    return _BUCKET_OF_REASON.get(reason, "custom")


def _time(record: dict, field: str) -> float | None:
    return as_number(record.get(field))


def _host_start(step: dict) -> float | None:
    """A step's host start; a record read back from spans (ClickHouse) has none, but its interval
    ends at its end: for a rank's first step, whose interval starts at its host start, that is it."""
    host_start = _time(step, "host_start_time")
    if host_start is None and _time(step, "end_time") is not None and _time(step, "interval_seconds") is not None:
        host_start = _time(step, "end_time") - _time(step, "interval_seconds")  # type: ignore[operator]
    return host_start


def _attempt_start(records: list[dict]) -> float | None:
    """When an attempt's process started: its ``attempt`` record, else the earliest time it wrote."""
    for record in records:
        if record.get("type") == "attempt" and _time(record, "start_time") is not None:
            return _time(record, "start_time")
    starts = []
    for record in records:
        if record.get("type") == "step":
            host_start = _host_start(record)
            if host_start is not None:
                starts.append(host_start - (_time(record, "before_step_seconds") or 0.0))
        elif record.get("type") in ("span", "checkpoint", "metadata"):
            if _time(record, "start_time") is not None:
                starts.append(_time(record, "start_time"))
    return min(starts, default=None)


def _attempt_end(records: list[dict]) -> float | None:
    ends = [t for r in records for t in (_time(r, "end_time"), _time(r, "init_time")) if t is not None]
    return max(ends, default=None)


def job_accounting(records: Sequence[dict]) -> dict[str, Any]:
    """The job's accounting from one rank's records (all attempts, in file order).

    Returns ``total_seconds``, ``productive_seconds``, ``goodput`` (productive / total: the rank's),
    ``badput`` (bucket -> seconds, every bucket present), ``custom`` (span name -> seconds of the
    ``custom`` bucket) and ``attempts`` (one dict per attempt: number, start/end, status, steps,
    first/last step, wasted steps, its seconds by bucket).
    """
    records = list(records)
    kept, wasted = kept_and_wasted(records)
    # A step that failed (an exception in it: status "error") made no progress either: its time is
    # wasted progress, never productive, however the loop was written (with step(), steps()).
    failed = [s for s in kept if s.get("status") == "error"]
    wasted_ids = {id(s) for s in wasted} | {id(s) for s in failed}
    # The first step after a restore carries the restart's one-off cost (compile, graph capture,
    # warm-up): the part of its own compute above the run's typical step interval is start-up
    # (GMG's program startup: the first step's excess over the normal step), not productive.
    good = [s for s in kept if id(s) not in wasted_ids]
    after_restore = after_restore_costs(good)
    one_off_compute = {id(step): cost["one_off_compute_seconds"] or 0.0
                       for step, cost in zip([s for s in good if s.get("first_after_restore")], after_restore)}
    badput = {bucket: [] for bucket in BUCKETS}  # lists of pieces, summed with fsum at the end
    custom: dict[str, float] = {}
    productive: list[float] = []
    attempts = []
    groups = split_attempts(records)
    previous_end: float | None = None
    first_start: float | None = None

    def charge(reason: str, seconds: float, into: dict[str, list[float]]) -> None:
        bucket = bucket_of(reason)
        into[bucket].append(seconds)
        if bucket == "custom":
            custom[reason] = custom.get(reason, 0.0) + seconds

    for index, (attempt, group) in enumerate(groups):
        start = _attempt_start(group)
        end = _attempt_end(group)
        if start is None or end is None:
            continue
        mine: dict[str, list[float]] = {bucket: [] for bucket in BUCKETS}
        if previous_end is not None:
            # The process start is known to a clock tick (10 ms): an attempt that seems to start before
            # the previous one's last record starts at that record, so no second is counted twice.
            start = max(start, previous_end)
            mine["downtime"].append(start - previous_end)
        end = max(end, start)
        if first_start is None:
            first_start = start
        steps = [r for r in group if r.get("type") == "step"]
        attempt_record = next((r for r in group if r.get("type") == "attempt"), None)
        init_time = _time(attempt_record, "init_time") if attempt_record else None
        if steps:
            first = steps[0]
            before = as_number(first.get("before_step_seconds")) or 0.0
            first_entry = (_host_start(first) or start) - before
        else:
            first_entry = end
        # Process start -> init() (or -> the first thing recorded): start-up.
        if init_time is not None:
            mine["startup"].append(max(0.0, min(init_time, first_entry) - start))
        else:
            mine["startup"].append(max(0.0, first_entry - start))
        own_productive = []
        for step in steps:
            interval = as_number(step.get("interval_seconds")) or 0.0
            if step is steps[0]:
                for reason, seconds in (step.get("before_step_breakdown") or {}).items():
                    if as_number(seconds) is not None:
                        charge(str(reason), float(seconds), mine)
            if id(step) in wasted_ids:
                mine["wasted"].append(interval)
                continue
            split = step_split(step)
            one_off = one_off_compute.get(id(step), 0.0)
            own_productive.append(split.own_compute_seconds - one_off)
            if one_off:
                mine["startup"].append(one_off)
            if split.collective_wait_seconds:
                mine["collective_wait"].append(split.collective_wait_seconds)
            for reason, seconds in split.idle_breakdown.items():
                charge(reason, seconds, mine)
        # After the last step: checkpoints and spans by name, the rest `other`.
        last_end = _time(steps[-1], "end_time") if steps else None
        if last_end is not None and end > last_end:
            covers = [HostSpan("checkpoint" if r.get("type") == "checkpoint" else str(r.get("name")),
                               _time(r, "start_time"), _time(r, "end_time"))
                      for r in group if r.get("type") in ("checkpoint", "span")
                      and _time(r, "start_time") is not None and _time(r, "end_time") is not None]
            for reason, seconds in breakdown(idle_segments(last_end, end, covers)).items():
                charge(reason, seconds, mine)
        productive.extend(own_productive)
        for bucket, pieces in mine.items():
            badput[bucket].extend(pieces)
        has_run_record = any(r.get("type") == "run" for r in group)
        status = "clean" if has_run_record else ("crashed" if index < len(groups) - 1 else "running or killed")
        attempts.append({
            "attempt": attempt, "start_time": start, "end_time": end, "seconds": end - start, "status": status,
            "steps": len(steps), "first_step": steps[0].get("step") if steps else None,
            "last_step": steps[-1].get("step") if steps else None,
            "wasted_steps": sum(1 for s in steps if id(s) in wasted_ids),
            "productive_seconds": math.fsum(own_productive),
            "badput": {bucket: math.fsum(pieces) for bucket, pieces in mine.items()},
        })
        previous_end = end
    total = (previous_end - first_start) if first_start is not None and previous_end is not None else 0.0
    productive_seconds = math.fsum(productive)
    return {
        "total_seconds": total,
        "productive_seconds": productive_seconds,
        "goodput": productive_seconds / total if total > 0 else None,
        "badput": {bucket: math.fsum(pieces) for bucket, pieces in badput.items()},
        "custom": custom,
        "attempts": attempts,
        "kept_steps": len(kept) - len(failed),
        "wasted_steps": len(wasted) + len(failed),
        # each first step after a restore, with its one-off cost (summary.after_restore_costs)
        "after_restore": after_restore,
    }


def job_goodput(records_by_rank: Mapping[Any, Sequence[dict]]) -> dict[str, Any]:
    """The job's goodput: every rank's accounting (:func:`job_accounting`) summed.

    ``goodput`` = Σ productive / Σ total over the ranks (rank-seconds); ``badput`` and ``custom``
    are summed the same way, so ``productive_seconds + Σ badput = total_seconds`` still holds.
    ``ranks`` maps each rank to its own accounting (``goodput`` there is that rank's goodput).
    """
    per_rank = {rank: job_accounting(records) for rank, records in records_by_rank.items()}
    per_rank = {rank: job for rank, job in per_rank.items() if job["attempts"]}
    productive = math.fsum(job["productive_seconds"] for job in per_rank.values())
    total = math.fsum(job["total_seconds"] for job in per_rank.values())
    custom: dict[str, float] = {}
    for job in per_rank.values():
        for name, seconds in job["custom"].items():
            custom[name] = custom.get(name, 0.0) + seconds
    return {
        "goodput": productive / total if total > 0 else None,
        "definition": GOODPUT_DEFINITION + ("" if len(per_rank) < 2 else f"; both summed over {len(per_rank)} ranks"),
        "productive_seconds": productive,
        "total_seconds": total,
        "badput": {bucket: math.fsum(job["badput"][bucket] for job in per_rank.values()) for bucket in BUCKETS},
        "custom": custom,
        "ranks": per_rank,
    }
