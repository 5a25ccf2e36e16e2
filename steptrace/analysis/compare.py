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
* ``machine changed``: one run a side recorded one after the other, whose control (spans the change
  leaves alone: ``eval`` by default) moved as the steps did; the speed rows are judged net of the
  machine (:func:`_against_control`) and nothing is left beyond what a machine change does to
  different code;
* ``—``: a metric with one value per run (totals, final loss) has no per-step distribution to
  test; its difference is shown without a verdict.

Every tested row carries the confidence interval of its relative change (:class:`Change`) and the
smallest change the comparison could detect; :func:`headline` says the ``--metric`` row's verdict
in words, and ``--fail-on-regression`` acts on exactly that verdict.

Steady state, by construction: a step counts when its status is ``ok``, it is not the rank's
first step nor the first after a restore (``first_after_restore``: both carry compilation and
warm-up; the restarts' one-off cost has a row of its own), and no compile, checkpoint or eval time fell
in its idle window. Intervals, compute, steady tokens/s, TFLOP/s and MFU rows use steady-state steps of
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
import bisect
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from steptrace.analysis._text import code_span, literal_text, visible
from steptrace.analysis.runs import Run, RunDirError, find_run, load_run
from steptrace.analysis.goodput import job_goodput
from steptrace.analysis.summary import (after_restore_costs, as_number, flops_rate, present_values, percentile,
                                        step_split)

__all__ = ["Change", "Row", "block_change", "block_test_p", "block_values", "compare_runs", "headline",
           "mann_whitney_p", "paired_block_change", "paired_block_test_p", "runs_change", "runs_test_p", "steady_steps",
           "t_quantile", "t_test_p", "add_compare_arguments", "run_compare", "main"]

#: Idle reasons that make a step not steady-state.
UNSTEADY_REASONS = ("compile", "checkpoint", "eval")
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.02
DEFAULT_METRIC = "interval_median"
#: Metric keys that were renamed, so that one figure has one name: --metric with the old key says so.
_RENAMED_METRICS = {"tokens_per_second": "steady_tokens_per_second"}
_RENAMED_WHY = {"steady_tokens_per_second": "the median over steady-state steps; steptrace report's tokens/s "
                                            "is the whole run's"}
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


def t_quantile(p: float, df: float) -> float:
    """The t ≥ 0 whose two-sided p-value with *df* degrees of freedom is *p* (inverse of :func:`t_test_p`)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    low, high = 0.0, 1.0
    while t_test_p(high, df) > p and high < 1e12:
        low, high = high, high * 2
    for _ in range(100):
        middle = (low + high) / 2
        if t_test_p(middle, df) > p:
            low = middle
        else:
            high = middle
    return (low + high) / 2


#: The power at which :meth:`Change.detectable` states the smallest change a comparison could find.
DETECTION_POWER = 0.8


@dataclass(frozen=True)
class Change:
    """A change B − A as a test estimated it: *diff* on the log scale when *log* (a ratio: every value
    was positive), else in the row's unit, with its standard error *se* and *df* degrees of freedom
    (Welch–Satterthwaite, or the count of windows or runs less one)."""

    diff: float
    se: float
    df: float
    log: bool

    def p(self) -> float:
        """Two-sided p-value that the change is 0."""
        if self.se <= 0:
            return 1.0 if self.diff == 0 else 0.0
        return t_test_p(self.diff / self.se, self.df)

    def interval(self, alpha: float) -> tuple[float, float]:
        """The 1 − *alpha* confidence interval of *diff*: it excludes 0 exactly when p < *alpha*."""
        half = t_quantile(alpha, self.df) * self.se if self.se > 0 else 0.0
        return self.diff - half, self.diff + half

    def detectable(self, alpha: float, power: float = DETECTION_POWER) -> float:
        """The smallest |diff| this comparison finds (p < *alpha*) with probability *power*: the
        minimum detectable effect, (t_{1−α/2} + t_{power}) × se."""
        return (t_quantile(alpha, self.df) + t_quantile(2 * (1 - power), self.df)) * self.se

    def relative(self, value: float, a: float | None) -> float | None:
        """*value* on the scale of *diff* as a relative change of A's value *a*."""
        if self.log:
            return math.expm1(value)
        return None if a is None or a == 0 else value / abs(a)

    def minus(self, other: "Change") -> "Change":
        """This change less *other* (both ratios): what is left of it once *other* is taken out. Its
        degrees of freedom are Welch–Satterthwaite's for the two standard errors."""
        spread = self.se ** 2 + other.se ** 2
        terms = (self.se ** 4 / self.df if self.se > 0 else 0.0) + (other.se ** 4 / other.df if other.se > 0 else 0.0)
        df = max(1.0, spread ** 2 / terms) if terms > 0 else max(1.0, min(self.df, other.df))
        return Change(self.diff - other.diff, math.sqrt(spread), df, self.log and other.log)


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


def _positive(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether :func:`_logs` takes these samples' logarithms (their change is then a ratio)."""
    return all(v > 0 for v in a) and all(v > 0 for v in b)


def _mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def block_test_p(a: Sequence[float], b: Sequence[float],
                 summary: Callable[[Sequence[float]], float | None] = _mean_or_none,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> float | None:
    """Two-sided p-value that two runs' per-step *a*, *b* (in step order) differ, respecting
    autocorrelation: a Welch t-test on block values (:func:`block_values`; their logarithms when all
    are positive), each side's variance widened by its blocks' lag-1 autocorrelation. None with
    fewer than 2 blocks on a side."""
    change = block_change(a, b, summary, max_blocks, min_block)
    return None if change is None else change.p()


def block_change(a: Sequence[float], b: Sequence[float],
                 summary: Callable[[Sequence[float]], float | None] = _mean_or_none,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> "Change | None":
    """The change B − A that :func:`block_test_p` tests, with its standard error and degrees of
    freedom (log scale when every block value is positive). None with fewer than 2 blocks a side."""
    raw_a, raw_b = block_values(a, summary, max_blocks, min_block), block_values(b, summary, max_blocks, min_block)
    if len(raw_a) < 2 or len(raw_b) < 2:
        return None
    blocks_a, blocks_b = _logs(raw_a, raw_b)
    (var_a, n_a), (var_b, n_b) = _side_spread(blocks_a), _side_spread(blocks_b)
    return _welch_change(sum(blocks_a) / len(blocks_a), var_a, n_a, sum(blocks_b) / len(blocks_b), var_b, n_b,
                         log=_positive(raw_a, raw_b))


def _welch_change(mean_a: float, var_a: float, n_a: float, mean_b: float, var_b: float, n_b: float, *,
                  log: bool) -> "Change":
    """Welch's test from each side's mean, the variance of that mean and its (effective) count."""
    spread = var_a + var_b
    # Welch–Satterthwaite degrees of freedom, at least 1.
    terms = (var_a ** 2 / max(n_a - 1, 1e-9) if var_a > 0 else 0.0) + (var_b ** 2 / max(n_b - 1, 1e-9) if var_b > 0
                                                                        else 0.0)
    df = max(1.0, spread ** 2 / terms) if terms > 0 else 1.0
    return Change(mean_b - mean_a, math.sqrt(max(spread, 0.0)), df, log)


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
    change = paired_block_change(a, b, summary, max_blocks, min_block)
    return None if change is None else change.p()


def paired_block_change(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]],
                        summary: Callable[[Sequence[float]], float | None] = _mean_or_none,
                        max_blocks: int = DEFAULT_MAX_BLOCKS, min_block: int = DEFAULT_MIN_BLOCK) -> "Change | None":
    """The change B − A (mean of the windows' log ratios) that :func:`paired_block_test_p` tests."""
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
    return Change(sum(differences) / len(differences), math.sqrt(max(variance, 0.0)), k - 1, positive)


def runs_test_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value that per-run values *a* and *b* (one per seed or repeat) differ: Welch's
    t-test when both sides have 2 or more runs, else Student's with the pooled run-to-run spread
    (one run against several). None with 3 runs or fewer in all, or one run on each side."""
    change = runs_change(a, b)
    return None if change is None else change.p()


def runs_change(a: Sequence[float], b: Sequence[float]) -> "Change | None":
    """The change B − A of per-run values that :func:`runs_test_p` tests."""
    n_a, n_b = len(a), len(b)
    if n_a + n_b < 3 or n_a < 1 or n_b < 1:
        return None
    log = _positive(a, b)
    a, b = _logs(list(a), list(b))
    mean_a, mean_b = sum(a) / n_a, sum(b) / n_b
    if n_a >= 2 and n_b >= 2:
        return _welch_change(mean_a, _variance(a) / n_a, n_a, mean_b, _variance(b) / n_b, n_b, log=log)
    squares = sum((v - mean_a) ** 2 for v in a) + sum((v - mean_b) ** 2 for v in b)
    df = n_a + n_b - 2
    spread = squares / df * (1 / n_a + 1 / n_b)
    return Change(mean_b - mean_a, math.sqrt(max(spread, 0.0)), df, log)


# -- what is compared --------------------------------------------------------------------------
def steady_steps(steps: Sequence[dict]) -> list[dict]:
    """The steady-state steps (see the module docstring)."""
    ordered = sorted(steps, key=lambda s: as_number(s.get("step")) or 0)
    steady = []
    for index, step in enumerate(ordered):
        # The first step after a restore carries the restart's one-off cost, like the first step.
        if index == 0 or step.get("status") != "ok" or step.get("first_after_restore"):
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
    # The relative change's confidence interval (1 − alpha) and the smallest relative change the
    # comparison could detect (power DETECTION_POWER), where a test ran.
    ci_low: float | None = None
    ci_high: float | None = None
    detectable: float | None = None
    # Against the control (a single pair whose control moved): see _against_control.
    machine: dict[str, Any] | None = None
    change: "Change | None" = field(default=None, repr=False, compare=False)

    @property
    def diff(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def relative(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / abs(self.a)

    @property
    def effect(self) -> float | None:
        """The relative change the verdict is about: the code's, net of the machine, where the
        control moved (``machine``); else B − A relative to A."""
        if self.machine is not None:
            return self.machine["code_relative"]
        return self.relative

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("change")
        return {**data, "diff": self.diff, "relative": self.relative, "effect": self.effect}


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


def _verdict(row: Row, alpha: float, min_effect: float, change: Change | None = None) -> Row:
    if change is not None:
        row.change = change
        row.p_value = change.p()
        low, high = change.interval(alpha)
        row.ci_low, row.ci_high = change.relative(low, row.a), change.relative(high, row.a)
        row.detectable = change.relative(change.detectable(alpha), row.a)
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
            change = paired_block_change(*timed, summary, min_block=min_block)
        else:
            change = block_change(a_runs[0], b_runs[0], summary, min_block=min_block)
        return _verdict(row, alpha, min_effect, change)
    per_run_a = [v for v in map(summary, a_runs) if v is not None]
    per_run_b = [v for v in map(summary, b_runs) if v is not None]
    row = Row(metric, label, _mean(per_run_a), _mean(per_run_b), unit, lower_is_better)
    return _verdict(row, alpha, min_effect, runs_change(per_run_a, per_run_b))


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


#: Spans taken as controls when none are named: an eval runs the same code on both sides of most changes.
DEFAULT_CONTROLS = ("eval",)
#: A control needs this many spans in each run to be tested (and so used).
MIN_CONTROL_SAMPLES = 3
#: Rows judged net of the machine where the control moved, with the direction in which a slower
#: machine moves them: times up (+1), throughput down (−1).
MACHINE_ROWS = {"interval_median": 1, "interval_mean": 1, "compute_median": 1, "compute_mean": 1,
                "steady_tokens_per_second": -1, "tflops_per_second": -1, "mfu": -1, "hfu": -1}
#: A machine change does not slow every piece of code alike: beyond --min-effect, the code's
#: effect must exceed this fraction of the control's change (in log terms) to be called the code's.
#: Measured by bench/bench_compare.py (docs/compare.md): where the machine moved by 70 % or more,
#: the steps' and the eval's log changes (same code) differed by 2 % to 25 % of the eval's.
MACHINE_HETEROGENEITY = 0.25


def _control_samples(side: _Side, name: str) -> list[float]:
    """The durations of the side's *name* spans (default rank), in the order they ran."""
    if side.rank is None:
        return []
    spans = sorted((s for s in side.run.records("span", side.rank) if s.get("name") == name),
                   key=lambda s: as_number(s.get("start_time")) or 0.0)
    return [v for v in (as_number(s.get("seconds")) for s in spans) if v is not None and v > 0]


def _control_rows(As: list[_Side], Bs: list[_Side], names: tuple[str, ...], alpha: float) -> list[tuple[str, Row]]:
    """A row per control span name that both sides ran: its median and the test of its change,
    each span one sample (a control runs every so many steps: far apart, like checkpoint saves).
    A row without enough spans (MIN_CONTROL_SAMPLES a run) is shown with no verdict and not used."""
    out = []
    for name in names:
        a = [_control_samples(side, name) for side in As]
        b = [_control_samples(side, name) for side in Bs]
        if not any(a) or not any(b):
            continue
        label = f"control: {name}, median"
        if len(As) == 1 and len(Bs) == 1:
            row = Row(f"control_{name}", label, _median(a[0]), _median(b[0]), "s", True)
            if min(len(a[0]), len(b[0])) >= MIN_CONTROL_SAMPLES:
                row = _verdict(row, alpha, 0.0, block_change(a[0], b[0], _median, min_block=1))
        else:
            per_a = [v for v in map(_median, a) if v is not None]
            per_b = [v for v in map(_median, b) if v is not None]
            row = _verdict(Row(f"control_{name}", label, _mean(per_a), _mean(per_b), "s", True), alpha, 0.0,
                           runs_change(per_a, per_b))
        # A control's change is the machine's, never the code's: no regression or improvement.
        if row.verdict in ("regression", "improvement"):
            row.verdict = "changed"
        out.append((name, row))
    return out


def _net_of_control(side: _Side, steps: str, fn: Callable[[dict], float | None], name: str,
                    direction: int) -> list[float]:
    """The side's per-step values (in step order) net of the machine: each divided by the local
    time of the control (the geometric mean of the *name* spans just before and just after the
    step), or for a throughput (*direction* −1) multiplied by it. A machine that slows down and
    speeds up within a run moves both alike, so the ratio keeps the code's part."""
    spans = sorted(((as_number(s.get("start_time")), as_number(s.get("seconds")))
                    for s in side.run.records("span", side.rank) if s.get("name") == name)
                   if side.rank is not None else [], key=lambda span: span[0] or 0.0)
    spans = [(start + seconds / 2, seconds) for start, seconds in spans
             if start is not None and seconds is not None and seconds > 0]
    middles = [middle for middle, _ in spans]
    out = []
    for step in getattr(side, steps):
        value, end = fn(step), as_number(step.get("end_time"))
        if value is None or value <= 0 or end is None or not spans:
            continue
        at = bisect.bisect_left(middles, end - (as_number(step.get("interval_seconds")) or 0.0) / 2)
        near = [spans[j][1] for j in (at - 1, at) if 0 <= j < len(spans)]
        local = math.exp(sum(math.log(v) for v in near) / len(near))
        out.append(value / local ** direction)
    return out


def _against_control(row: Row, name: str, control: Row, direction: int, alpha: float, min_effect: float,
                     net: Change | None = None) -> None:
    """Judge *row* of a single pair recorded one after the other net of the machine, where the
    control (code the change leaves alone) moved by at least *min_effect* and either beyond its
    noise (p < alpha) or, where the row itself moved beyond its noise, in the same direction by at
    least half as much (a control that ran a few times on a noisy machine is rarely significant,
    yet +300 % next to the steps' +290 % says what happened).

    The code's effect is *net*, the row's values measured step by step against the control's local
    time (:func:`_net_of_control`, which follows a machine that changed within the runs too), or
    without it the row's change less the control's (ratios: the machine is taken to slow every
    piece of code by the same factor). It is a regression or an improvement only when significant
    and larger than *min_effect* plus MACHINE_HETEROGENEITY of the control's change; else the
    verdict is ``machine changed``."""
    step, machine = row.change, control.change
    if step is None or machine is None or not (step.log and machine.log) or control.p_value is None:
        return
    shift = Change(direction * machine.diff, machine.se, machine.df, True)
    alongside = (row.verdict in ("regression", "improvement") and shift.diff * step.diff > 0
                 and abs(shift.diff) >= abs(step.diff) / 2)
    if abs(shift.diff) < math.log1p(min_effect) or not (control.p_value < alpha or alongside):
        return  # no machine change seen: the row's own verdict stands
    code = net if net is not None and net.log else step.minus(shift)
    low, high = code.interval(alpha)
    margin = math.log1p(min_effect) + MACHINE_HETEROGENEITY * abs(machine.diff)
    # The step's and the control's changes as their tests estimated them (means of logs).
    row.machine = {"control": name, "step_relative": math.expm1(step.diff),
                   "control_relative": math.expm1(machine.diff),
                   "control_ci": [control.ci_low, control.ci_high], "control_p": control.p_value,
                   "code_relative": math.expm1(code.diff), "code_ci": [math.expm1(low), math.expm1(high)],
                   "code_p": code.p(), "code_detectable": math.expm1(code.detectable(alpha)),
                   "needed": math.expm1(margin)}
    if code.p() < alpha and abs(code.diff) >= margin:
        worse = code.diff > 0 if row.lower_is_better else code.diff < 0
        row.verdict = "regression" if worse else "improvement"
    else:
        row.verdict = "machine changed"


def _runs(runs: Run | Sequence[Run]) -> list[Run]:
    listed = [runs] if isinstance(runs, Run) else list(runs)
    if not listed:
        raise ValueError("compare_runs: each side needs at least one run")
    return listed


def compare_runs(run_a: Run | Sequence[Run], run_b: Run | Sequence[Run], *, alpha: float = DEFAULT_ALPHA,
                 min_effect: float = DEFAULT_MIN_EFFECT, controls: Sequence[str] | None = DEFAULT_CONTROLS,
                 metric: str = DEFAULT_METRIC) -> dict[str, Any]:
    """Compare two loaded runs, or two lists of runs (seeds or repeats of each side):
    ``{"rows": [Row], "metadata": [(key, a, b)], "a": ..., "b": ..., "verdict": {...}}``.

    With several runs on a side, each row's value is the mean over that side's runs of the
    per-run value, and the verdict weighs the difference against the run-to-run spread.
    *controls*: names of spans the change leaves alone (``eval`` by default), timed in both runs:
    a single pair recorded one after the other whose control moved gets its speed rows judged
    net of that move (:func:`_against_control`). ``verdict`` is *metric*'s row, said in words
    (:func:`headline`), the one ``--fail-on-regression`` acts on.
    """
    runs_a, runs_b = _runs(run_a), _runs(run_b)
    As, Bs = [_Side(r) for r in runs_a], [_Side(r) for r in runs_b]
    rows: list[Row] = []

    paired = len(As) == 1 and len(Bs) == 1 and _concurrent(As[0], Bs[0])

    def timed(side: _Side, steps: str, fn: Callable[[dict], float | None]) -> list[tuple[float, float]]:
        pairs = ((as_number(s.get("end_time")), fn(s)) for s in getattr(side, steps))
        return [(t, v) for t, v in pairs if t is not None and v is not None]

    inputs: dict[str, tuple[Callable[[dict], float | None], Callable[[Sequence[float]], float | None], str]] = {}

    def tested(metric, label, fn, summary, unit, lower, steps="steady"):
        inputs[metric] = (fn, summary, steps)
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
    # Not the report's tokens/s (the whole run: Σ tokens / Σ intervals): a median over steady steps.
    tested("steady_tokens_per_second", "steady tokens/s, median", lambda s: as_number(s.get("tokens_per_second")),
           _median, "", False)
    # In TFLOP/s, as the records hold it; shown in the unit that keeps three significant figures.
    tested("tflops_per_second", "FLOP/s (compute time), median", lambda s: as_number(s.get("tflops_per_second")),
           _median, "TFLOP/s", False)
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
    if any(s.get("first_after_restore") for side in As + Bs for s in side.steps):
        def one_off(side: _Side) -> float | None:
            costs = [c["one_off_seconds"] for c in after_restore_costs(side.steps) if c["one_off_seconds"] is not None]
            return math.fsum(costs) if costs else None

        single("after_restore_one_off", "first steps after a restore: one-off cost (total)", one_off, "s")
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

    control = _control_rows(As, Bs, tuple(controls or ()), alpha)
    rows.extend(row for _, row in control)
    usable = next(((name, row) for name, row in control if row.change is not None), None)
    sequential = len(As) == 1 and len(Bs) == 1 and not paired
    if sequential and usable is not None:
        name, control_row = usable
        for row in rows:
            if row.metric in MACHINE_ROWS and row.metric in inputs:
                fn, summary, steps = inputs[row.metric]
                direction = MACHINE_ROWS[row.metric]
                net = block_change(_net_of_control(As[0], steps, fn, name, direction),
                                   _net_of_control(Bs[0], steps, fn, name, direction), summary)
                _against_control(row, name, control_row, direction, alpha, min_effect, net)

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

    test = "runs" if len(runs_a) > 1 or len(runs_b) > 1 else "paired" if paired else "blocks"
    result = {"a": described(runs_a), "b": described(runs_b), "rows": rows, "metadata": metadata, "alpha": alpha,
              "min_effect": min_effect, "test": test, "controls": list(controls or ()),
              "control": usable[0] if usable is not None and sequential else None}
    result["verdict"] = headline(result, metric)
    return result


# -- the verdict in words ----------------------------------------------------------------------
#: The same quantity summarised the other way: a verdict that differs between them is explained.
SIBLINGS = {"interval_median": "interval_mean", "interval_mean": "interval_median",
            "compute_median": "compute_mean", "compute_mean": "compute_median"}


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:+.1f} %"


def _interval(low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return "—"
    return f"[{low * 100:+.1f} %, {high * 100:+.1f} %]"


def _what_moved(median: Row, mean: Row) -> str:
    """Why a median and a mean row of one figure disagree, said from which of them moved (a code
    verdict, regression or improvement), never from which row is printed."""
    moved_median = median.verdict in ("regression", "improvement")
    moved_mean = mean.verdict in ("regression", "improvement")
    if moved_median and moved_mean:  # different verdicts, both moves: opposite directions
        return "the typical step (the median) and the average (the mean) moved in opposite directions"
    if moved_median:
        return ("the typical step (the median) moved and the average (the mean) did not: the steps away "
                "from the middle moved less or the other way, or the mean's spread hides the move")
    if moved_mean:
        return "a few slow steps (a tail) moved the average (the mean), not the typical step (the median)"
    return "neither says the code moved it; they differ on whether the machine did"


def headline(result: dict[str, Any], metric: str = DEFAULT_METRIC,
             quote: Callable[[Any], str] = visible) -> dict[str, Any]:
    """*metric*'s verdict said in words, with the interval of the change, what the comparison could
    detect, what the control says, and why a sibling row (median against mean) disagrees:
    ``{"metric", "label", "verdict", "effect", "ci", "p_value", "detectable", "machine", "text", "notes"}``.
    ``verdict`` None: no such row. *quote* shows a name (a label, a control span) in the text."""
    rows = {r.metric: r for r in result["rows"]}
    row = rows.get(metric)
    if row is None:
        return {"metric": metric, "label": None, "verdict": None, "effect": None, "ci": None, "p_value": None,
                "detectable": None, "machine": None, "text": f"no {metric} row in these runs", "notes": []}
    notes: list[str] = []
    machine = row.machine
    ci = machine["code_ci"] if machine else [row.ci_low, row.ci_high]
    p_value = machine["code_p"] if machine else row.p_value
    detectable = machine["code_detectable"] if machine else row.detectable
    label = quote(row.label)
    if machine and row.verdict == "machine changed":
        text = (f"{label}: the machine changed. B − A is {_pct(machine['step_relative'])} here and "
                f"{_pct(machine['control_relative'])} for the control {quote(machine['control'])} (code the change "
                f"leaves alone); net of the machine, {_pct(machine['code_relative'])} {_interval(*ci)}: no code "
                f"change beyond what a machine change does to different code ({machine['needed'] * 100:.1f} % "
                "needed here).")
    elif row.verdict in ("regression", "improvement"):
        net = (f", net of the machine (the control {quote(machine['control'])} moved "
               f"{_pct(machine['control_relative'])})") if machine else ""
        text = (f"{label}: {row.verdict} {_pct(row.effect)}, confidence interval {_interval(*ci)} "
                f"(p={p_value:.2g}){net}.")
    elif row.verdict == "noise":
        reason = "below --min-effect" if p_value is not None and p_value < result["alpha"] else "within the noise"
        text = f"{label}: noise, {_pct(row.relative)} {_interval(*ci)}, {reason}."
    else:
        text = (f"{label}: no verdict: too few steady-state steps to test (at least {2 * DEFAULT_MIN_BLOCK} a "
                f"run, {DEFAULT_MIN_BLOCK} per block) or one value per run.")
    if detectable is not None and row.verdict != "—":
        smallest = f"{detectable * 100:.1f} %"
        if machine or (row.change is not None and row.change.log):  # a ratio: a fall of 1 − 1/(1 + x)
            smallest = f"+{detectable * 100:.1f} % or −{detectable / (1 + detectable) * 100:.1f} %"
        net = " net of the machine" if machine else ""
        notes.append(f"The smallest change{net} these runs could detect is {smallest} ({DETECTION_POWER:.0%} of "
                     f"the time at p < {result['alpha']:g}); more steady steps, or several runs a side, detect less.")
    sibling = rows.get(SIBLINGS.get(metric, ""))
    if sibling is not None and sibling.verdict != row.verdict and "—" not in (sibling.verdict, row.verdict):
        what = _what_moved(row if metric.endswith("median") else sibling,
                           sibling if metric.endswith("median") else row)
        sibling_p = sibling.machine["code_p"] if sibling.machine else sibling.p_value
        notes.append(f"The {quote(sibling.label)} row says {sibling.verdict} ({_pct(sibling.effect)}, "
                     f"p={sibling_p:.2g}): {what}. --metric {sibling.metric} gates on it.")
    if result.get("test") == "blocks" and row.metric in MACHINE_ROWS and not machine:
        used = result.get("control")
        control_row = rows.get(f"control_{used}") if used else None
        if control_row is not None:
            seen = "within its noise"
            if row.verdict in ("regression", "improvement") and row.relative is not None \
                    and control_row.ci_low is not None and control_row.ci_high is not None:
                # The most the machine can have moved in the row's direction, against half the row's move.
                slower = (row.relative > 0) == (MACHINE_ROWS[row.metric] > 0)
                most = control_row.ci_high if slower else -control_row.ci_low
                seen = ("no machine change seen that would explain it" if most < abs(row.relative) / 2 else
                        "too noisy to rule out that the machine explains part of it")
            notes.append(f"The control {quote(used)} (code the change leaves alone) moved "
                         f"{_pct(control_row.relative)} {_interval(control_row.ci_low, control_row.ci_high)}: "
                         f"{seen}.")
        else:
            shown = [r for r in result["rows"] if r.metric.startswith("control_")]
            why = (f"the control {quote(shown[0].metric[len('control_'):])} ran too few "
                   f"times (at least {MIN_CONTROL_SAMPLES} a run)" if shown else
                   "no control ran in both runs (an `eval` span, or --control NAME)")
            notes.append(f"One run a side, one after the other, and {why}: a machine that changed between A and B "
                         "reads as a code change. For CI, compare several runs a side (--a/--b), or run A and B "
                         "taking turns.")
    return {"metric": metric, "label": row.label, "verdict": row.verdict, "effect": row.effect, "ci": ci,
            "p_value": p_value, "detectable": detectable, "machine": machine, "text": text, "notes": notes}


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
    if unit == "TFLOP/s":  # the report's units (31.2 GFLOP/s), not two decimals of TFLOP/s (0.03)
        return flops_rate(value)
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
    if row.machine is not None:
        verdict += (f" (net {_pct(row.machine['code_relative'])} {_interval(*row.machine['code_ci'])}, "
                    f"p={row.machine['code_p']:.2g})")
    elif row.p_value is not None and row.ci_low is not None:
        verdict += f" (p={row.p_value:.2g}, {_interval(row.ci_low, row.ci_high)})"
    elif row.p_value is not None:
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
    verdict = result.get("verdict")
    if verdict and verdict.get("verdict") is not None:
        # Names from the run files (a label naming an idle reason) go in code spans, as in the table.
        verdict = headline(result, verdict["metric"],
                           quote=lambda name: name if _PLAIN_LABEL.fullmatch(str(name)) else code_span(name))
        out += ["", f"**Verdict** {verdict['text']}"] + [f"- {note}" for note in verdict["notes"]]
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
    verdict = result.get("verdict")
    if verdict and verdict.get("verdict") is not None:
        print(f"\nVerdict: {verdict['text']}", file=file)
        for note in verdict["notes"]:
            print(f"  {note}", file=file)
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
                        help="several runs of A (seeds or repeats): verdicts use the run-to-run spread, the only "
                             "one that sees a machine change between runs; the recommended form for CI (3 runs a "
                             "side, A and B alternated)")
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
                        help="exit 1 exactly when the printed verdict on --metric is a regression by more than PCT "
                             "percent (net of the machine where the control moved)")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help=f"the metric the verdict and --fail-on-regression are about (default {DEFAULT_METRIC})")
    parser.add_argument("--control", action="append", metavar="SPAN", default=None,
                        help="a span your change leaves alone (repeatable; default: eval). With one run a side "
                             f"recorded one after the other and at least {MIN_CONTROL_SAMPLES} such spans a run, a "
                             "control that moved means the machine changed: speed rows are judged net of it")
    parser.add_argument("--no-control", action="store_true", help="use no control span")
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
    controls = () if getattr(args, "no_control", False) else (getattr(args, "control", None) or DEFAULT_CONTROLS)
    metric = getattr(args, "metric", DEFAULT_METRIC)
    result = compare_runs(runs_a, runs_b, alpha=args.alpha, min_effect=args.min_effect / 100, controls=controls,
                          metric=metric)
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
        verdict = result["verdict"]
        if verdict["verdict"] is None:
            renamed = _RENAMED_METRICS.get(metric)
            hint = f" ({metric!r} is now {renamed!r}: {_RENAMED_WHY[renamed]})" if renamed else ""
            print(f"steptrace compare: no metric {metric!r} in these runs{hint}; one of "
                  f"{', '.join(r.metric for r in result['rows'])}", file=sys.stderr)
            return 2
        # The exit code is the printed verdict's: a regression (net of the machine where the control
        # moved) larger than the threshold, nothing else.
        effect = verdict["effect"]
        if verdict["verdict"] == "regression" and effect is not None and abs(effect) * 100 > args.fail_on_regression:
            print(f"steptrace compare: exit 1: {visible(verdict['label'])} regressed by {abs(effect) * 100:.1f} % "
                  f"(> {args.fail_on_regression:g} %, p={verdict['p_value']:.2g})", file=sys.stderr)
            return 1
        why = (f"a regression of {abs(effect) * 100:.1f} %, not more than {args.fail_on_regression:g} %"
               if verdict["verdict"] == "regression" and effect is not None else verdict["verdict"])
        print(f"steptrace compare: exit 0: {visible(verdict['label'])}: {why}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptrace compare", description=__doc__.split("\n\n")[0])
    add_compare_arguments(parser)
    return run_compare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
