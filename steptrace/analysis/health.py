"""GPU health per rank, and the cause it gives the straggler verdict (docs/health.md).

The ranks' step records carry the GPU's health over sampling windows (``health``, steptrace/_health.py);
the collector's ``cluster_step`` records carry the same windows per rank (``rank_health``). Per rank,
:func:`summarize_health` weighs each window by the steps that share it (``window_steps``) or its
length, and :func:`straggler_cause` compares the run's straggler with the other ranks: a GPU cause is
claimed only above noise (DESIGN: verdicts carry their evidence):

* a throttle: a clock-reducing policy (thermal, power, board limit, reliability, sync boost) or clocks-
  event reason held the straggler's clocks in at least ``CLAIM_MIN_SHARE`` of its steps, and in
  ``CLAIM_MIN_MARGIN`` more of them than on the median other rank (a hot room throttles everyone);
* a lower SM clock: its mean ``CLOCK_MIN_DEFICIT`` below the other ranks' median and below every
  other rank's;
* GPU errors: any Xid, uncorrected ECC error, uncorrectable remapped row or NVLink error on it.

Else, where its GPU was sampled, the sentence says "its GPU shows no throttling or errors (no GPU
anomaly): look at its host (data, CPU)".
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from steptrace._health import THROTTLED_PERCENT

__all__ = ["health_lines", "rank_windows", "straggler_cause", "summarize_health"]

#: The share of the straggler's steps a throttle must cover to be named ...
CLAIM_MIN_SHARE = 0.2
#: ... and how much more than on the median other rank.
CLAIM_MIN_MARGIN = 0.1
#: A lower SM clock is a cause when its mean is this far below the others' median (and below all of them).
CLOCK_MIN_DEFICIT = 0.05
SLOWING_POLICIES = ("thermal", "power", "board_limit", "reliability", "sync_boost")
#: Clocks-event reasons that hold the clocks down (steptrace._health.SLOWING_REASONS), by name.
SLOWING_REASONS = ("hw_slowdown", "hw_thermal", "sw_thermal", "sw_power_cap", "hw_power_brake")
_REASON_BITS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
                "hw_power_brake": 0x80}
ERRORS = (("xid_events", "Xid event"), ("ecc_uncorrected_volatile_errors", "uncorrected ECC error"),
          ("remapped_rows_uncorrectable", "uncorrectable remapped row"), ("nvlink_errors", "NVLink error"))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rank_windows(records_by_rank: dict[int, list[dict]], cluster_steps: Iterable[dict] = ()) -> dict[int, list[dict]]:
    """Each rank's health windows: from its step records, else from the collector's ``rank_health``."""
    windows: dict[int, list[dict]] = {}
    for rank, records in records_by_rank.items():
        found = [r["health"] for r in records if r.get("type") == "step" and isinstance(r.get("health"), dict)]
        if found:
            windows[rank] = found
    if windows:
        return windows
    for step in cluster_steps:
        for rank, health in (step.get("rank_health") or {}).items():
            if isinstance(health, dict):
                windows.setdefault(int(rank), []).append(health)
    return windows


def _weighted_mean(pairs: list[tuple[float, float]]) -> float | None:
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else None


def summarize_health(windows: list[dict]) -> dict[str, Any]:
    """One rank's GPU health over its windows (``report --json``'s ``health``): ``steps`` and
    ``seconds`` covered; ``throttled_share_of_steps`` per policy and clocks-event reason (the share of
    its steps in windows where it held the clocks); ``violation_percent`` per policy (of the time);
    SM clock mean/min, memory clock mean, temperature max, power mean (W), energy per step (J); error
    counts; ``unsupported``: field -> the NVML error, for fields the GPU did not report."""
    steps = seconds = 0.0
    throttled: dict[str, list[tuple[float, float]]] = {}
    percent: dict[str, list[tuple[float, float]]] = {}
    sm: list[tuple[float, float]] = []
    mem: list[tuple[float, float]] = []
    power: list[tuple[float, float]] = []
    sm_min: list[float] = []
    temp: list[float] = []
    energy = energy_steps = 0.0
    errors: dict[str, float | None] = {key: None for key, _ in ERRORS}
    last_xid = None
    unsupported: dict[str, str] = {}
    for window in windows:
        weight = max(1.0, _number(window.get("window_steps")) or 1.0)
        length = _number(window.get("window_seconds")) or 0.0
        steps += weight
        seconds += length
        for policy, value in (window.get("violation_percent") or {}).items():
            value = _number(value)
            if value is not None:
                throttled.setdefault(policy, []).append((1.0 if value >= THROTTLED_PERCENT else 0.0, weight))
                percent.setdefault(policy, []).append((value, length))
        mask = _number(window.get("clocks_event_reasons"))
        if mask is not None:
            for name, bit in _REASON_BITS.items():
                throttled.setdefault(name, []).append((1.0 if int(mask) & bit else 0.0, weight))
        for key, into in (("sm_clock_mhz_mean", sm), ("memory_clock_mhz_mean", mem), ("power_watts_mean", power)):
            value = _number(window.get(key))
            if value is not None:
                into.append((value, length or 1.0))
        value = _number(window.get("sm_clock_mhz_min"))
        if value is not None:
            sm_min.append(value)
        value = _number(window.get("temperature_c_max"))
        if value is not None:
            temp.append(value)
        value = _number(window.get("energy_joules"))
        if value is not None:
            energy += value
            energy_steps += weight
        for key, _ in ERRORS:
            value = _number(window.get(key))
            if value is not None:
                errors[key] = (errors[key] or 0.0) + value
        if _number(window.get("last_xid")) is not None:
            last_xid = int(window["last_xid"])
        unsupported.update({str(k): str(v) for k, v in (window.get("unsupported") or {}).items()})
    return {
        "windows": len(windows),
        "steps": int(steps),
        "seconds": seconds,
        "throttled_share_of_steps": {k: _weighted_mean(v) for k, v in sorted(throttled.items())},
        "violation_percent": {k: _weighted_mean(v) for k, v in sorted(percent.items())},
        "sm_clock_mhz_mean": _weighted_mean(sm),
        "sm_clock_mhz_min": min(sm_min) if sm_min else None,
        "memory_clock_mhz_mean": _weighted_mean(mem),
        "temperature_c_max": max(temp) if temp else None,
        "power_watts_mean": _weighted_mean(power),
        "energy_joules_per_step": energy / energy_steps if energy_steps else None,
        "errors": {key: None if value is None else int(value) for key, value in errors.items()},
        "last_xid": last_xid,
        "unsupported": unsupported,
    }


def straggler_cause(top: str | None, summaries: dict[int, dict]) -> dict[str, Any] | None:
    """What the straggler's GPU says, beside the other ranks': ``{"rank", "gpu_anomaly", "causes",
    "clause"}``; None without a straggler or without its GPU's health. See the module docstring."""
    if top is None or int(top) not in summaries:
        return None
    rank = int(top)
    mine = summaries[rank]
    others = [s for r, s in summaries.items() if r != rank]
    causes: list[str] = []
    evidence: dict[str, Any] = {}
    shares = mine["throttled_share_of_steps"]
    for name in (*SLOWING_POLICIES, *SLOWING_REASONS):
        share = shares.get(name)
        if share is None:
            continue
        theirs = [o["throttled_share_of_steps"].get(name) for o in others]
        known = [v for v in theirs if v is not None]
        reference = statistics.median(known) if known else 0.0
        if share >= CLAIM_MIN_SHARE and share - reference >= CLAIM_MIN_MARGIN:
            label = f"{name.replace('_', ' ')} violation" if name in SLOWING_POLICIES else \
                f"clocks event {name.replace('_', ' ')}"
            causes.append(f"{label} in {share * 100:.0f} % of its steps"
                          + (f" ({reference * 100:.0f} % on the others)" if reference >= 0.005 else ""))
            evidence[name] = {"share_of_steps": share, "others_median_share": reference}
    clock = mine.get("sm_clock_mhz_mean")
    their_clocks = [o["sm_clock_mhz_mean"] for o in others if o.get("sm_clock_mhz_mean") is not None]
    if clock is not None and their_clocks:
        reference = statistics.median(their_clocks)
        if clock < reference * (1 - CLOCK_MIN_DEFICIT) and clock < min(their_clocks):
            causes.append(f"SM clock {clock:.0f} vs {reference:.0f} MHz on the others")
            evidence["sm_clock_mhz"] = {"straggler": clock, "others_median": reference}
    for key, label in ERRORS:
        count = mine["errors"].get(key)
        if count:
            text = f"{count} {label}{'' if count == 1 else 's'}"
            if key == "xid_events" and mine.get("last_xid") is not None:
                text += f" (latest Xid {mine['last_xid']})"
            causes.append(text)
            evidence[key] = count
    if causes:
        clause = "its GPU: " + ", ".join(causes)
    else:
        clause = "its GPU shows no throttling or errors (no GPU anomaly): look at its host (data, CPU)"
    return {"rank": rank, "gpu_anomaly": bool(causes), "causes": causes, "evidence": evidence, "clause": clause,
            "rule": {"throttled_percent": THROTTLED_PERCENT, "min_share": CLAIM_MIN_SHARE,
                     "min_margin": CLAIM_MIN_MARGIN, "clock_min_deficit": CLOCK_MIN_DEFICIT}}


