"""Goodput in ml-goodput-measurement's words: the same accounting, GMG's bucket names, GMG's ideal step time.

ml-goodput-measurement (GMG, github.com/AI-Hypercomputer/ml-goodput-measurement) is what MaxText and
AXLearn call, and its users read badput in its names (``BadputType`` in ``src/goodput_utils.py``). This
module renames steptrace's accounting (:mod:`steptrace.analysis.goodput`) into those names, bucket by
bucket, without moving a second: productive + Σ badput = total holds in both vocabularies.
``docs/goodput.md`` has the table and where the definitions differ.

Where steptrace has no separate figure for a GMG name it says so with ``None`` (never a 0 that would
read as "measured, none"): ``TPU_INITIALIZATION`` (steptrace's ``startup`` holds device initialization
and training preparation together, reported as ``TRAINING_PREP``) and ``DATA_LOADING_ASYNC`` (loading
hidden behind compute is not badput in either vocabulary; steptrace does not time it apart).

The ideal step time is GMG's ``compute_ideal_step_time`` (``src/goodput_utils.py``, read at commit
57092cf, Aug 2026), re-implemented here, not imported (GMG needs Google Cloud clients): drop step times
under 1 s, then the mean of those ≤ median + 3·MAD, with the raw MAD (``scipy.stats.median_abs_deviation``'s
default ``scale=1.0``, not the 1.4826-scaled one steptrace's noise floors use) and numpy's median (the
mean of the two middle values for an even count). GMG's step times are differences of consecutive step
*start* times on the host (``GoodputCalculator._get_step_times``: step k's time is start(k+1) − start(k),
only where the next logged step is k + 1, a later value for the same k replacing an earlier one).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping, Sequence

from steptrace.analysis.goodput import BUCKETS
from steptrace.analysis.summary import as_number

#: GMG's ``BadputType`` names (``src/goodput_utils.py``), in its order. The elastic-only ones
#: (ELASTIC_SLICE_DOWN, ELASTIC_SCALE_UP, ELASTIC_REINITIALIZATION) have no counterpart here.
GMG_BADPUT_TYPES = ("TPU_INITIALIZATION", "TRAINING_PREP", "PROGRAM_STARTUP", "DATA_LOADING_SYNC",
                    "DATA_LOADING_ASYNC", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME", "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
                    "WASTED_PROGRESS_FROM_DISRUPTION", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
                    "CUSTOM_BADPUT_EVENTS", "OTHER")
#: The GMG name each steptrace badput bucket is reported under. Every bucket has one
#: (tests/test_goodput_gmg.py fails for a bucket added without it).
GMG_NAME_OF_BUCKET = {
    "startup": "TRAINING_PREP",  # with what GMG calls TPU_INITIALIZATION: steptrace does not split them
    "compile": "PROGRAM_STARTUP",  # GMG: "JAX tracing, compilation tasks, runtime initialization"
    "data": "DATA_LOADING_SYNC",  # loading the device waited for; hidden loading is no badput in either
    "checkpoint": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "eval": "CUSTOM_BADPUT_EVENTS",  # as MaxText records it: custom event "eval_step" (GMG upper-cases types)
    "custom": "CUSTOM_BADPUT_EVENTS",  # each span name its own event type, upper-cased as GMG does
    "other": "OTHER",
    "collective_wait": "OTHER",  # GMG has no bucket: it counts waiting inside a step as productive
    "wasted": "WASTED_PROGRESS_FROM_DISRUPTION",
    "downtime": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
}
#: GMG's custom event type for the buckets that land in CUSTOM_BADPUT_EVENTS under a fixed name.
GMG_CUSTOM_EVENT_OF_BUCKET = {"eval": "EVAL_STEP"}
#: GMG names steptrace has no separate figure for (reported as None).
GMG_NOT_SEPARATED = {
    "TPU_INITIALIZATION": "in TRAINING_PREP: steptrace's startup holds device initialization and training preparation",
    "DATA_LOADING_ASYNC": "loading hidden behind compute is not badput; steptrace does not time it apart",
}
#: GMG ignores step times under this (``compute_ideal_step_time``: "may be less than 1 second").
GMG_MIN_STEP_SECONDS = 1.0
#: GMG's outlier cut: median + this many (raw) median absolute deviations.
GMG_MAD_MULTIPLIER = 3.0
GMG_IDEAL_DEFINITION = ("GMG's compute_ideal_step_time: step times ≥ 1 s, then the mean of those ≤ median + "
                        "3·MAD (raw MAD, not scaled by 1.4826)")


def gmg_badput(accounting: Mapping[str, Any]) -> dict[str, Any]:
    """An accounting (:func:`~steptrace.analysis.goodput.job_accounting` or
    :func:`~steptrace.analysis.goodput.job_goodput`) in GMG's names.

    Returns ``total_seconds`` and ``productive_seconds`` (unchanged), ``goodput_percent`` (GMG reports
    percentages), ``badput_seconds`` (GMG name -> seconds; ``CUSTOM_BADPUT_EVENTS`` -> event type ->
    seconds; ``None`` where steptrace has no separate figure), ``badput_percent`` (the same as a share of
    the total, in percent) and ``sources`` (GMG name -> steptrace bucket or custom span -> seconds:
    nothing is folded in without saying so).
    """
    total = float(accounting["total_seconds"])
    badput: Mapping[str, float] = accounting["badput"]
    custom: Mapping[str, float] = accounting.get("custom") or {}
    flat: dict[str, list[float]] = {name: [] for name in GMG_BADPUT_TYPES if name != "CUSTOM_BADPUT_EVENTS"}
    events: dict[str, list[float]] = {}
    sources: dict[str, dict[str, float]] = {name: {} for name in GMG_BADPUT_TYPES}
    for bucket in BUCKETS:
        name = GMG_NAME_OF_BUCKET[bucket]
        seconds = float(badput.get(bucket, 0.0))
        if name != "CUSTOM_BADPUT_EVENTS":
            flat[name].append(seconds)
            sources[name][bucket] = seconds
            continue
        if bucket == "custom":
            # each span name its own event; an accounting summed without names keeps the seconds
            parts = {span: float(s) for span, s in custom.items()} or {"custom": seconds}
        else:
            parts = {bucket: seconds}
        for source, part_seconds in parts.items():
            if not part_seconds:
                continue  # GMG lists the event types that occurred
            event = GMG_CUSTOM_EVENT_OF_BUCKET.get(bucket) or source.upper()
            events.setdefault(event, []).append(part_seconds)
            sources[name][source] = sources[name].get(source, 0.0) + part_seconds
    badput_seconds: dict[str, Any] = {}
    for name in GMG_BADPUT_TYPES:
        if name == "CUSTOM_BADPUT_EVENTS":
            badput_seconds[name] = {event: math.fsum(pieces) for event, pieces in events.items()}
        elif name in GMG_NOT_SEPARATED:
            badput_seconds[name] = None
        else:
            badput_seconds[name] = math.fsum(flat[name])

    def percent(seconds: float) -> float | None:
        return seconds / total * 100.0 if total > 0 else None

    badput_percent: dict[str, Any] = {
        name: ({event: percent(s) for event, s in value.items()} if isinstance(value, dict)
               else (None if value is None else percent(value)))
        for name, value in badput_seconds.items()}
    productive = float(accounting["productive_seconds"])
    return {
        "total_seconds": total,
        "productive_seconds": productive,
        "goodput_percent": percent(productive),
        "badput_seconds": badput_seconds,
        "badput_percent": badput_percent,
        "sources": {name: parts for name, parts in sources.items() if parts},
    }


def gmg_badput_total(badput_seconds: Mapping[str, Any]) -> float:
    """Σ of a :func:`gmg_badput` ``badput_seconds`` (custom events included, ``None`` skipped)."""
    pieces: list[float] = []
    for value in badput_seconds.values():
        if isinstance(value, dict):
            pieces.extend(value.values())
        elif value is not None:
            pieces.append(value)
    return math.fsum(pieces)


def gmg_ideal_step_time(step_times: Iterable[float], min_step_seconds: float = GMG_MIN_STEP_SECONDS) -> float | None:
    """GMG's ideal step time of ``step_times`` (seconds), or None when no step reaches ``min_step_seconds``.

    Step times under ``min_step_seconds`` (GMG: 1 s) are dropped; of the rest, the mean of those at or
    below median + 3 × MAD, MAD being the median of the absolute deviations from the median, unscaled.
    With MAD 0 (half the steps or more equal to the median) only steps at or below the median count.
    """
    kept = [float(t) for t in step_times if t is not None and math.isfinite(t) and t >= min_step_seconds]
    if not kept:
        return None
    middle = statistics.median(kept)
    mad = statistics.median([abs(t - middle) for t in kept])
    normal = [t for t in kept if t <= middle + GMG_MAD_MULTIPLIER * mad]
    return statistics.fmean(normal) if normal else None


def gmg_step_times(records: Sequence[dict]) -> dict[int, float]:
    """Step times as GMG takes them from its logs, here from one rank's step records (every attempt, in
    file order): step k's time is the host start of step k + 1 minus the host start of step k, only
    where the next step recorded is k + 1; a later pair for the same k replaces an earlier one (GMG's
    dict). Host start: entering ``with step(n)``, where GMG's ``record_step_start_time`` is called."""
    times: dict[int, float] = {}
    previous: tuple[int, float] | None = None
    for record in records:
        if record.get("type") != "step":
            continue
        number, start = as_number(record.get("step")), as_number(record.get("host_start_time"))
        if number is None or start is None:
            previous = None
            continue
        if previous is not None and int(number) == previous[0] + 1:
            times[previous[0]] = start - previous[1]
        previous = (int(number), start)
    return times


