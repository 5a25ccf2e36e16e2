"""``steptrace compare RUN_A RUN_B``: the main-vs-branch table, with true numbers and a verdict on noise.

Each row is one metric of run A (the baseline) and run B: both values, the difference B − A, the
relative difference, and a verdict:

* ``regression`` / ``improvement``: the two runs differ by more than their noise **and** by at
  least ``min_effect`` (default 2 %) of A's value; which of the two depends on the metric's
  direction (times: lower is better; throughput: higher is better). The noise test respects
  autocorrelation: steps within a run are not independent samples (load drifts), so the
  steady-state steps are cut into at most 20 blocks of consecutive steps (batch means, at least
  5 steps each), each reduced to the row's median or mean, and a Welch t-test compares the two
  runs' blocks (on a log scale when all are positive: changes are relative), each side's
  variance widened by its blocks' (bias-corrected) lag-1 autocorrelation, the AR(1) factor
  (1 + r) / (1 − r) (p < ``alpha``, default 0.01). Two runs recorded together on one host
  (taking turns, or side by side) share the machine's drift and are compared window by window
  instead (:func:`paired_block_test_p`). With several runs a side (seeds, repeats:
  ``--a``/``--b``), each run is one sample and the test weighs the difference against the
  run-to-run spread;
* ``noise``: no change beyond the noise, or a difference below ``min_effect``;
* ``—``: a metric with one value per run (totals, final loss) has no per-step distribution to
  test; its difference is shown without a verdict.

Steady state, by construction: a step counts when its status is ``ok``, it is not the rank's
first step (which carries compilation and warm-up), and no compile, checkpoint or eval time fell
in its idle window. Intervals, compute, tokens/s, TFLOP/s and MFU rows use steady-state steps of
the default rank (rank 0 when present); run-wide totals (idle by reason, compile, checkpoints) use
every step. Goodput is the run's one goodput (:func:`steptrace.analysis.goodput.job_goodput`: every
rank's own compute of the kept steps over its wall from the process start, across attempts), the
figure ``steptrace report`` prints. Cross-rank skew comes from the collector's ``cluster.jsonl``
when both runs have one.

The rows where the runs' ``metadata`` differ (versions, devices, git commit, tags) follow the
table: a difference there is often the explanation.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from steptrace.analysis._text import code_span, literal_text, visible
from steptrace.analysis.runs import Run, RunDirError, find_run, load_run
from steptrace.analysis.goodput import job_goodput
from steptrace.analysis.summary import as_number, present_values, percentile, step_split

__all__ = ["Row", "block_test_p", "block_values", "compare_runs", "mann_whitney_p", "paired_block_test_p",
           "runs_test_p", "steady_steps", "t_test_p", "add_compare_arguments", "run_compare", "main"]

#: Idle reasons that make a step not steady-state.
UNSTEADY_REASONS = ("compile", "checkpoint", "eval")
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.02
DEFAULT_METRIC = "interval_median"
#: Batch means: at most this many blocks per run, of at least DEFAULT_MIN_BLOCK steps each.
DEFAULT_MAX_BLOCKS = 20
DEFAULT_MIN_BLOCK = 5
#: The blocks' lag-1 autocorrelation is capped here (a 9x wider variance) when widening.
MAX_BLOCK_AUTOCORRELATION = 0.8
#: From this many blocks on, the lag-1 estimate is bias-corrected.
BIAS_CORRECTION_BLOCKS = 10


# -- statistics ------------------------------------------------------------------------------
def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of the Mann–Whitney U test (normal approximation, tie-corrected, with
    continuity correction); None with fewer than 3 values on a side. No longer behind verdicts:
    over the steps of two runs it takes drift for a change (see :func:`block_test_p`)."""
    n1, n2 = len(a), len(b)
    if n1 < 3 or n2 < 3:
        return None
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(pooled)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        average = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = average
        t = j - i + 1
        tie_term += t ** 3 - t
        i = j + 1
    rank_sum_a = sum(r for r, (_, side) in zip(ranks, pooled) if side == 0)
    u = rank_sum_a - n1 * (n1 + 1) / 2
    n = n1 + n2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:
        return 1.0
    z = (abs(u - mean) - 0.5) / math.sqrt(variance)
    return max(0.0, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2))))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-12:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_test_p(t: float, df: float) -> float:
    """Two-sided p-value of Student's t statistic *t* with *df* degrees of freedom."""
    if math.isnan(t) or df <= 0:
        return 1.0
    if math.isinf(t):
        return 0.0
    return max(0.0, min(1.0, _betainc(df / 2.0, 0.5, df / (df + t * t))))