def _fmt(value: float | None, unit: str, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f} {unit}"


def health_lines(summaries: dict[int, dict], max_ranks: int = 8) -> list[str]:
    """One line per rank for the report: power in W (NVML's mW converted), energy per step, clocks,
    temperature, the throttles and errors seen, what the GPU did not report."""
    lines = []
    for rank in sorted(summaries)[:max_ranks]:
        s = summaries[rank]
        parts = [f"power {_fmt(s['power_watts_mean'], 'W', 1)} mean",
                 f"energy {_fmt(s['energy_joules_per_step'], 'J', 2)}/step",
                 f"SM clock {_fmt(s['sm_clock_mhz_mean'], 'MHz')} mean ({_fmt(s['sm_clock_mhz_min'], 'MHz')} min)",
                 f"temperature max {_fmt(s['temperature_c_max'], '°C')}"]
        throttles = [f"{name.replace('_', ' ')} {share * 100:.0f} % of steps"
                     for name, share in s["throttled_share_of_steps"].items()
                     if share and name != "low_utilization"]
        parts.append("throttled: " + (", ".join(throttles) if throttles else "none"))
        errors = [f"{label}s {count}" for key, label in ERRORS if (count := s["errors"].get(key))]
        parts.append("errors: " + (", ".join(errors) if errors else "none"))
        if s["unsupported"]:
            parts.append("not reported: " + ", ".join(sorted(s["unsupported"])))
        lines.append(f"rank {rank}: " + "; ".join(parts) + f" ({s['steps']} steps, {s['windows']} windows)")
    return lines
