"""``steptrace compare RUN_A RUN_B``: the main-vs-branch table, with true numbers and a verdict on noise.

Each row is one metric of run A (the baseline) and run B: both values, the difference B − A, the
relative difference, and a verdict:

* ``regression`` / ``improvement``: the per-step values of the two runs differ by more than
  run-to-run noise (a two-sided Mann–Whitney U rank test over the steady-state steps, normal
  approximation with tie correction, p < ``alpha``, default 0.01) **and** by at least
  ``min_effect`` (default 2 %) of A's value; which of the two depends on the metric's direction
  (times: lower is better; throughput: higher is better);
* ``noise``: the rank test does not separate them, or the difference is below ``min_effect``;
* ``—``: a metric with one value per run (totals, final loss) has no per-step distribution to
  test; its difference is shown without a verdict.

Steady state, by construction: a step counts when its status is ``ok``, it is not the rank's
first step (which carries compilation and warm-up), and no compile, checkpoint or eval time fell
in its idle window. Intervals, compute, tokens/s, TFLOP/s and MFU rows use steady-state steps of
the default rank (rank 0 when present); run-wide totals (goodput, idle by reason, compile,
checkpoints) use every step. Cross-rank skew comes from the collector's ``cluster.jsonl`` when
both runs have one.

The rows where the runs' ``metadata`` differ (versions, devices, git commit, tags) follow the
table: a difference there is often the explanation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from steptrace.analysis.runs import Run, RunDirError, find_run, load_run
from steptrace.analysis.summary import as_number, present_values, percentile

__all__ = ["Row", "compare_runs", "mann_whitney_p", "steady_steps", "add_compare_arguments", "run_compare", "main"]

#: Idle reasons that make a step not steady-state.
UNSTEADY_REASONS = ("compile", "checkpoint", "eval")
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.02
DEFAULT_METRIC = "interval_median"


# -- statistics ------------------------------------------------------------------------------
def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of the Mann–Whitney U test (normal approximation, tie-corrected, with
    continuity correction); None with fewer than 3 values on a side."""
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
    def __init__(self, run: Run):
        self.run = run
        self.rank = run.default_rank if run.ranks else None
        self.steps = run.steps(self.rank) if self.rank is not None else []
        self.steady = steady_steps(self.steps)
        self.checkpoints = run.checkpoints(self.rank) if self.rank is not None else []
        self.metadata = next(iter(run.records("metadata", self.rank)), {}) if self.rank is not None else {}
        self.cluster = [s for s in run.cluster_steps() if s.get("complete", True)]


def _tested(metric: str, label: str, a_values: list[float], b_values: list[float],
            summary: Callable[[Sequence[float]], float | None], unit: str, lower_is_better: bool,
            alpha: float, min_effect: float) -> Row:
    row = Row(metric, label, summary(a_values), summary(b_values), unit, lower_is_better)
    row.p_value = mann_whitney_p(a_values, b_values)
    if row.p_value is None or row.relative is None:
        row.verdict = "—" if row.p_value is None else "noise"
        return row
    if row.p_value < alpha and abs(row.relative) >= min_effect:
        worse = row.relative > 0 if lower_is_better else row.relative < 0
        row.verdict = "regression" if worse else "improvement"
    else:
        row.verdict = "noise"
    return row


