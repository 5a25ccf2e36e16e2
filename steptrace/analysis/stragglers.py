"""Who slowed the job: the straggler of each step and what it cost, and the run's straggler (if any)
with its evidence, from the ranks' own files or from the collector's ``cluster.jsonl``.

In synchronous training every rank's step is as long as the slowest's, so per-rank step times
cannot name the culprit. Where the ranks measured their wait in collectives
(``collective_wait_seconds``, ``own_seconds``), the candidate of a step is the rank with the most
time on its own; it is the step's straggler only when it stands out by more than the run's own noise
and the others waited for it (``steptrace._attribution.StragglerRule``, the rule the collector and
the ClickHouse view apply), and what it cost the job is the other ranks' median wait less its own.
A step is a fact; the run's straggler is a verdict: the rank named in at least half of the complete
steps (``steptrace._attribution.straggler_evidence``), or none.

:func:`straggler_steps` joins the ranks' step records by step number (the collector does the same
over OTLP); :func:`summarize_stragglers` reads either those or the collector's ``cluster_step``
records; :func:`straggler_sentence` says it in one line, e.g. "rank 2 cost the job 30 ms per step
(IQR 27–33 ms), 45 % of its step time: named in 96 % of 55 steps, each above the run's noise
(threshold 12 ms, median)"; the wording and the cost estimate: docs/collector.md.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from steptrace._attribution import (
    STRAGGLER_MIN_RATIO,
    STRAGGLER_MIN_SECONDS,
    STRAGGLER_NOISE_K,
    STRAGGLER_NOISE_MIN_SAMPLES,
    STRAGGLER_NOISE_WINDOW,
    STRAGGLER_PERSISTENT_MIN_STEPS,
    STRAGGLER_PERSISTENT_SHARE,
    StragglerRule,
    StragglerScores,
    straggler_causes,
    straggler_evidence,
    straggler_step_seconds,
)

__all__ = ["cost_estimate", "holdups", "straggler_sentence", "straggler_steps", "summarize_stragglers",
           "step_causes"]


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def _cause_seconds(record: dict) -> dict[str, float | None]:
    breakdown = record.get("idle_breakdown") if isinstance(record.get("idle_breakdown"), dict) else {}
    pauses = record.get("host_pauses") if isinstance(record.get("host_pauses"), dict) else {}
    return {"gc": _seconds(breakdown.get("gc", 0.0)) if pauses else _seconds(breakdown.get("gc")),
            "preempted": _seconds(pauses.get("preempted_seconds")),
            "data": _seconds(breakdown.get("data", 0.0))}


def step_causes(records: dict[int, dict], rank: int, excess_seconds: float | None) -> dict[str, float]:
    """Why ``rank`` stood out in a step whose ranks' step records are ``records``
    (``steptrace._attribution.straggler_causes``, the rule the collector applies too)."""
    return straggler_causes({r: _cause_seconds(record) for r, record in records.items()}, rank, excess_seconds)


def _gc_evidence(record: dict) -> dict | None:
    pauses = record.get("host_pauses")
    if not isinstance(pauses, dict) or not _seconds(pauses.get("gc_max_seconds")):
        return None
    return {"max_seconds": pauses["gc_max_seconds"], "generation": pauses.get("gc_max_generation"),
            "collections": pauses.get("gc_collections"), "seconds": pauses.get("gc_seconds")}


def straggler_steps(records_by_rank: dict[int, Sequence[dict]], world_size: int | None = None, *,
                    min_seconds: float = STRAGGLER_MIN_SECONDS,
                    min_ratio: float = STRAGGLER_MIN_RATIO,
                    noise_window_steps: int = STRAGGLER_NOISE_WINDOW) -> list[dict]:
    """One record per step that every rank (``0 .. world_size-1``, default: the ranks given) reported
    with status ok, in step order: ``step``, ``complete`` (True), ``interval_median_seconds``,
    ``rank_own_seconds``, ``straggler_rank`` (None when no rank stands out),
    ``straggler_cost_seconds``, ``straggler_excess_seconds``, ``straggler_threshold_seconds`` (the
    excess the step's candidate had to reach) and ``straggler_noise_seconds`` (the run's noise floor
    in it, None while unknown): the keys of the collector's ``cluster_step`` records; and, where a rank is
    named, ``straggler_causes`` (host cause -> its seconds beyond the other ranks' median, for the causes
    that explain a quarter of its excess: :func:`step_causes`) and ``straggler_gc`` (its largest
    collection in the step, when ``gc`` is one). The steps are
    judged in order by one :class:`~steptrace._attribution.StragglerRule`, as the collector judges
    them as they arrive."""
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
    rule = StragglerRule(noise_window_steps, min_seconds=min_seconds, min_ratio=min_ratio)
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
        verdict = rule.judge({r: (own[r], waits[r]) for r in records},
                             straggler_step_seconds(interval_median, compute_median, measured))
        found = verdict.straggler
        causes = None if found is None else step_causes(records, found.rank, found.excess_seconds)
        out.append({
            "step": step, "complete": True, "interval_median_seconds": interval_median,
            "rank_own_seconds": {str(r): own[r] for r in sorted(own)},
            **({"rank_collective_wait_seconds": {str(r): waits[r] for r in sorted(waits)}} if measured else {}),
            "straggler_rank": None if found is None else found.rank,
            "straggler_cost_seconds": None if found is None else found.cost_seconds,
            "straggler_excess_seconds": None if found is None else found.excess_seconds,
            "straggler_threshold_seconds": verdict.threshold_seconds,
            "straggler_noise_seconds": verdict.noise_seconds,
            "straggler_causes": causes,
            "straggler_gc": _gc_evidence(records[found.rank]) if causes and "gc" in causes else None,
        })
    return out


def _rank(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: The share cut from each end of the run's straggler's per-step hold-ups before they are averaged
#: (the interquartile mean), and the bootstrap that gives its interval (fixed seed: one answer per run).
COST_TRIM = 0.25
COST_BOOTSTRAP_RESAMPLES = 2000
COST_INTERVAL = 0.95


def _trimmed_mean(ordered: list[float], trim: float = COST_TRIM) -> float:
    cut = int(len(ordered) * trim)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def holdups(steps: Sequence[dict], rank: int) -> list[float]:
    """``rank``'s hold-up of the job in every complete step whose ranks all measured their wait: the
    other ranks' median wait in collectives less its own (negative where the others held it up).

    Every complete step, not only those it was named in: naming needs the hold-up to clear a bar, so
    the named steps' values are cut from below and their median is biased up."""
    out = []
    for step in steps:
        waits = step.get("rank_collective_wait_seconds")
        if step.get("complete") is not True or not isinstance(waits, dict) or str(rank) not in waits:
            continue
        values = {r: _seconds(v) for r, v in waits.items()}
        own = values[str(rank)]
        others = [v for r, v in values.items() if r != str(rank)]
        if own is None or not others or any(v is None for v in others):
            continue
        out.append(statistics.median(others) - own)  # type: ignore[type-var]
    return out


