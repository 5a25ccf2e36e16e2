"""Summaries of step records: totals, means, percentiles, goodput, idle by reason, per run and
across ranks. Pure functions over record dicts; only the standard library."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from steptrace._attribution import StepSplit, split_step


def as_number(value: Any) -> float | None:
    """Return *value* as a float if it is a real number (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)



_FLOPS_UNITS = ((1e3, "PFLOP/s"), (1.0, "TFLOP/s"), (1e-3, "GFLOP/s"), (1e-6, "MFLOP/s"), (1e-9, "kFLOP/s"))


def flops_rate(tflops_per_second: Any) -> str:
    """A FLOP rate given in TFLOP/s, in the unit that shows it with three significant figures
    (``0.0312`` -> ``31.2 GFLOP/s``; two decimals of TFLOP/s showed 0.00-0.03 on a small device)."""
    number = as_number(tflops_per_second)
    if number is None:
        return "—"
    if number == 0:
        return "0 TFLOP/s"
    # The largest unit the rate is at least 1 of (the smallest for a rate below it).
    scale, unit = next(((s, u) for s, u in _FLOPS_UNITS if abs(number) >= s), _FLOPS_UNITS[-1])
    value = abs(number) / scale
    text = f"{value:#.3g}".rstrip(".")
    if ("e" in text or float(text) >= 1000) and scale < _FLOPS_UNITS[0][0]:
        return flops_rate(math.copysign(1000 * scale, number))  # rounded up to the next unit (999.7 -> 1000)
    if value >= 1000:  # above the largest unit: all the digits
        text = f"{value:,.0f}"
    return f"{'-' if number < 0 else ''}{text} {unit}"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The *q*-th percentile (0-100) with linear interpolation, like numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def _sum_field(records: Iterable[dict], key: str) -> float:
    return sum(as_number(r.get(key)) or 0.0 for r in records)


def present_values(records: Iterable[dict], key: str) -> list[float]:
    """The numeric values of *key* in *records*, skipping records where it is missing or not a number."""
    return [v for v in (as_number(r.get(key)) for r in records) if v is not None]