def compare_runs(run_a: Run, run_b: Run, *, alpha: float = DEFAULT_ALPHA,
                 min_effect: float = DEFAULT_MIN_EFFECT) -> dict[str, Any]:
    """Compare two loaded runs: ``{"rows": [Row], "metadata": [(key, a, b)], "a": ..., "b": ...}``."""
    A, B = _Side(run_a), _Side(run_b)
    rows: list[Row] = []

    def tested(metric, label, fn, summary, unit, lower, steps="steady"):
        a = _per_step(getattr(A, steps), fn)
        b = _per_step(getattr(B, steps), fn)
        if a or b:
            rows.append(_tested(metric, label, a, b, summary, unit, lower, alpha, min_effect))

    def single(metric, label, a, b, unit="", lower=True):
        if a is not None or b is not None:
            rows.append(Row(metric, label, a, b, unit, lower))

    single("steps", "steps", float(len(A.steps)), float(len(B.steps)), lower=None)
    single("steady_steps", "steady-state steps", float(len(A.steady)), float(len(B.steady)), lower=None)
    final_a = next((v for v in map(_loss, reversed(A.steps)) if v is not None), None)
    final_b = next((v for v in map(_loss, reversed(B.steps)) if v is not None), None)
    single("loss_final", "final loss", final_a, final_b)
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
        single(f"{kind}_flops", f"{kind} FLOPs per step, median", _median(_per_step(A.steady, read)),
               _median(_per_step(B.steady, read)), lower=None)
    single("peak_flops", "peak FLOP/s (MFU's divisor)", _last(A.steps, "peak_flops"), _last(B.steps, "peak_flops"),
           lower=None)

    def goodput(side: _Side) -> float | None:
        wall = sum(present_values(side.steps, "interval_seconds"))
        return sum(present_values(side.steps, "compute_seconds")) / wall if wall > 0 else None

    single("goodput", "goodput (all steps)", goodput(A), goodput(B), lower=False)
    reasons: set[str] = set()
    for side in (A, B):
        for step in side.steps:
            reasons.update((step.get("idle_breakdown") or {}).keys())
    for reason in sorted(reasons):
        def idle_total(side: _Side, reason: str = reason) -> float:
            return sum(as_number((s.get("idle_breakdown") or {}).get(reason)) or 0.0 for s in side.steps)
        single(f"idle_{reason}", f"idle: {reason} (total)", idle_total(A), idle_total(B), "s")
    blocking_a = present_values(A.checkpoints, "blocking_seconds")
    blocking_b = present_values(B.checkpoints, "blocking_seconds")
    if blocking_a or blocking_b:
        rows.append(_tested("checkpoint_blocking", "checkpoint blocking, mean", blocking_a, blocking_b, _mean,
                            "s", True, alpha, min_effect))
    if A.rank is not None and B.rank is not None:
        single("compile", "compile time", _compile_seconds(run_a, A.rank, A.steps),
               _compile_seconds(run_b, B.rank, B.steps), "s")
    single("memory_peak", "peak device memory", _peak_memory(A.steps, "peak_bytes"),
           _peak_memory(B.steps, "peak_bytes"), "B")
    single("memory_peak_percent", "peak device memory, % of limit", _peak_memory(A.steps, "peak_percent"),
           _peak_memory(B.steps, "peak_percent"), "%")
    tested("bubble", "pipeline bubble", _bubble, _mean, "", True)
    if A.cluster and B.cluster:
        skew = lambda s: as_number(s.get("skew_seconds"))  # noqa: E731
        a_skew, b_skew = _per_step(A.cluster, skew), _per_step(B.cluster, skew)
        rows.append(_tested("skew", "cross-rank skew, median", a_skew, b_skew, _median, "s", True, alpha,
                            min_effect))

    metadata = []
    meta_a, meta_b = A.metadata, B.metadata
    for key in ("versions", "devices", "tags"):
        da, db = meta_a.get(key) or {}, meta_b.get(key) or {}
        for sub in sorted(set(da) | set(db)):
            if da.get(sub) != db.get(sub):
                metadata.append((f"{key}.{sub}", da.get(sub), db.get(sub)))
    for key in ("git_commit", "hostname"):
        if meta_a.get(key) != meta_b.get(key):
            metadata.append((key, meta_a.get(key), meta_b.get(key)))
    source_a, source_b = _last_text(A.steps, "flops_source"), _last_text(B.steps, "flops_source")
    if source_a != source_b:
        metadata.append(("flops_source", source_a, source_b))
    return {"a": {"path": str(run_a.path), "run_id": run_a.run_id}, "b": {"path": str(run_b.path),
            "run_id": run_b.run_id}, "rows": rows, "metadata": metadata, "alpha": alpha, "min_effect": min_effect}


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
STEADY_NOTE = ("Steady state: status ok, not the first step, no compile/checkpoint/eval idle. Verdicts: Mann–Whitney "
               "U over per-step values, p < {alpha}, and |rel.| ≥ {min_effect:.0%}.")


