"""Job goodput across attempts: where every second of a job that restarted went.

One rank's records (every attempt in its run file) are accounted from the first attempt's process
start to the last record, and each second lands in exactly one place (``docs/goodput.md``)::

    total       = last record's end - first attempt's process start
    productive  = Σ compute of the steps that were kept (not failed, not thrown away)
    badput      = startup + compile + data + checkpoint + restore + eval + custom + other
                  + wasted (every second of steps a later attempt threw away, or that failed)
                  + downtime (end of attempt k's last record -> start of attempt k+1)
    productive + Σ badput = total, to float rounding (checked by the tests)

Within an attempt: process start -> init() is startup; init() -> the first step is the first step's
``before_step_breakdown`` (``startup`` for what no span covers, ``restore``, ``eval``, ...); each kept
step's interval is its compute (productive) and its ``idle_breakdown`` by reason; a wasted step's
whole interval is wasted progress; after the attempt's last step, checkpoints and spans by name and
``other`` for the rest. Reasons map to buckets by name; span names of your own are ``custom``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from steptrace._attribution import HostSpan, breakdown, idle_segments
from steptrace.analysis.runs import kept_and_wasted, split_attempts
from steptrace.analysis.summary import as_number

#: The badput buckets, in the order reports list them.
BUCKETS = ("startup", "compile", "data", "checkpoint", "restore", "eval", "custom", "other", "wasted", "downtime")
_BUCKET_OF_REASON = {"startup": "startup", "compile": "compile", "data": "data", "checkpoint": "checkpoint",
                     "restore": "restore", "eval": "eval", "other": "other"}


def bucket_of(reason: str) -> str:
    """The badput bucket an idle reason (a span name) belongs to: its own, or ``custom``."""
    return _BUCKET_OF_REASON.get(reason, "custom")


def _time(record: dict, field: str) -> float | None:
    return as_number(record.get(field))


def _attempt_start(records: list[dict]) -> float | None:
    """When an attempt's process started: its ``attempt`` record, else the earliest time it wrote."""
    for record in records:
        if record.get("type") == "attempt" and _time(record, "start_time") is not None:
            return _time(record, "start_time")
    starts = []
    for record in records:
        if record.get("type") == "step":
            host_start = _time(record, "host_start_time")
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

    Returns ``total_seconds``, ``productive_seconds``, ``goodput`` (productive / total),
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
            first_entry = (_time(first, "host_start_time") or start) - before
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
            own_productive.append(as_number(step.get("compute_seconds")) or 0.0)
            for reason, seconds in (step.get("idle_breakdown") or {}).items():
                if as_number(seconds) is not None:
                    charge(str(reason), float(seconds), mine)
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
    }