def _seconds_by_name(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    numbers = {str(k): as_number(v) for k, v in value.items()}
    return {k: v for k, v in numbers.items() if v is not None}


def step_split(step: dict) -> StepSplit:
    """A step record as own compute + wait in collectives + host idle by reason (adding up to its
    interval; :func:`steptrace._attribution.split_step`), read defensively from a record dict."""
    wait_idle = step.get("collective_wait_idle_breakdown")
    return split_step(as_number(step.get("compute_seconds")) or 0.0, _seconds_by_name(step.get("idle_breakdown")),
                      as_number(step.get("collective_wait_seconds")), as_number(step.get("own_compute_seconds")),
                      _seconds_by_name(wait_idle) if isinstance(wait_idle, dict) else None)


def summarize(steps: Sequence[dict], checkpoints: Sequence[dict] = ()) -> dict:
    """Aggregate step and checkpoint records of one rank into a summary dict.

    Rates that need optional fields (tokens, flops, mfu) are None when no step
    carries them; they are computed only over the steps that do. The steps split into own compute
    (``own_compute_seconds``), time waiting for other ranks in collectives
    (``collective_wait_seconds``, None where no step measured it) and host idle by reason
    (``idle_breakdown_totals``, with the time before the first step, ``before_steps_seconds``).
    Goodput is not here: it divides by the wall from the process start, which step records alone
    do not hold (:mod:`steptrace.analysis.goodput`); ``compute_share_of_steps`` is Σ own compute /
    Σ interval, a different ratio.
    """
    before = _sum_field(steps, "before_step_seconds")
    interval = _sum_field(steps, "interval_seconds")
    compute = _sum_field(steps, "compute_seconds")

    idle_totals: dict[str, float] = {}
    own_compute = 0.0
    wait = 0.0
    host_idle = 0.0
    own_computes = []
    for step in steps:
        split = step_split(step)
        own_compute += split.own_compute_seconds
        if as_number(step.get("compute_seconds")) is not None:
            own_computes.append(split.own_compute_seconds)
        wait += split.collective_wait_seconds
        for reason, seconds in split.idle_breakdown.items():
            idle_totals[reason] = idle_totals.get(reason, 0.0) + seconds
            host_idle += seconds
        breakdown = step.get("before_step_breakdown")
        if isinstance(breakdown, dict):
            for reason, seconds in breakdown.items():
                value = as_number(seconds)
                if value is not None:
                    idle_totals[reason] = idle_totals.get(reason, 0.0) + value
    # Largest first: that is the order people read them in.
    idle_totals = dict(sorted(idle_totals.items(), key=lambda kv: -kv[1]))
    measured = any(as_number(s.get("collective_wait_seconds")) is not None for s in steps)

    with_tokens = [s for s in steps if as_number(s.get("tokens")) is not None]
    token_time = _sum_field(with_tokens, "interval_seconds")
    with_flops = [s for s in steps if as_number(s.get("flops")) is not None]
    flop_time = _sum_field(with_flops, "compute_seconds")
    flops = _flops_parts(steps)

    return {
        "steps": len(steps),
        "error_steps": sum(1 for s in steps if s.get("status") == "error"),
        "interval_seconds": interval,
        "compute_seconds": compute,
        "own_compute_seconds": own_compute,
        "collective_wait_seconds": wait if measured else None,
        # host idle within the steps, less the wait in collectives that fell in it
        "idle_seconds": host_idle,
        "before_steps_seconds": before,
        "compute_share_of_steps": own_compute / interval if interval > 0 else None,
        "idle_breakdown_totals": idle_totals,
        "compute_p50": percentile(present_values(steps, "compute_seconds"), 50),
        "compute_p90": percentile(present_values(steps, "compute_seconds"), 90),
        "interval_p50": percentile(present_values(steps, "interval_seconds"), 50),
        "own_compute_p50": percentile(own_computes, 50),
        "own_compute_p90": percentile(own_computes, 90),
        "tokens_per_second": (
            _sum_field(with_tokens, "tokens") / token_time
            if with_tokens and token_time > 0
            else None
        ),
        "tflops_per_second": (
            _sum_field(with_flops, "flops") / flop_time / 1e12
            if with_flops and flop_time > 0
            else None
        ),
        **flops,
        "checkpoints": len(checkpoints),
        "checkpoint_blocking_seconds": _sum_field(checkpoints, "blocking_seconds"),
        # s.log(...) scalars: the last value and the mean of each name
        "scalars": _scalar_summary(steps),
        # device memory, where the backend reported it: the largest peak and its share of the limit
        "memory_peak_bytes": max(present_values([s.get("device_memory") or {} for s in steps], "peak_bytes"),
                                 default=None),
        "memory_peak_percent": max(present_values([s.get("device_memory") or {} for s in steps], "peak_percent"),
                                   default=None),
    }


def _model_flops(step: dict) -> float | None:
    # Records written before model_flops existed carry the user's (model) count as `flops`.
    return as_number(step.get("model_flops") if "model_flops" in step else step.get("flops"))


def _flops_parts(steps: Sequence[dict]) -> dict:
    """MFU and HFU over the run with their parts: Σ FLOPs / Σ compute seconds / peak, each over the
    steps that carry that count (a weighted mean, like TFLOP/s), and the parts themselves."""
    peaks = present_values(steps, "peak_flops")
    peak = peaks[-1] if peaks else None
    parts: dict = {"peak_flops": peak}
    for kind, read in (("model", _model_flops), ("hardware", lambda s: as_number(s.get("hardware_flops")))):
        counted = [(read(s), as_number(s.get("compute_seconds"))) for s in steps]
        counted = [(f, c) for f, c in counted if f is not None and c is not None]
        total = sum(f for f, _ in counted)
        seconds = sum(c for _, c in counted)
        parts[f"{kind}_flops_per_step"] = total / len(counted) if counted else None
        parts[f"{kind}_tflops_per_second"] = total / seconds / 1e12 if counted and seconds > 0 else None
        ratio = "mfu" if kind == "model" else "hfu"
        if peak:
            parts[ratio] = total / seconds / peak if counted and seconds > 0 else None
        else:  # records without their peak (written before peak_flops existed): the steps' own ratios
            ratios = present_values(steps, ratio)
            parts[ratio] = sum(ratios) / len(ratios) if ratios else None
    sources = [s.get("flops_source") for s in steps if s.get("flops_source")]
    parts["flops_source"] = sources[-1] if sources else None
    return parts


def summarize_cluster(steps: Sequence[dict], late: Sequence[dict] = ()) -> dict:
    """Aggregate the collector's ``cluster_step`` records (one per step) into a summary dict.

    Straggler counts and skew percentiles cover complete steps only: in an
    incomplete step the missing rank may be the slowest, so the collector names
    no straggler for it.  Rank keys are strings (as in JSON).
    """
    complete = [s for s in steps if s.get("complete") is True]
    stragglers: dict[int, int] = {}
    for step in complete:
        rank = step.get("straggler_rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            stragglers[rank] = stragglers.get(rank, 0) + 1
    missing: dict[int, int] = {}
    for step in steps:
        ranks = step.get("missing_ranks")
        if isinstance(ranks, list):
            for rank in ranks:
                if isinstance(rank, int) and not isinstance(rank, bool):
                    missing[rank] = missing.get(rank, 0) + 1
    skews = present_values(complete, "skew_seconds")
    # The ranks' own compute where they measured their wait in collectives (records written before
    # own_compute_sum_seconds existed: their compute).
    compute = sum(as_number(s.get("own_compute_sum_seconds", s.get("compute_sum_seconds"))) or 0.0 for s in steps)
    interval = _sum_field(steps, "interval_sum_seconds")
    world_sizes = [int(w) for w in present_values(steps, "world_size")]
    return {
        "steps": len(steps),
        "complete_steps": len(complete),
        "incomplete_steps": len(steps) - len(complete),
        "late_spans": len(late),
        "world_size": max(world_sizes) if world_sizes else None,
        # Most frequent straggler first; a tie goes to the lower rank.
        "straggler_steps": {str(r): n for r, n in sorted(stragglers.items(), key=lambda kv: (-kv[1], kv[0]))},
        "missing_rank_steps": {str(r): n for r, n in sorted(missing.items(), key=lambda kv: (-kv[1], kv[0]))},
        "skew_p50": percentile(skews, 50),
        "skew_p90": percentile(skews, 90),
        "skew_max": max(skews) if skews else None,
        "compute_median_p50": percentile(present_values(complete, "compute_median_seconds"), 50),
        # Σ own compute / Σ interval over the joined steps' ranks: not goodput (no process start, no
        # time outside steps), named apart.
        "compute_share_of_steps": compute / interval if interval > 0 else None,
    }


def percent_text(value: float | None) -> str:
    """A ratio as ``12.3%`` for tables and titles (``—`` when unknown)."""
    return "—" if value is None else f"{value * 100:.1f}%"


def _scalar_summary(steps: Sequence[dict]) -> dict[str, dict[str, float]]:
    values: dict[str, list[float]] = {}
    for step in steps:
        scalars = step.get("scalars")
        if isinstance(scalars, dict):
            for name, value in scalars.items():
                number = as_number(value)
                if number is not None:
                    values.setdefault(str(name), []).append(number)
    return {name: {"last": v[-1], "mean": sum(v) / len(v)} for name, v in values.items()}


def _attempt_firsts(steps: Sequence[dict]) -> set[int]:
    """ids of each attempt's first step in ``steps`` (in record order)."""
    seen: set[Any] = set()
    firsts = set()
    for step in steps:
        attempt = step.get("attempt", 0)
        if attempt not in seen:
            seen.add(attempt)
            firsts.add(id(step))
    return firsts


def typical_step_interval(steps: Sequence[dict]) -> float | None:
    """The run's typical step interval (seconds), one rank's: the median ``interval_seconds`` of its
    ``ok`` steps that carry no one-off cost, i.e. neither the first step of an attempt nor the first
    after a restore (compile, graph capture, warm-up). ``steps``: the rank's kept steps. None when
    no such step is left."""
    firsts = _attempt_firsts(steps)
    intervals = [as_number(s.get("interval_seconds")) for s in steps
                 if s.get("status", "ok") == "ok" and id(s) not in firsts and not s.get("first_after_restore")]
    return percentile([v for v in intervals if v is not None], 50)


def after_restore_costs(steps: Sequence[dict]) -> list[dict]:
    """Each step marked ``first_after_restore`` in one rank's kept ``steps``, with its one-off cost::

        one_off_seconds = max(0, interval_seconds - typical_step_interval_seconds)

    (:func:`typical_step_interval`; None when the run has no typical step). ``one_off_compute_seconds``
    is the part the step's own compute held, ``max(0, own compute - typical interval)``: the job's
    accounting charges it to ``startup`` instead of productive time (the rest of the one-off is idle
    by reason, already badput; docs/goodput.md)."""
    marked = [s for s in steps if s.get("first_after_restore")]
    if not marked:
        return []
    typical = typical_step_interval(steps)
    costs = []
    for step in marked:
        interval = as_number(step.get("interval_seconds"))
        own = step_split(step).own_compute_seconds
        costs.append({
            "attempt": step.get("attempt", 0), "step": step.get("step"), "interval_seconds": interval,
            "typical_step_interval_seconds": typical,
            "one_off_seconds": None if typical is None or interval is None else max(0.0, interval - typical),
            "one_off_compute_seconds": None if typical is None else max(0.0, own - typical),
        })
    return costs


def compute_beside_commits(steps: Sequence[dict], checkpoints: Sequence[dict]) -> list[dict]:
    """The steps an asynchronous checkpoint commit ran beside, and their compute against the rank's
    typical step's, one entry per async save (issue 49)::

        {"step", "async_seconds", "steps": [n, ...], "compute_seconds": Σ their compute,
         "typical_compute_seconds": the median compute of the ok steps beside no commit (first steps of
         an attempt and after a restore left out), "ratio": Σ / (typical × len(steps))}

    A commit window is ``[end_time, end_time + async_seconds]`` (the save's return to the commit's end);
    a step is beside it where its device window ``[start_time, end_time]`` overlaps it. Measured on JAX
    CPU against the XLA trace (docs/devices.md), a step beside orbax's commit really computes longer (the
    device is the host's cores, which the commit's threads share), and its observed end can be late by a
    garbage collection on the commit's thread. Saves without ``async_seconds``, and runs with no step
    beside no commit, give nothing."""
    windows = []
    for ckpt in checkpoints:
        commit, saved = as_number(ckpt.get("async_seconds")), as_number(ckpt.get("end_time"))
        if commit and commit > 0 and saved is not None:
            windows.append((ckpt, saved, saved + commit))
    if not windows:
        return []
    firsts = _attempt_firsts(steps)

    def beside(step: dict, start: float, end: float) -> bool:
        begin, finish = as_number(step.get("start_time")), as_number(step.get("end_time"))
        return begin is not None and finish is not None and begin < end and finish > start

    ok = [s for s in steps if s.get("status", "ok") == "ok" and as_number(s.get("compute_seconds")) is not None]
    typical = percentile([as_number(s.get("compute_seconds")) for s in ok  # type: ignore[misc]
                          if id(s) not in firsts and not s.get("first_after_restore")
                          and not any(beside(s, a, b) for _, a, b in windows)], 50)
    out = []
    for ckpt, start, end in windows:
        near = [s for s in ok if beside(s, start, end) and id(s) not in firsts]
        if not near or not typical:
            continue
        compute = sum(as_number(s.get("compute_seconds")) or 0.0 for s in near)
        out.append({"step": ckpt.get("step"), "async_seconds": end - start, "steps": [s.get("step") for s in near],
                    "compute_seconds": compute, "typical_compute_seconds": typical,
                    "ratio": compute / (typical * len(near))})
    return out


#: The JAX compile event that is one XLA compilation (the other two, the trace and the lowering, precede it).
BACKEND_COMPILE_EVENT = "backend_compile_duration"


def compile_by_function(spans: Iterable[dict]) -> dict[str, dict]:
    """Compile time by the jitted function compiled (the ``compile`` spans' ``attrs.function``,
    adapters/jax.py), largest first: ``{function: {"seconds", "compiles", "steps", "programs",
    "recompiles", "recompile_steps"}}``. ``seconds``: the host time the training thread spent tracing,
    lowering and compiling it; ``compiles``: its XLA compilations (backend compile events); ``steps``:
    the step each compilation happened in (null: outside every step, before the first or between two).

    A function is compiled once per signature (input shapes, dtypes, shardings, static arguments), each
    a different program: compiling it for a new one is not a recompile. The backend compile's
    ``attrs.program`` (a hash of the lowered program) tells them apart: ``programs`` counts the distinct
    programs, ``recompiles`` the compilations of a program already compiled (a cache miss: ``jax.jit``
    of a new function object each step, ``jax.clear_caches()``), at ``recompile_steps``. Where a
    compile has no fingerprint (records from older steptrace), the records cannot tell the two apart:
    ``programs`` and ``recompiles`` are null. Compile spans without a function (older JAX) are
    ``unnamed``."""
    out: dict[str, dict] = {}
    seen: dict[str, set] = {}
    for span in spans:
        if span.get("name") != "compile":
            continue
        attrs = span.get("attrs") if isinstance(span.get("attrs"), dict) else {}
        function = attrs.get("function")
        name = str(function) if isinstance(function, str) and function else "unnamed"
        entry = out.setdefault(name, {"seconds": 0.0, "compiles": 0, "steps": [], "programs": 0,
                                      "recompiles": 0, "recompile_steps": []})
        entry["seconds"] += as_number(span.get("seconds")) or 0.0
        if attrs.get("event") != BACKEND_COMPILE_EVENT:
            continue
        step = span.get("step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        entry["compiles"] += 1
        entry["steps"].append(step)
        program = attrs.get("program")
        if not isinstance(program, str) or entry["programs"] is None:
            entry["programs"] = entry["recompiles"] = None
            entry["recompile_steps"] = []
            continue
        programs = seen.setdefault(name, set())
        if program in programs:
            entry["recompiles"] += 1
            entry["recompile_steps"].append(step)
        else:
            programs.add(program)
            entry["programs"] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))


def where_compiled(steps: list) -> str:
    """The steps compilations happened in, each place once with its count, in order of first
    appearance: ``outside a step (5×), step 0, step 7``."""
    counts: dict[int | None, int] = {}
    for step in steps:
        counts[step] = counts.get(step, 0) + 1
    return ", ".join(("outside a step" if step is None else f"step {step}") + (f" ({n}×)" if n > 1 else "")
                     for step, n in counts.items())


def compile_sentence(by_function: dict[str, dict], limit: int = 8) -> str:
    """One line naming each function's compile time; a function compiled more than once says for how
    many programs (signatures) and where, and names true recompiles (the same program compiled again)
    apart. Without program fingerprints it says only how many times."""
    parts = []
    for function, entry in list(by_function.items())[:limit]:
        text = f"{function} {entry['seconds']:.3f} s"
        compiles, programs = entry["compiles"], entry.get("programs")
        if compiles > 1 and programs is None:
            text += f" (compiled {compiles}×: {where_compiled(entry['steps'])})"
        elif compiles > 1:
            notes = []
            if programs > 1:
                notes.append(f"compiled for {programs} signatures: {where_compiled(entry['steps'])}")
            if entry["recompiles"]:
                notes.append(f"the same program recompiled {entry['recompiles']}×: "
                             f"{where_compiled(entry['recompile_steps'])}")
            text += f" ({'; '.join(notes)})"
        parts.append(text)
    more = len(by_function) - limit
    if more > 0:
        parts.append(f"{more} more")
    return "; ".join(parts)