def ideal_step_time(records: Sequence[dict], kept_steps: Sequence[dict],
                    steptrace_interval_p50: float | None) -> dict[str, Any]:
    """GMG's ideal step time for one rank, beside steptrace's own step figures.

    ``gmg_seconds``: GMG's rule on GMG's step times (host start to host start, :func:`gmg_step_times`),
    what GMG reports for this job. ``gmg_rule_on_intervals_seconds``: the same rule on steptrace's
    device-true intervals of the kept steps. ``steptrace_interval_p50_seconds``: steptrace's median step
    interval. ``steps`` / ``steps_under_min``: step times GMG's rule saw, and those it dropped as < 1 s.
    """
    host = list(gmg_step_times(records).values())
    intervals = [v for v in (as_number(s.get("interval_seconds")) for s in kept_steps) if v is not None]
    return {
        "gmg_seconds": gmg_ideal_step_time(host),
        "gmg_rule_on_intervals_seconds": gmg_ideal_step_time(intervals),
        "steptrace_interval_p50_seconds": steptrace_interval_p50,
        "steps": len(host),
        "steps_under_min": sum(1 for t in host if t < GMG_MIN_STEP_SECONDS),
        "min_step_seconds": GMG_MIN_STEP_SECONDS,
        "definition": GMG_IDEAL_DEFINITION,
    }


def gmg_view(records: Sequence[dict], rank_accounting: Mapping[str, Any], job: Mapping[str, Any] | None,
             rank: int, steptrace_interval_p50: float | None) -> dict[str, Any]:
    """``report --json``'s ``gmg``: the shown rank's accounting in GMG's names (GMG measures one process,
    process 0, so the rank view is the one to hold against GMG's figures), the job's (every rank's
    rank-seconds summed, as steptrace's ``job``) and GMG's ideal step time beside steptrace's."""
    from steptrace.analysis.runs import kept_and_wasted

    kept, _ = kept_and_wasted(list(records))
    kept = [s for s in kept if s.get("status") != "error"]
    return {
        "vocabulary": "ml-goodput-measurement BadputType (src/goodput_utils.py)",
        "name_of_bucket": dict(GMG_NAME_OF_BUCKET),
        "not_separated": dict(GMG_NOT_SEPARATED),
        "rank": rank,
        **gmg_badput(rank_accounting),
        "job": gmg_badput(job) if job is not None else None,
        "ideal_step_time": ideal_step_time(records, kept, steptrace_interval_p50),
    }