def cost_estimate(values: Sequence[float]) -> tuple[float, float, float] | None:
    """The run's straggler's cost per step from its per-step hold-ups (:func:`holdups`): their
    interquartile mean, with a 95 % percentile-bootstrap interval; None with fewer than 4.

    Robust to per-rank scheduling noise: on a loaded machine a rank's wait also holds its own wake-up
    after the collective completed, in some steps tens of ms, in either rank's wait. The median of the
    named steps' costs came out 57-90 % above an injected 30 ms in 3 of 6 two-rank gloo runs; the
    interquartile mean of every step's hold-up leaves out both tails (tests/test_torch_distributed.py)."""
    if len(values) < 4:
        return None
    import random

    ordered = sorted(values)
    rng = random.Random(0)
    means = sorted(_trimmed_mean(sorted(rng.choices(ordered, k=len(ordered))))
                   for _ in range(COST_BOOTSTRAP_RESAMPLES))
    tail = (1 - COST_INTERVAL) / 2
    return (_trimmed_mean(ordered), means[int(tail * (len(means) - 1))],
            means[int(round((1 - tail) * (len(means) - 1)))])


def summarize_stragglers(steps: Iterable[dict], *, window_steps: int = 100) -> dict:
    """The run's straggler verdict from its complete steps (``straggler_steps``' records or the
    collector's ``cluster_step`` ones).

    ``ranks``: per rank named, most often first: ``steps``, ``share_of_steps`` (of the complete
    steps), ``kind`` (``chronic``: the run's straggler, ``intermittent``, ``one-off``),
    ``persistent``, the median cost with its quartiles (``cost_q1_seconds``, ``cost_q3_seconds``),
    ``cost_total_seconds``, ``cost_share_of_step`` (median cost over the step's median interval),
    ``excess_median_seconds`` and ``threshold_median_seconds`` (the bar it cleared: fixed bounds and
    the run's noise floor). ``top``: the persistent rank, named in at least half of the complete steps
    (``steptrace._attribution.straggler_evidence``), or None: a job whose noise names each rank now
    and then has no straggler. ``noise_median_seconds``: the run's noise floor, median over its
    complete steps; ``rule``: the rule's settings. ``scores``: per rank over the last
    ``window_steps`` steps (``relative``, ``individual``: see
    ``steptrace._attribution.StragglerScores``)."""
    complete = [s for s in steps if s.get("complete") is True]
    scores = StragglerScores(window_steps)
    named: list[tuple[int, float | None, float | None, float | None]] = []
    floors: dict[int, list[float | None]] = {}  # per rank named: the noise floor of each of its steps
    shares: dict[int, list[float]] = {}
    causes: dict[int, dict[str, list[float]]] = {}
    largest_gc: dict[int, dict] = {}
    world = max((len(s["rank_own_seconds"]) for s in complete if isinstance(s.get("rank_own_seconds"), dict)),
                default=None)
    for step in complete:
        own = step.get("rank_own_seconds")
        if isinstance(own, dict):
            scores.add({int(r): float(v) for r, v in own.items() if _seconds(v) is not None})
        rank = _rank(step.get("straggler_rank"))
        if rank is None:
            continue
        cost = _seconds(step.get("straggler_cost_seconds"))
        floors.setdefault(rank, []).append(_seconds(step.get("straggler_noise_seconds")))
        named.append((rank, cost, _seconds(step.get("straggler_excess_seconds")),
                      _seconds(step.get("straggler_threshold_seconds"))))
        step_causes_ = step.get("straggler_causes")
        if isinstance(step_causes_, dict):
            for cause, seconds in step_causes_.items():
                if _seconds(seconds) is not None:
                    causes.setdefault(rank, {}).setdefault(str(cause), []).append(float(seconds))
        gc_evidence = step.get("straggler_gc")
        if isinstance(gc_evidence, dict) and _seconds(gc_evidence.get("max_seconds")) is not None and \
                gc_evidence["max_seconds"] > largest_gc.get(rank, {}).get("max_seconds", -1.0):
            largest_gc[rank] = {**gc_evidence, "step": step.get("step")}
        interval = _seconds(step.get("interval_median_seconds"))
        if cost is not None and interval:
            shares.setdefault(rank, []).append(cost / interval)
    evidence = straggler_evidence(named, len(complete))
    costs: dict[int, list[float]] = {}
    for rank, cost, _, _ in named:
        if cost is not None:
            costs.setdefault(rank, []).append(cost)
    ranks = {}
    for rank, facts in evidence.items():
        known = [f for f in floors.get(rank, []) if f is not None]
        estimate = cost_estimate(holdups(complete, rank)) if facts.persistent else None
        ranks[str(rank)] = {
            "steps": facts.steps,
            "share_of_steps": facts.share_of_steps,
            "kind": facts.kind,
            "persistent": facts.persistent,
            "cost_median_seconds": facts.cost_median_seconds,
            "cost_q1_seconds": facts.cost_q1_seconds,
            "cost_q3_seconds": facts.cost_q3_seconds,
            "cost_total_seconds": sum(costs[rank]) if rank in costs else None,
            "cost_share_of_step": statistics.median(shares[rank]) if rank in shares else None,
            "excess_median_seconds": facts.excess_median_seconds,
            "threshold_median_seconds": facts.threshold_median_seconds,
            # Why, on the host (docs/pauses.md): per cause, the named steps it explained and its median seconds
            # beyond the other ranks'; the largest collection in those steps.
            "causes": {cause: {"steps": len(values), "median_seconds": statistics.median(values)}
                       for cause, values in sorted(causes.get(rank, {}).items(), key=lambda kv: -len(kv[1]))},
            "largest_gc": largest_gc.get(rank),
            # Which check the steps it was named in passed: the fixed bounds always; the run's noise
            # floor only where it was known (with two ranks, the steps a rank leads give its own floor
            # no sample, so a chronic straggler's steps may never have one).
            "steps_above_noise": len(known),
            "steps_fixed_bounds_only": facts.steps - len(known),
            "noise_floor_median_seconds": statistics.median(known) if known else None,
            # The run's straggler only, where every rank measured its wait: its hold-up over every
            # complete step, robustly (cost_estimate), with its interval.
            "cost_seconds": None if estimate is None else estimate[0],
            "cost_ci_low_seconds": None if estimate is None else estimate[1],
            "cost_ci_high_seconds": None if estimate is None else estimate[2],
        }
    noise = [v for v in (_seconds(s.get("straggler_noise_seconds")) for s in complete) if v is not None]
    return {
        "complete_steps": len(complete),
        "steps_with_straggler": len(named),
        "ranks": ranks,
        "top": next((str(rank) for rank, facts in evidence.items() if facts.persistent), None),
        "noise_median_seconds": statistics.median(noise) if noise else None,
        "world_size": world,
        "rule": {"persistent_share": STRAGGLER_PERSISTENT_SHARE, "persistent_min_steps": STRAGGLER_PERSISTENT_MIN_STEPS,
                 "noise_k": STRAGGLER_NOISE_K, "noise_window_steps": STRAGGLER_NOISE_WINDOW,
                 "noise_min_samples": STRAGGLER_NOISE_MIN_SAMPLES},
        "scores": {str(r): {"relative": rel, "individual": ind} for r, (rel, ind) in sorted(scores.scores().items())},
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def _ms_range(low: float, high: float) -> str:
    return f"{_ms(low).removesuffix(' ms')}–{_ms(high)}"


def _why(facts: dict, *, short: bool = False) -> str:
    """The host causes of a named rank, e.g. "; why: gc in 5 of 6 steps (median 172 ms; largest a gen-2
    collection of 180 ms at step 1200)", or "" where none was measured to explain its excess."""
    causes = facts.get("causes") or {}
    if not causes:
        return ""
    named = facts.get("steps") or 0
    if short:
        return " (" + ", ".join(f"{cause} {_ms(c['median_seconds'])}" for cause, c in causes.items()) + ")"
    parts = []
    for cause, c in causes.items():
        part = f"{cause} in {c['steps']} of {named} step{'' if named == 1 else 's'} (median {_ms(c['median_seconds'])}"
        largest = facts.get("largest_gc")
        if cause == "gc" and largest:
            generation = largest.get("generation")
            kind = f"a gen-{generation} collection" if isinstance(generation, int) else "a collection"
            part += f"; largest {kind} of {_ms(largest['max_seconds'])} at step {largest.get('step')}"
        parts.append(part + ")")
    return "; why: " + ", ".join(parts)


def _checks(summary: dict, top: str, facts: dict) -> str:
    """What the steps the rank was named in were checked against: only what was checked is said."""
    threshold = facts.get("threshold_median_seconds")
    if threshold is None:
        return ""
    bar = f"threshold {_ms(threshold)}, median"
    above = facts.get("steps_above_noise")
    fixed = facts.get("steps_fixed_bounds_only")
    if above is None or fixed is None:  # a summary from before these counts: say no more than the bar
        return f", each above its step's threshold ({bar})"
    if not fixed:
        return f", each above the run's noise floor and the fixed bounds ({bar})"
    why = (" (with 2 ranks, the steps a rank leads give its own floor no sample)"
           if summary.get("world_size") == 2 else "")
    if not above:
        return f", each above the fixed bounds only ({bar}): the run had no noise floor for rank {top}{why}"
    return (f", each above the fixed bounds ({bar}); {above} of them also above the run's noise floor "
            f"(median {_ms(facts['noise_floor_median_seconds'])}), {fixed} before it had one{why}")


def straggler_sentence(summary: dict) -> str | None:
    """The report's one line, or None when there were no complete steps."""
    complete = summary.get("complete_steps") or 0
    if not complete:
        return None
    steps = f"{complete} step{'' if complete == 1 else 's'}"
    top = summary.get("top")
    if top is None:
        ranks = summary.get("ranks") or {}
        if not ranks:
            return f"no rank stood out in {steps} joined across ranks"
        most = ", ".join(f"rank {rank} in {facts['steps']}{_why(facts, short=True)}"
                         for rank, facts in list(ranks.items())[:3])
        return (f"none: no rank was named in half of {steps} joined across ranks (now and then, above the "
                f"run's noise: {most})")
    facts = summary["ranks"][top]
    share = f"named in {facts['share_of_steps'] * 100:.0f} % of {steps}" + _checks(summary, top, facts)
    if facts.get("cost_seconds") is not None:
        line = (f"rank {top} cost the job {_ms(facts['cost_seconds'])} per step (95 % CI "
                f"{_ms_range(facts['cost_ci_low_seconds'], facts['cost_ci_high_seconds'])}, interquartile mean "
                f"of its hold-up in every step)")
        if facts["cost_share_of_step"] is not None:
            line += f", {facts['cost_share_of_step'] * 100:.0f} % of its step time"
        return f"{line}: {share}{_why(facts)}"
    if facts["cost_median_seconds"] is not None:
        line = f"rank {top} cost the job {_ms(facts['cost_median_seconds'])} per step"
        if facts.get("cost_q1_seconds") is not None and facts.get("cost_q3_seconds") is not None:
            quartiles = _ms_range(facts["cost_q1_seconds"], facts["cost_q3_seconds"])
            line += f" (IQR {quartiles} over the steps it was named in)"
        if facts["cost_share_of_step"] is not None:
            line += f", {facts['cost_share_of_step'] * 100:.0f} % of its step time"
        return f"{line}: {share}{_why(facts)}"
    return (f"rank {top} was the slowest by {_ms(facts['excess_median_seconds'] or 0.0)} per step ({share}; its "
            "cost to the job is unknown: the ranks did not measure their wait in collectives)")