def _variance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def _lag1(values: Sequence[float]) -> float:
    """Lag-1 autocorrelation of *values* (0 for a constant series)."""
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    denominator = sum(c * c for c in centred)
    if denominator <= 0:
        return 0.0
    return sum(x * y for x, y in zip(centred, centred[1:])) / denominator


def block_values(values: Sequence[float], summary: Callable[[Sequence[float]], float | None],
                 max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> list[float]:
    """*values* (in step order) cut into consecutive blocks of at least *min_block* steps, at most
    *max_blocks* blocks, each reduced by *summary* (the row's median or mean): the batch means.

    Steps within a run are autocorrelated (load drifts), so single steps are not independent
    samples; blocks of consecutive steps are much closer to it, and fewer blocks of more steps
    each get closer still (batch means: a fixed number of batches, whose size grows with the run).
    """
    n = len(values)
    size = max(min_block, -(-n // max_blocks))
    count = n // size
    blocks = []
    for index in range(count):
        # The last block takes the remainder: every step is in exactly one block.
        chunk = values[index * size:(index + 1) * size if index < count - 1 else n]
        value = summary(chunk)
        if value is not None:
            blocks.append(value)
    return blocks


def _side_spread(blocks: Sequence[float]) -> tuple[float, float]:
    """(variance of the side's mean, its count of blocks) from block values, the variance widened
    by the blocks' own positive lag-1 autocorrelation r (bias-corrected): drift slower than a
    block leaves neighbouring blocks alike, so their mean varies more than independent blocks'
    would, by the AR(1) factor (1 + r) / (1 - r). The degrees of freedom stay those of the blocks:
    also cutting them by that factor made a 10 % regression under drift a coin toss (80 % found
    against 98 %) for a false-alarm rate of 0.9 % against 1.4 % (tests/test_compare.py's model)."""
    k = len(blocks)
    return _variance(blocks) / k * _widening(blocks), k


def _widening(blocks: Sequence[float]) -> float:
    """The AR(1) factor (1 + r) / (1 - r) of *blocks*' positive lag-1 autocorrelation r (see
    :func:`_side_spread`); 1 for fewer than 4 values."""
    k = len(blocks)
    r = 0.0
    if k >= 4:
        r = _lag1(blocks)
        if k >= BIAS_CORRECTION_BLOCKS:
            # The lag-1 estimate from k values is biased low by about (1 + 3r) / k (Marriott and
            # Pope): uncorrected, drift would pass for independence exactly when it matters. From
            # fewer blocks the correction is noisier than the bias it removes.
            r += (1.0 + 3.0 * max(r, 0.0)) / k
    r = min(max(r, 0.0), MAX_BLOCK_AUTOCORRELATION)
    return (1.0 + r) / (1.0 - r)


def _logs(a: list[float], b: list[float]) -> tuple[list[float], list[float]]:
    """Both samples' logarithms when every value is positive (times, rates), else as they are.

    Step times are skewed to the right (a busy machine adds stalls, never takes time away) and
    their changes are relative: on a log scale a slow spell weighs as much as a fast one.
    """
    if all(v > 0 for v in a) and all(v > 0 for v in b):
        return [math.log(v) for v in a], [math.log(v) for v in b]
    return a, b


def _mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def block_test_p(a: Sequence[float], b: Sequence[float],
                 summary: Callable[[Sequence[float]], float | None] = _mean_or_none,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> float | None:
    """Two-sided p-value that two runs' per-step *a*, *b* (in step order) differ, respecting
    autocorrelation: a Welch t-test on block values (:func:`block_values`; their logarithms when all
    are positive), each side's variance widened by its blocks' lag-1 autocorrelation. None with
    fewer than 2 blocks on a side."""
    blocks_a, blocks_b = _logs(block_values(a, summary, max_blocks, min_block),
                               block_values(b, summary, max_blocks, min_block))
    if len(blocks_a) < 2 or len(blocks_b) < 2:
        return None
    (var_a, n_a), (var_b, n_b) = _side_spread(blocks_a), _side_spread(blocks_b)
    return _welch(sum(blocks_a) / len(blocks_a), var_a, n_a, sum(blocks_b) / len(blocks_b), var_b, n_b)


def _welch(mean_a: float, var_a: float, n_a: float, mean_b: float, var_b: float, n_b: float) -> float:
    """Welch's test from each side's mean, the variance of that mean and its (effective) count."""
    spread = var_a + var_b
    if spread <= 0:
        return 1.0 if mean_a == mean_b else 0.0
    t = (mean_b - mean_a) / math.sqrt(spread)
    # Welch–Satterthwaite degrees of freedom, at least 1.
    terms = (var_a ** 2 / max(n_a - 1, 1e-9) if var_a > 0 else 0.0) + (var_b ** 2 / max(n_b - 1, 1e-9) if var_b > 0
                                                                        else 0.0)
    df = max(1.0, spread ** 2 / terms) if terms > 0 else 1.0
    return t_test_p(t, df)


def paired_block_test_p(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]],
                        summary: Callable[[Sequence[float]], float | None] = _mean_or_none,
                        max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> float | None:
    """Two-sided p-value that two runs recorded at the same time differ, from ``(end_time, value)``
    per step: both runs' steps in the time they share, in time order, are cut into windows of
    consecutive steps (at most *max_blocks*, about *min_block* steps of each run apiece); each
    window gives the ratio of B's to A's *summary* (its log; the difference when a value is not
    positive), and a t-test asks whether those are centred on 0, their variance widened for lag-1
    autocorrelation like :func:`block_test_p`'s. A slow spell of the machine slows both runs in
    the same window and cancels. Windows hold equal numbers of steps, not equal time, so that a
    window in a slow spell still holds both runs' steps. None with fewer than 2 windows."""
    if not a or not b:
        return None
    start = max(min(t for t, _ in a), min(t for t, _ in b))
    end = min(max(t for t, _ in a), max(t for t, _ in b))
    merged = sorted([(t, 0, v) for t, v in a if start <= t <= end] + [(t, 1, v) for t, v in b if start <= t <= end])
    count = min(max_blocks, sum(1 for _, side, _ in merged if side == 0) // min_block,
                sum(1 for _, side, _ in merged if side == 1) // min_block)
    if end <= start or count < 2:
        return None
    positive = all(v > 0 for _, _, v in merged)
    differences = []
    for index in range(count):
        window = merged[index * len(merged) // count:(index + 1) * len(merged) // count]
        va = summary([v for _, side, v in window if side == 0]) if any(s == 0 for _, s, _ in window) else None
        vb = summary([v for _, side, v in window if side == 1]) if any(s == 1 for _, s, _ in window) else None
        if va is not None and vb is not None:
            differences.append(math.log(vb) - math.log(va) if positive else vb - va)
    if len(differences) < 2:
        return None
    variance, k = _side_spread(differences)
    mean = sum(differences) / len(differences)
    if variance <= 0:
        return 1.0 if mean == 0 else 0.0
    return t_test_p(mean / math.sqrt(variance), k - 1)


def runs_test_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value that per-run values *a* and *b* (one per seed or repeat) differ: Welch's
    t-test when both sides have 2 or more runs, else Student's with the pooled run-to-run spread
    (one run against several). None with 3 runs or fewer in all, or one run on each side."""
    n_a, n_b = len(a), len(b)
    if n_a + n_b < 3 or n_a < 1 or n_b < 1:
        return None
    a, b = _logs(list(a), list(b))
    mean_a, mean_b = sum(a) / n_a, sum(b) / n_b
    if n_a >= 2 and n_b >= 2:
        return _welch(mean_a, _variance(a) / n_a, n_a, mean_b, _variance(b) / n_b, n_b)
    squares = sum((v - mean_a) ** 2 for v in a) + sum((v - mean_b) ** 2 for v in b)
    df = n_a + n_b - 2
    pooled = squares / df
    spread = pooled * (1 / n_a + 1 / n_b)
    if spread <= 0:
        return 1.0 if mean_a == mean_b else 0.0
    return t_test_p((mean_b - mean_a) / math.sqrt(spread), df)


# -- what is compared --------------------------------------------------------------------------
def steady_steps(steps: Sequence[dict]) -> list[dict]:
    """The steady-state steps (see the module docstring)."""
    ordered = sorted(steps, key=lambda s: as_number(s.get("step")) or 0)
    steady = []
    for index, step in enumerate(ordered):
        if index == 0 or step.get("status") != "ok":
            continue
        breakdown = step.get("idle_breakdown") or {}
        if any((as_number(breakdown.get(reason)) or 0.0) > 0 for reason in UNSTEADY_REASONS):
            continue
        steady.append(step)
    return steady


@dataclass
class Row:
    metric: str  # a stable key, used by --metric
    label: str
    a: float | None
    b: float | None
    unit: str = ""
    lower_is_better: bool | None = True  # None: no direction (a count)
    p_value: float | None = None
    verdict: str = "—"

    @property
    def diff(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def relative(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / abs(self.a)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "diff": self.diff, "relative": self.relative}


def _per_step(steps: Sequence[dict], fn: Callable[[dict], float | None]) -> list[float]:
    return [v for v in (fn(s) for s in steps) if v is not None]


def _median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _loss(step: dict) -> float | None:
    scalars = step.get("scalars")
    return as_number(scalars.get("loss")) if isinstance(scalars, dict) else None


def _bubble(step: dict) -> float | None:
    ratios = step.get("pipeline_bubble_ratio")
    if not isinstance(ratios, dict) or not ratios:
        return None
    values = [v for v in (as_number(x) for x in ratios.values()) if v is not None]
    return sum(values) / len(values) if values else None


def _peak_memory(steps: Sequence[dict], key: str) -> float | None:
    values = [as_number((s.get("device_memory") or {}).get(key)) for s in steps]
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _model_flops(step: dict) -> float | None:
    # Records written before model_flops existed carry the user's (model) count as `flops`.
    return as_number(step.get("model_flops") if "model_flops" in step else step.get("flops"))


def _last(steps: Sequence[dict], key: str) -> float | None:
    values = present_values(steps, key)
    return values[-1] if values else None


def _last_text(steps: Sequence[dict], key: str) -> str | None:
    return next((str(s[key]) for s in reversed(steps) if s.get(key)), None)


def _compile_seconds(run: Run, rank: int, steps: Sequence[dict]) -> float:
    spans = sum(as_number(s.get("seconds")) or 0.0 for s in run.records("span", rank) if s.get("name") == "compile")
    idle = sum(as_number((s.get("idle_breakdown") or {}).get("compile")) or 0.0 for s in steps)
    return max(spans, idle)


class _Side:
    """One run of a side, reduced to what the rows read."""

    def __init__(self, run: Run):
        self.run = run
        self.rank = run.default_rank if run.ranks else None
        self.steps = run.steps(self.rank) if self.rank is not None else []
        self.steady = steady_steps(self.steps)
        self.checkpoints = run.checkpoints(self.rank) if self.rank is not None else []
        self.metadata = next(iter(run.records("metadata", self.rank)), {}) if self.rank is not None else {}
        self.cluster = [s for s in run.cluster_steps() if s.get("complete", True)]


def _verdict(row: Row, alpha: float, min_effect: float) -> Row:
    if row.p_value is None or row.relative is None:
        row.verdict = "—" if row.p_value is None else "noise"
    elif row.p_value < alpha and abs(row.relative) >= min_effect:
        worse = row.relative > 0 if row.lower_is_better else row.relative < 0
        row.verdict = "regression" if worse else "improvement"
    else:
        row.verdict = "noise"
    return row


def _tested(metric: str, label: str, a_runs: list[list[float]], b_runs: list[list[float]],
            summary: Callable[[Sequence[float]], float | None], unit: str, lower_is_better: bool,
            alpha: float, min_effect: float, min_block: int = DEFAULT_MIN_BLOCK,
            timed: tuple[list[tuple[float, float]], list[tuple[float, float]]] | None = None) -> Row:
    """A row with a verdict. *a_runs*, *b_runs*: per run of each side, its per-step values in
    step order. One run a side: the block test over steps (:func:`block_test_p`), or with *timed*
    (the two runs' ``(end_time, value)``, recorded at the same time) the paired windows
    (:func:`paired_block_test_p`); several: the runs' own values against the run-to-run spread
    (:func:`runs_test_p`)."""
    if len(a_runs) == 1 and len(b_runs) == 1:
        row = Row(metric, label, summary(a_runs[0]), summary(b_runs[0]), unit, lower_is_better)
        if timed is not None:
            row.p_value = paired_block_test_p(*timed, summary, min_block=min_block)
        else:
            row.p_value = block_test_p(a_runs[0], b_runs[0], summary, min_block=min_block)
        return _verdict(row, alpha, min_effect)
    per_run_a = [v for v in map(summary, a_runs) if v is not None]
    per_run_b = [v for v in map(summary, b_runs) if v is not None]
    row = Row(metric, label, _mean(per_run_a), _mean(per_run_b), unit, lower_is_better)
    row.p_value = runs_test_p(per_run_a, per_run_b)
    return _verdict(row, alpha, min_effect)


#: Two runs whose steady steps share this much of the shorter one's time span, on one host, were
#: recorded together (taking turns or side by side): their rows are tested window by window.
CONCURRENT_OVERLAP = 0.5


def _concurrent(a: _Side, b: _Side) -> bool:
    """Whether *a* and *b* ran at the same time on the same host, so that they share its drift."""
    if a.metadata.get("hostname") != b.metadata.get("hostname"):
        return False
    spans = []
    for side in (a, b):
        times = [t for t in (as_number(s.get("end_time")) for s in side.steady) if t is not None]
        if len(times) < 2:
            return False
        spans.append((min(times), max(times)))
    (a0, a1), (b0, b1) = spans
    shorter = min(a1 - a0, b1 - b0)
    return shorter > 0 and min(a1, b1) - max(a0, b0) >= CONCURRENT_OVERLAP * shorter


def _runs(runs: Run | Sequence[Run]) -> list[Run]:
    listed = [runs] if isinstance(runs, Run) else list(runs)
    if not listed:
        raise ValueError("compare_runs: each side needs at least one run")
    return listed


def compare_runs(run_a: Run | Sequence[Run], run_b: Run | Sequence[Run], *, alpha: float = DEFAULT_ALPHA,
                 min_effect: float = DEFAULT_MIN_EFFECT) -> dict[str, Any]:
    """Compare two loaded runs, or two lists of runs (seeds or repeats of each side):
    ``{"rows": [Row], "metadata": [(key, a, b)], "a": ..., "b": ...}``.

    With several runs on a side, each row's value is the mean over that side's runs of the
    per-run value, and the verdict weighs the difference against the run-to-run spread.
    """
    runs_a, runs_b = _runs(run_a), _runs(run_b)
    As, Bs = [_Side(r) for r in runs_a], [_Side(r) for r in runs_b]
    rows: list[Row] = []

    paired = len(As) == 1 and len(Bs) == 1 and _concurrent(As[0], Bs[0])

    def timed(side: _Side, steps: str, fn: Callable[[dict], float | None]) -> list[tuple[float, float]]:
        pairs = ((as_number(s.get("end_time")), fn(s)) for s in getattr(side, steps))
        return [(t, v) for t, v in pairs if t is not None and v is not None]

    def tested(metric, label, fn, summary, unit, lower, steps="steady"):
        a = [_per_step(getattr(side, steps), fn) for side in As]
        b = [_per_step(getattr(side, steps), fn) for side in Bs]
        a, b = [v for v in a if v], [v for v in b if v]
        if a or b:
            times = (timed(As[0], steps, fn), timed(Bs[0], steps, fn)) if paired else None
            rows.append(_tested(metric, label, a or [[]], b or [[]], summary, unit, lower, alpha, min_effect,
                                timed=times))

    def per_side(fn: Callable[[_Side], float | None]) -> tuple[float | None, float | None]:
        return (_mean([v for v in map(fn, As) if v is not None]),
                _mean([v for v in map(fn, Bs) if v is not None]))

    def single(metric, label, fn, unit="", lower=True):
        a, b = per_side(fn)
        if a is not None or b is not None:
            rows.append(Row(metric, label, a, b, unit, lower))

    single("steps", "steps", lambda side: float(len(side.steps)), lower=None)
    single("steady_steps", "steady-state steps", lambda side: float(len(side.steady)), lower=None)
    single("loss_final", "final loss", lambda side: next((v for v in map(_loss, reversed(side.steps))
                                                          if v is not None), None))
    tested("loss_mean", "mean loss", _loss, _mean, "", True, steps="steps")
    interval = lambda s: as_number(s.get("interval_seconds"))  # noqa: E731
    compute = lambda s: as_number(s.get("compute_seconds"))  # noqa: E731
    tested("interval_median", "step interval, median", interval, _median, "s", True)
    tested("interval_mean", "step interval, mean", interval, _mean, "s", True)
    tested("compute_median", "compute, median", compute, _median, "s", True)
    tested("compute_mean", "compute, mean", compute, _mean, "s", True)
    tested("tokens_per_second", "tokens/s", lambda s: as_number(s.get("tokens_per_second")), _median, "", False)
    tested("tflops_per_second", "TFLOP/s (compute time)", lambda s: as_number(s.get("tflops_per_second")), _median,
           "", False)
    tested("mfu", "MFU", lambda s: as_number(s.get("mfu")), _median, "", False)
    tested("hfu", "HFU", lambda s: as_number(s.get("hfu")), _median, "", False)
    # The parts of MFU and HFU: a ratio that moved because the FLOPs per step or the peak changed
    # is not a speed change (neither better nor worse).
    for kind in ("model", "hardware"):
        read = _model_flops if kind == "model" else (lambda s: as_number(s.get("hardware_flops")))
        single(f"{kind}_flops", f"{kind} FLOPs per step, median",
               lambda side, read=read: _median(_per_step(side.steady, read)), lower=None)
    single("peak_flops", "peak FLOP/s (MFU's divisor)", lambda side: _last(side.steps, "peak_flops"), lower=None)

    # The one goodput (docs/goodput.md): every rank's own compute of the kept steps over its wall from
    # the process start, across attempts; the same number `steptrace report` prints.
    jobs = {id(side): job_goodput(side.run.records_by_rank) if side.run.ranks else None for side in As + Bs}
    single("goodput", "goodput (own compute / wall from process start)",
           lambda side: (jobs[id(side)] or {}).get("goodput"), lower=False)
    # Waiting for other ranks in collectives (exposed communication), where the ranks measure it.
    tested("collective_wait_mean", "waiting in collectives, mean",
           lambda s: as_number(s.get("collective_wait_seconds")), _mean, "s", True)
    def before_steps(side: _Side) -> float | None:
        seconds = present_values(side.steps, "before_step_seconds")
        return sum(seconds) if seconds else None

    single("before_steps", "time before the first step", before_steps, "s")
    reasons: set[str] = set()
    for side in As + Bs:
        for step in side.steps:
            reasons.update((step.get("idle_breakdown") or {}).keys())
            reasons.update((step.get("before_step_breakdown") or {}).keys())
    for reason in sorted(reasons):
        def idle_total(side: _Side, reason: str = reason) -> float:
            # Host idle less the wait in collectives that fell in it (waiting shown as waiting).
            return sum(step_split(s).idle_breakdown.get(reason, 0.0)
                       + (as_number((s.get("before_step_breakdown") or {}).get(reason)) or 0.0) for s in side.steps)
        single(f"idle_{reason}", f"idle: {reason} (total)", idle_total, "s")
    if any(job is not None and any(len(a["attempts"]) > 1 for a in job["ranks"].values()) for job in jobs.values()):
        # A job that restarted: what the restarts cost (docs/goodput.md); its goodput is the row above.
        for bucket in ("wasted", "downtime", "startup", "restore"):
            single(f"job_{bucket}", f"job badput: {bucket}",
                   lambda side, bucket=bucket: ((jobs[id(side)] or {}).get("badput") or {}).get(bucket), "s")
    blocking_a = [v for v in (present_values(side.checkpoints, "blocking_seconds") for side in As) if v]
    blocking_b = [v for v in (present_values(side.checkpoints, "blocking_seconds") for side in Bs) if v]
    if blocking_a or blocking_b:
        # Saves are far apart: each is its own sample (blocks of one).
        rows.append(_tested("checkpoint_blocking", "checkpoint blocking, mean", blocking_a or [[]],
                            blocking_b or [[]], _mean, "s", True, alpha, min_effect, min_block=1))
    if all(side.rank is not None for side in As + Bs):
        single("compile", "compile time", lambda side: _compile_seconds(side.run, side.rank, side.steps), "s")
    single("memory_peak", "peak device memory", lambda side: _peak_memory(side.steps, "peak_bytes"), "B")
    single("memory_peak_percent", "peak device memory, % of limit",
           lambda side: _peak_memory(side.steps, "peak_percent"), "%")
    tested("bubble", "pipeline bubble", _bubble, _mean, "", True)
    if all(side.cluster for side in As + Bs):
        skew = lambda s: as_number(s.get("skew_seconds"))  # noqa: E731
        rows.append(_tested("skew", "cross-rank skew, median", [_per_step(side.cluster, skew) for side in As],
                            [_per_step(side.cluster, skew) for side in Bs], _median, "s", True, alpha,
                            min_effect))

    metadata = []
    meta_a, meta_b = As[0].metadata, Bs[0].metadata
    for key in ("versions", "devices", "tags"):
        da, db = meta_a.get(key) or {}, meta_b.get(key) or {}
        for sub in sorted(set(da) | set(db)):
            if da.get(sub) != db.get(sub):
                metadata.append((f"{key}.{sub}", da.get(sub), db.get(sub)))
    for key in ("git_commit", "hostname"):
        if meta_a.get(key) != meta_b.get(key):
            metadata.append((key, meta_a.get(key), meta_b.get(key)))
    source_a, source_b = _last_text(As[0].steps, "flops_source"), _last_text(Bs[0].steps, "flops_source")
    if source_a != source_b:
        metadata.append(("flops_source", source_a, source_b))

    def described(runs: list[Run]) -> dict[str, Any]:
        return {"path": str(runs[0].path), "run_id": runs[0].run_id, "runs": [str(r.path) for r in runs]}

    return {"a": described(runs_a), "b": described(runs_b), "rows": rows, "metadata": metadata, "alpha": alpha,
            "min_effect": min_effect,
            "test": "runs" if len(runs_a) > 1 or len(runs_b) > 1 else "paired" if paired else "blocks"}


# -- rendering ---------------------------------------------------------------------------------
def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "B":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value * 1e3:.3f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if unit == "%":
        return f"{value:.2f} %"
    if float(value).is_integer() and abs(value) < 1e12:
        return f"{value:.0f}"
    return f"{value:.4g}"


def _fmt_diff(row: Row) -> str:
    if row.diff is None:
        return "—"
    text = _fmt(row.diff, row.unit)
    return text if text.startswith("-") else "+" + text


def _fmt_rel(row: Row) -> str:
    return "—" if row.relative is None else f"{row.relative * 100:+.1f} %"


HEADER = ("metric", "A", "B", "B − A", "rel.", "verdict")
STEADY_NOTE = ("Steady state: status ok, not the first step, no compile/checkpoint/eval idle. Verdicts: {test}, "
               "p < {alpha}, and |rel.| ≥ {min_effect:.0%}.")
TESTS = {"blocks": "Welch t over blocks of consecutive steps (batch means, widened for drift)",
         "paired": "runs recorded together: t over windows of B/A in time order (shared drift cancels)",
         "runs": "Welch t over the runs of each side (run-to-run spread)"}


def _note(result: dict[str, Any]) -> str:
    return STEADY_NOTE.format(test=TESTS[result.get("test", "blocks")], alpha=result["alpha"],
                              min_effect=result["min_effect"])


def _names(side: dict[str, Any], key: str) -> str:
    runs = side.get("runs") or [side[key]]
    return side[key] if len(runs) == 1 else f"{side[key]} (+{len(runs) - 1} more)"


def _cells(row: Row) -> tuple[str, ...]:
    verdict = row.verdict
    if row.p_value is not None:
        verdict += f" (p={row.p_value:.2g})"
    return (visible(row.label), _fmt(row.a, row.unit), _fmt(row.b, row.unit), _fmt_diff(row), _fmt_rel(row),
            verdict)


_PLAIN_LABEL = re.compile(r"[A-Za-z0-9 :,()%./_-]*")


def _markdown_label(cells: tuple[str, ...]) -> tuple[str, ...]:
    """A row label naming something from the run files (an idle reason) goes in a code span."""
    label = cells[0]
    return cells if _PLAIN_LABEL.fullmatch(label) else (code_span(label), *cells[1:])


def render_markdown(result: dict[str, Any]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    # Run ids, tags and host names come from the run files: code spans, so no heading, image,
    # link or @mention in them is rendered in a PR comment.
    out = [f"**A** {code_span(_names(result['a'], 'run_id'))} vs **B** {code_span(_names(result['b'], 'run_id'))}",
           "", line(HEADER), line(["---"] * len(HEADER))]
    out += [line(_markdown_label(_cells(row))) for row in result["rows"]]
    out += ["", _note(result)]
    if result["metadata"]:
        out += ["", line(("differs", "A", "B")), line(["---"] * 3)]
        out += [line((code_span(key), "—" if a is None else code_span(a), "—" if b is None else code_span(b)))
                for key, a, b in result["metadata"]]
    return "\n".join(out) + "\n"


def render_text(result: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    rows = [HEADER] + [_cells(row) for row in result["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for name in ("a", "b"):
        print(f"{name.upper()}: " + ", ".join(visible(p) for p in (result[name].get("runs") or [result[name]["path"]])),
              file=file)
    print(file=file)
    for index, cells in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))),
              file=file)
        if index == 0:
            print("  ".join("-" * w for w in widths), file=file)
    print("\n" + _note(result), file=file)
    if result["metadata"]:
        print("\nwhere the runs differ:", file=file)
        for key, a, b in result["metadata"]:
            print(f"  {visible(key)}: {visible(a)} -> {visible(b)}", file=file)


@literal_text
def plot_intervals(run_a: Run, run_b: Run, path: str | Path) -> Path:
    """The two runs' steady-state step intervals as empirical CDFs, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, name in ((run_a, "A"), (run_b, "B")):
        values = sorted(present_values(steady_steps(run.steps(run.default_rank)), "interval_seconds"))
        if values:
            ax.step([v * 1e3 for v in values], [(i + 1) / len(values) for i in range(len(values))],
                    where="post", label=f"{name}: {visible(run.run_id)}")
    ax.set_xlabel("steady-state step interval (ms)")
    ax.set_ylabel("fraction of steps")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- command ----------------------------------------------------------------------------------
def _two_runs(paths: Sequence[str]) -> tuple[Path, Path]:
    if len(paths) == 2:
        return find_run(paths[0]), find_run(paths[1])
    if len(paths) == 1:  # a run_dir holding runs: the two newest, older first
        parent = Path(paths[0])
        runs = [child for child in parent.iterdir() if child.is_dir() and any(child.glob("rank-*.jsonl"))] \
            if parent.is_dir() else []
        if len(runs) < 2:
            raise RunDirError(f"{parent}: needs two runs to compare (found {len(runs)}); or give RUN_A RUN_B")
        runs.sort(key=lambda d: max(f.stat().st_mtime for f in d.glob("rank-*.jsonl")))
        return runs[-2], runs[-1]
    raise RunDirError("give RUN_A RUN_B, or one run_dir holding at least two runs, or --a RUN... --b RUN...")


def _sides(args: argparse.Namespace) -> tuple[list[Path], list[Path]]:
    if args.a or args.b:
        if not (args.a and args.b) or args.runs:
            raise RunDirError("--a and --b go together (each with one or more runs), without RUN_A RUN_B")
        return [find_run(p) for p in args.a], [find_run(p) for p in args.b]
    path_a, path_b = _two_runs(args.runs)
    return [path_a], [path_b]


def _clickhouse_sides(args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """``--clickhouse URL``: RUN_A RUN_B (or --a/--b) are run ids in its otel_traces table."""
    from steptrace.analysis.clickhouse import open_run

    if args.a or args.b:
        if not (args.a and args.b) or args.runs:
            raise RunDirError("--a and --b go together (each with one or more runs), without RUN_A RUN_B")
        ids_a, ids_b = list(args.a), list(args.b)
    elif len(args.runs) == 2:
        ids_a, ids_b = [args.runs[0]], [args.runs[1]]
    else:
        raise RunDirError("with --clickhouse, give two run ids (RUN_A RUN_B) or --a/--b run ids")
    return ([open_run(args.clickhouse, run_id, table=args.clickhouse_table) for run_id in ids_a],
            [open_run(args.clickhouse, run_id, table=args.clickhouse_table) for run_id in ids_b])


def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("runs", nargs="*", metavar="RUN",
                        help="RUN_A RUN_B (run directories), or one run_dir: its two newest runs, older as A")
    parser.add_argument("--a", nargs="+", action="extend", metavar="RUN", default=[],
                        help="several runs of A (seeds or repeats): verdicts use the run-to-run spread")
    parser.add_argument("--b", nargs="+", action="extend", metavar="RUN", default=[],
                        help="several runs of B (with --a)")
    parser.add_argument("--clickhouse", metavar="URL", default=None,
                        help="read the runs from ClickHouse (the OpenTelemetry Collector's otel_traces table): "
                             "each RUN is then a run id (docs/clickhouse.md)")
    parser.add_argument("--clickhouse-table", metavar="TABLE", default="otel_traces",
                        help="with --clickhouse: the exporter's traces table (default otel_traces)")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (for a pull-request comment)")
    parser.add_argument("--json", action="store_true", help="every row as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw both runs' step-interval distributions")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (default 0.01)")
    parser.add_argument("--min-effect", type=float, default=DEFAULT_MIN_EFFECT * 100, metavar="PCT",
                        help="smallest relative difference called a regression or improvement, in percent "
                             "(default 2)")
    parser.add_argument("--fail-on-regression", type=float, metavar="PCT", default=None,
                        help="exit 1 when --metric is a significant regression by more than PCT percent")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help=f"the metric --fail-on-regression checks (default {DEFAULT_METRIC})")
    return parser


def run_compare(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "clickhouse", None) is not None:
            runs_a, runs_b = _clickhouse_sides(args)
        else:
            paths_a, paths_b = _sides(args)
            runs_a, runs_b = [load_run(p) for p in paths_a], [load_run(p) for p in paths_b]
    except (RunDirError, OSError) as exc:
        print(f"steptrace compare: {exc}", file=sys.stderr)
        return 2
    for run in runs_a + runs_b:
        for warning in run.warnings:
            print(f"steptrace compare: warning: {visible(run.path)}: {visible(warning)}", file=sys.stderr)
    if not (0 < args.alpha < 1) or args.min_effect < 0:
        print("steptrace compare: --alpha must be in (0, 1) and --min-effect >= 0", file=sys.stderr)
        return 2
    result = compare_runs(runs_a, runs_b, alpha=args.alpha, min_effect=args.min_effect / 100)
    if args.json:
        print(json.dumps({**result, "rows": [r.to_json() for r in result["rows"]]}, indent=1, default=str))
    elif args.markdown:
        print(render_markdown(result), end="")
    else:
        render_text(result)
    if args.plot:
        try:
            print(f"wrote {plot_intervals(runs_a[0], runs_b[0], args.plot)}", file=sys.stderr)
        except (OSError, ImportError) as exc:
            print(f"steptrace compare: cannot write plot: {exc}", file=sys.stderr)
            return 1
    if args.fail_on_regression is not None:
        rows = {r.metric: r for r in result["rows"]}
        row = rows.get(args.metric)
        if row is None:
            print(f"steptrace compare: no metric {args.metric!r} in these runs; one of {', '.join(rows)}",
                  file=sys.stderr)
            return 2
        if row.verdict == "regression" and row.relative is not None \
                and abs(row.relative) * 100 > args.fail_on_regression:
            print(f"steptrace compare: {row.label} regressed by {abs(row.relative) * 100:.1f} % "
                  f"(> {args.fail_on_regression:g} %, p={row.p_value:.2g})", file=sys.stderr)
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptrace compare", description=__doc__.split("\n\n")[0])
    add_compare_arguments(parser)
    return run_compare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