def _cells(row: Row) -> tuple[str, ...]:
    verdict = row.verdict
    if row.p_value is not None:
        verdict += f" (p={row.p_value:.2g})"
    return (row.label, _fmt(row.a, row.unit), _fmt(row.b, row.unit), _fmt_diff(row), _fmt_rel(row), verdict)


def render_markdown(result: dict[str, Any]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    out = [f"**A** `{result['a']['run_id']}` vs **B** `{result['b']['run_id']}`", "", line(HEADER),
           line(["---"] * len(HEADER))]
    out += [line(_cells(row)) for row in result["rows"]]
    out += ["", STEADY_NOTE.format(alpha=result["alpha"], min_effect=result["min_effect"])]
    if result["metadata"]:
        out += ["", line(("differs", "A", "B")), line(["---"] * 3)]
        out += [line((key, "—" if a is None else a, "—" if b is None else b)) for key, a, b in result["metadata"]]
    return "\n".join(out) + "\n"


def render_text(result: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    rows = [HEADER] + [_cells(row) for row in result["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    print(f"A: {result['a']['path']}\nB: {result['b']['path']}\n", file=file)
    for index, cells in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))),
              file=file)
        if index == 0:
            print("  ".join("-" * w for w in widths), file=file)
    print("\n" + STEADY_NOTE.format(alpha=result["alpha"], min_effect=result["min_effect"]), file=file)
    if result["metadata"]:
        print("\nwhere the runs differ:", file=file)
        for key, a, b in result["metadata"]:
            print(f"  {key}: {a} -> {b}", file=file)


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
                    where="post", label=f"{name}: {run.run_id}")
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
    raise RunDirError("give RUN_A RUN_B, or one run_dir holding at least two runs")


def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="RUN_A RUN_B (run directories), or one run_dir: its two newest runs, older as A")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (for a pull-request comment)")
    parser.add_argument("--json", action="store_true", help="every row as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw both runs' step-interval distributions")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (default 0.01)")
    parser.add_argument("--min-effect", type=float, default=DEFAULT_MIN_EFFECT * 100, metavar="PCT",
                        help="smallest relative difference called a regression or improvement (default 2)")
    parser.add_argument("--fail-on-regression", type=float, metavar="PCT", default=None,
                        help="exit 1 when --metric is a significant regression by more than PCT percent")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help=f"the metric --fail-on-regression checks (default {DEFAULT_METRIC})")
    return parser


def run_compare(args: argparse.Namespace) -> int:
    try:
        path_a, path_b = _two_runs(args.runs)
        run_a, run_b = load_run(path_a), load_run(path_b)
    except (RunDirError, OSError) as exc:
        print(f"steptrace compare: {exc}", file=sys.stderr)
        return 2
    for run in (run_a, run_b):
        for warning in run.warnings:
            print(f"steptrace compare: warning: {run.path}: {warning}", file=sys.stderr)
    if not (0 < args.alpha < 1) or args.min_effect < 0:
        print("steptrace compare: --alpha must be in (0, 1) and --min-effect >= 0", file=sys.stderr)
        return 2
    result = compare_runs(run_a, run_b, alpha=args.alpha, min_effect=args.min_effect / 100)
    if args.json:
        print(json.dumps({**result, "rows": [r.to_json() for r in result["rows"]]}, indent=1, default=str))
    elif args.markdown:
        print(render_markdown(result), end="")
    else:
        render_text(result)
    if args.plot:
        try:
            print(f"wrote {plot_intervals(run_a, run_b, args.plot)}", file=sys.stderr)
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
