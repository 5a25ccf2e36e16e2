"""Read steptrace run directories and render reports.

A run directory is ``<run_dir>/<run_id>/`` holding one ``rank-<rank>.jsonl``
file per rank and, when a steptrace collector joined the run, its
``cluster.jsonl`` (one ``cluster_step`` record per step across ranks, plus
``late`` records).  This module loads those files, aggregates step records
into a summary, and renders it as rich tables, a matplotlib timeline, or JSON;
with ``cluster.jsonl`` the cluster view (slowest rank and skew per step) is
shown next to the per-rank view.

Only the standard library is imported at module level: ``rich`` and
``matplotlib`` are imported inside the functions that use them, so that
``import steptrace.report`` stays cheap inside a training process.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console

__all__ = [
    "RunDirError",
    "Run",
    "find_run",
    "load_run",
    "percentile",
    "summarize",
    "summarize_cluster",
    "render_report",
    "plot_timeline",
    "add_report_arguments",
    "run_report",
    "main",
]

_RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
#: Written by the steptrace collector (steptrace.collector): the cross-rank join.
CLUSTER_FILE = "cluster.jsonl"

# Fixed colours for the idle reasons the SDK emits itself, so the same reason
# looks the same across runs and plots.  User span names get a colour derived
# from a stable hash of the name (see _reason_colour).
_REASON_COLOURS = {
    "compute": "#2ca02c",
    "checkpoint": "#d62728",
    "data": "#1f77b4",
    "compile": "#9467bd",
    "eval": "#ff7f0e",
    "other": "#7f7f7f",
}
_KNOWN_REASON_ORDER = ["checkpoint", "data", "compile", "eval"]
_USER_PALETTE = [
    "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#aec7e8", "#ffbb78",
    "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
]


# Above this many steps the timeline switches from bars to filled bands.
_MAX_BARS = 500


class RunDirError(ValueError):
    """A run directory is missing, empty, or contains malformed records."""


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def _rank_files(directory: Path) -> dict[int, Path]:
    """Map rank -> file for every ``rank-<int>.jsonl`` directly in *directory*."""
    files: dict[int, Path] = {}
    for child in directory.iterdir():
        match = _RANK_FILE.match(child.name)
        if match and child.is_file():
            files[int(match.group(1))] = child
    return files


def _run_files(directory: Path) -> list[Path]:
    """The rank files and the collector's cluster file of *directory*."""
    files = list(_rank_files(directory).values())
    cluster = directory / CLUSTER_FILE
    if cluster.is_file():
        files.append(cluster)
    return files


def find_run(path: str | Path) -> Path:
    """Resolve *path* to a run directory.

    *path* is either a run directory (it holds ``rank-*.jsonl`` files, or a
    collector's ``cluster.jsonl``) or a parent ``run_dir``; for a parent, the
    run whose files were written most recently is chosen.
    """
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"{path}: no such directory")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    if _run_files(path):
        return path

    newest: tuple[float, Path] | None = None
    for child in path.iterdir():
        if not child.is_dir():
            continue
        files = _run_files(child)
        if not files:
            continue
        # Use the rank files' mtime rather than the directory's: appending
        # records updates the files but not the directory entry.
        mtime = max(f.stat().st_mtime for f in files)
        if newest is None or mtime > newest[0]:
            newest = (mtime, child)
    if newest is None:
        raise RunDirError(
            f"{path}: no rank-*.jsonl files (nor a collector's {CLUSTER_FILE}) here or in any run subdirectory"
        )
    return newest[1]


def _read_rank_file(file: Path, warnings: list[str]) -> list[dict]:
    """Parse one JSONL file, skipping a truncated final line with a warning."""
    records: list[dict] = []
    # A bad line is only an error if something follows it; a bad *last* line
    # is what a crash mid-write leaves behind, so it is held back until we
    # know whether more lines come.
    pending: tuple[int, str] | None = None
    with file.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if pending is not None:
                raise RunDirError(f"{file} line {pending[0]}: {pending[1]}")
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                pending = (lineno, "invalid UTF-8")
                continue
            except json.JSONDecodeError as exc:
                pending = (lineno, f"invalid JSON ({exc.msg})")
                continue
            if not isinstance(record, dict):
                pending = (lineno, "not a JSON object")
                continue
            records.append(record)
    if pending is not None:
        warnings.append(
            f"{file} line {pending[0]}: skipped truncated last line ({pending[1]})"
        )
    return records


def _step_key(record: dict) -> tuple[int, float]:
    """Sort key by step number; records without a numeric step go last."""
    step = _num(record.get("step"))
    return (0, step) if step is not None else (1, 0.0)


@dataclass
class Run:
    """All records of one run, grouped by rank (from the file name)."""

    path: Path
    records_by_rank: dict[int, list[dict]]
    warnings: list[str] = field(default_factory=list)
    #: The collector's records (``cluster.jsonl``), in file order; empty without a collector.
    cluster_records: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.records_by_rank)

    @property
    def default_rank(self) -> int:
        """Rank 0 if present, otherwise the lowest rank."""
        return 0 if 0 in self.records_by_rank else self.ranks[0]

    @property
    def run_id(self) -> str:
        for rank in self.ranks:
            for record in self.records_by_rank[rank]:
                if isinstance(record.get("run_id"), str):
                    return record["run_id"]
        for record in self.cluster_records:
            if isinstance(record.get("run_id"), str):
                return record["run_id"]
        return self.path.name

    @property
    def world_size(self) -> int:
        """World size as recorded, or the number of rank files if unrecorded."""
        for rank in self.ranks:
            for record in self.records_by_rank[rank]:
                size = record.get("world_size")
                if isinstance(size, int) and not isinstance(size, bool):
                    return size
        for record in self.cluster_records:
            size = record.get("world_size")
            if isinstance(size, int) and not isinstance(size, bool):
                return size
        return len(self.ranks)

    @property
    def dropped(self) -> dict[str, int]:
        """Dropped-record counts per reason, summed over all ranks."""
        totals: dict[str, int] = {}
        for record in self.records("run"):
            dropped = record.get("dropped")
            if isinstance(dropped, dict):
                for reason, count in dropped.items():
                    if _num(count) is not None:
                        totals[reason] = totals.get(reason, 0) + int(count)
        return totals

    def resolve_rank(self, rank: int | None) -> int:
        """Validate *rank*; None means the default rank."""
        if not self.records_by_rank:
            raise RunDirError(f"{self.path}: no rank files")
        if rank is None:
            return self.default_rank
        if rank not in self.records_by_rank:
            have = ", ".join(str(r) for r in self.ranks)
            raise RunDirError(f"{self.path}: no rank {rank} (ranks: {have})")
        return rank

    def records(self, type_: str, rank: int | None = None) -> list[dict]:
        """Records of one type; *rank* None means all ranks."""
        ranks = self.ranks if rank is None else [self.resolve_rank(rank)]
        return [
            r
            for k in ranks
            for r in self.records_by_rank[k]
            if r.get("type") == type_
        ]

    def steps(self, rank: int | None = None) -> list[dict]:
        """Step records of *rank* (default: rank 0), sorted by step number."""
        rank = self.resolve_rank(rank)
        return sorted(self.records("step", rank), key=_step_key)

    def checkpoints(self, rank: int | None = None) -> list[dict]:
        """Checkpoint records of *rank* (default: rank 0), sorted by step."""
        rank = self.resolve_rank(rank)
        return sorted(self.records("checkpoint", rank), key=_step_key)

    def cluster_steps(self) -> list[dict]:
        """The collector's ``cluster_step`` records, one per step, sorted by step.

        A step written twice (a collector restarted past the memory of what it
        emitted) keeps the record with the most ranks; on a tie, the later one.
        """
        best: dict[int, dict] = {}
        for record in self.cluster_records:
            step = record.get("step")
            if record.get("type") != "cluster_step" or isinstance(step, bool) or not isinstance(step, int):
                continue
            have = best.get(step)
            if have is None or _ranks_reporting(record) >= _ranks_reporting(have):
                best[step] = record
        return [best[k] for k in sorted(best)]

    def late_spans(self) -> list[dict]:
        """The collector's ``late`` records: a rank's step span that arrived after its step was written."""
        return [r for r in self.cluster_records if r.get("type") == "late"]


def _ranks_reporting(record: dict) -> int:
    value = _num(record.get("ranks_reporting"))
    return int(value) if value is not None else 0


def load_run(path: str | Path) -> Run:
    """Load a run directory (or the newest run under a parent run_dir)."""
    run_path = find_run(path)
    warnings: list[str] = []
    records_by_rank = {
        rank: _read_rank_file(file, warnings)
        for rank, file in sorted(_rank_files(run_path).items())
    }
    cluster_file = run_path / CLUSTER_FILE
    # The same torn-last-line tolerance as the rank files: a killed collector leaves one too.
    cluster = _read_rank_file(cluster_file, warnings) if cluster_file.is_file() else []
    return Run(path=run_path, records_by_rank=records_by_rank, warnings=warnings, cluster_records=cluster)


# --------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """Return *value* as a float if it is a real number (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


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
    return sum(_num(r.get(key)) or 0.0 for r in records)


def _present(records: Iterable[dict], key: str) -> list[float]:
    return [v for v in (_num(r.get(key)) for r in records) if v is not None]


def summarize(steps: Sequence[dict], checkpoints: Sequence[dict] = ()) -> dict:
    """Aggregate step and checkpoint records of one rank into a summary dict.

    Rates that need optional fields (tokens, flops, mfu) are None when no step
    carries them; they are computed only over the steps that do.
    """
    wall = _sum_field(steps, "interval_seconds")
    compute = _sum_field(steps, "compute_seconds")

    idle_totals: dict[str, float] = {}
    for step in steps:
        breakdown = step.get("idle_breakdown")
        if isinstance(breakdown, dict):
            for reason, seconds in breakdown.items():
                value = _num(seconds)
                if value is not None:
                    idle_totals[reason] = idle_totals.get(reason, 0.0) + value
    # Largest first: that is the order people read them in.
    idle_totals = dict(sorted(idle_totals.items(), key=lambda kv: -kv[1]))

    with_tokens = [s for s in steps if _num(s.get("tokens")) is not None]
    token_time = _sum_field(with_tokens, "interval_seconds")
    with_flops = [s for s in steps if _num(s.get("flops")) is not None]
    flop_time = _sum_field(with_flops, "compute_seconds")
    mfus = _present(steps, "mfu")

    return {
        "steps": len(steps),
        "error_steps": sum(1 for s in steps if s.get("status") == "error"),
        "wall_seconds": wall,
        "compute_seconds": compute,
        "idle_seconds": _sum_field(steps, "idle_seconds"),
        "goodput": compute / wall if wall > 0 else None,
        "idle_breakdown_totals": idle_totals,
        "compute_p50": percentile(_present(steps, "compute_seconds"), 50),
        "compute_p90": percentile(_present(steps, "compute_seconds"), 90),
        "interval_p50": percentile(_present(steps, "interval_seconds"), 50),
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
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "checkpoints": len(checkpoints),
        "checkpoint_blocking_seconds": _sum_field(checkpoints, "blocking_seconds"),
    }


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
    skews = _present(complete, "skew_seconds")
    compute = _sum_field(steps, "compute_sum_seconds")
    interval = _sum_field(steps, "interval_sum_seconds")
    world_sizes = [int(w) for w in _present(steps, "world_size")]
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
        "compute_median_p50": percentile(_present(complete, "compute_median_seconds"), 50),
        "goodput": compute / interval if interval > 0 else None,
    }


# --------------------------------------------------------------------------
# Rich rendering
# --------------------------------------------------------------------------


def _add_rows(table, items: list[dict], max_rows: int, add, columns: int, elided_column: int = 0) -> None:
    """Add a row per item, eliding the middle beyond *max_rows* (``<= 0``: all)."""
    if max_rows > 0 and len(items) > max_rows:
        head = max_rows // 2
        tail = max_rows - head
        for item in items[:head]:
            add(item)
        elided = len(items) - head - tail
        noun = "step" if elided == 1 else "steps"
        cells = [""] * columns
        cells[0] = "…"
        cells[elided_column] = f"[dim]… {elided} {noun} elided …[/]"
        table.add_row(*cells)
        for item in items[-tail:]:
            add(item)
    else:
        for item in items:
            add(item)


def _fmt(value: Any, spec: str = ".3f") -> str:
    """Format a number, or an em dash for missing values."""
    number = _num(value)
    return "—" if number is None else format(number, spec)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _top_reasons(breakdown: Any, limit: int = 3) -> str:
    """``"checkpoint 18.60, other 0.01"``: the largest idle reasons.

    Reasons that would print as 0.00 are left out: at this precision they
    are noise (e.g. the sub-millisecond "other" gap between spans).
    """
    if not isinstance(breakdown, dict):
        return ""
    items = [(k, _num(v)) for k, v in breakdown.items()]
    items = sorted(((k, v) for k, v in items if v and v >= 0.005), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.2f}" for k, v in items[:limit])


def _status_cell(step: dict) -> str:
    from rich.markup import escape

    status = str(step.get("status", "?"))
    if status == "ok":
        return "[green]ok[/]"
    if status == "error":
        error = str(step.get("error") or "")
        if len(error) > 60:
            error = error[:57] + "..."
        return f"[bold red]error[/] {escape(error)}" if error else "[bold red]error[/]"
    return escape(status)


def _step_table(steps: list[dict], rank: int, max_rows: int):
    from rich.table import Table

    table = Table(title=f"Steps (rank {rank})", title_justify="left")
    for name in ("step", "interval s", "compute s", "idle s"):
        table.add_column(name, justify="right")
    table.add_column("top idle reasons", ratio=1)
    table.add_column("tokens/s", justify="right")
    table.add_column("TFLOP/s", justify="right")
    table.add_column("status")

    def add(step: dict) -> None:
        table.add_row(
            str(step.get("step", "?")),
            _fmt(step.get("interval_seconds")),
            _fmt(step.get("compute_seconds")),
            _fmt(step.get("idle_seconds")),
            _top_reasons(step.get("idle_breakdown")),
            _fmt(step.get("tokens_per_second"), ",.0f"),
            _fmt(step.get("tflops_per_second"), ".2f"),
            _status_cell(step),
        )

    _add_rows(table, steps, max_rows, add, columns=8, elided_column=4)
    return table


def _checkpoint_table(checkpoints: list[dict], rank: int):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"Checkpoints (rank {rank})", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("host s", justify="right")
    table.add_column("blocking s", justify="right")
    table.add_column("async s", justify="right")
    table.add_column("status")
    for ckpt in checkpoints:
        status = str(ckpt.get("status", "?"))
        table.add_row(
            str(ckpt.get("step", "?")),
            _fmt(ckpt.get("host_seconds")),
            _fmt(ckpt.get("blocking_seconds")),
            _fmt(ckpt.get("async_seconds")),
            "[green]ok[/]" if status == "ok" else f"[red]{escape(status)}[/]",
        )
    return table


def _summary_panel(summary: dict, title: str):
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(justify="right")
    grid.add_column()

    errors = summary["error_steps"]
    error_text = f"[red]{errors} error{'' if errors == 1 else 's'}[/]" if errors else ""
    grid.add_row("steps", str(summary["steps"]), error_text)
    grid.add_row("wall", f"{summary['wall_seconds']:.3f} s", "sum of step intervals")
    grid.add_row("compute", f"{summary['compute_seconds']:.3f} s", "")
    grid.add_row("goodput", _pct(summary["goodput"]), "compute / wall")
    grid.add_row("compute p50 / p90", f"{_fmt(summary['compute_p50'])} / {_fmt(summary['compute_p90'])} s", "")
    grid.add_row("interval p50", f"{_fmt(summary['interval_p50'])} s", "")
    grid.add_row("tokens/s", _fmt(summary["tokens_per_second"], ",.0f"), "")
    grid.add_row("TFLOP/s", _fmt(summary["tflops_per_second"], ".2f"), "per second of compute")
    grid.add_row("MFU", _pct(summary["mfu"]), "mean over steps")
    grid.add_row(
        "checkpoint blocking",
        f"{summary['checkpoint_blocking_seconds']:.3f} s",
        f"{summary['checkpoints']} checkpoint{'' if summary['checkpoints'] == 1 else 's'}",
    )
    wall = summary["wall_seconds"]
    for reason, seconds in summary["idle_breakdown_totals"].items():
        share = f"{seconds / wall * 100:.1f}% of wall" if wall > 0 else ""
        grid.add_row(f"idle: {escape(reason)}", f"{seconds:.3f} s", share)
    return Panel(grid, title=title, title_align="left", expand=False)


def _rank_table(run: Run):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Per-rank summary", title_justify="left")
    # Short headers: ten columns must still fit an 80-column terminal.
    for name in ("rank", "steps", "wall s", "goodput", "p50 s",
                 "tok/s", "TFLOP/s", "top idle", "ckpt s", "errors"):
        table.add_column(name, justify="left" if name == "top idle" else "right")
    for rank in run.ranks:
        s = summarize(run.steps(rank), run.checkpoints(rank))
        top = next(iter(s["idle_breakdown_totals"].items()), None)
        table.add_row(
            str(rank),
            str(s["steps"]),
            f"{s['wall_seconds']:.3f}",
            _pct(s["goodput"]),
            _fmt(s["compute_p50"]),
            _fmt(s["tokens_per_second"], ",.0f"),
            _fmt(s["tflops_per_second"], ".2f"),
            f"{escape(top[0])} {top[1]:.2f}" if top else "",
            f"{s['checkpoint_blocking_seconds']:.3f}",
            f"[red]{s['error_steps']}[/]" if s["error_steps"] else "0",
        )
    return table


def _cluster_table(steps: list[dict], max_rows: int):
    from rich.table import Table

    table = Table(title="Cluster view: each step across ranks (steptrace collector)", title_justify="left")
    for name in ("step", "ranks", "slowest rank", "skew s", "compute min s", "median s", "max s", "interval s"):
        table.add_column(name, justify="right")
    table.add_column("missing ranks")

    def add(step: dict) -> None:
        reporting = _ranks_reporting(step)
        world = step.get("world_size")
        ranks = f"{reporting}/{world}" if isinstance(world, int) else str(reporting)
        missing = step.get("missing_ranks") if isinstance(step.get("missing_ranks"), list) else []
        straggler = step.get("straggler_rank")
        table.add_row(
            str(step.get("step", "?")),
            ranks if step.get("complete") else f"[yellow]{ranks}[/]",
            str(straggler) if isinstance(straggler, int) else "—",
            _fmt(step.get("skew_seconds")),
            _fmt(step.get("compute_min_seconds")),
            _fmt(step.get("compute_median_seconds")),
            _fmt(step.get("compute_max_seconds")),
            _fmt(step.get("interval_median_seconds")),
            f"[yellow]{_rank_list(missing)}[/]" if missing else "",
        )

    _add_rows(table, steps, max_rows, add, columns=9, elided_column=8)
    return table


def _rank_list(ranks: list, limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", … ({len(ranks)} in all)" if len(ranks) > limit else "")


def _cluster_panel(summary: dict):
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(justify="right")
    grid.add_column()
    complete = summary["complete_steps"]
    incomplete = summary["incomplete_steps"]
    grid.add_row("steps joined", str(summary["steps"]),
                 f"{complete} complete" + (f", [yellow]{incomplete} incomplete[/]" if incomplete else ""))
    if summary["late_spans"]:
        grid.add_row("late spans", str(summary["late_spans"]), "arrived after their step was written")
    grid.add_row("skew p50 / p90", f"{_fmt(summary['skew_p50'])} / {_fmt(summary['skew_p90'])} s",
                 "max − min compute over ranks, complete steps")
    grid.add_row("skew max", f"{_fmt(summary['skew_max'])} s", "")
    grid.add_row("goodput", _pct(summary["goodput"]), "all ranks: Σcompute / Σinterval")
    for rank, count in list(summary["straggler_steps"].items())[:8]:
        share = f"{count / complete * 100:.0f}% of complete steps" if complete else ""
        grid.add_row(f"straggler: rank {rank}", f"{count} step{'' if count == 1 else 's'}", share)
    for rank, count in list(summary["missing_rank_steps"].items())[:8]:
        grid.add_row(f"missing: rank {rank}", f"{count} step{'' if count == 1 else 's'}",
                     "not in the step when it was written")
    return Panel(grid, title="Cluster summary", title_align="left", expand=False)


def render_report(
    run: Run,
    *,
    rank: int | None = None,
    max_rows: int = 40,
    console: Console | None = None,
    show_warnings: bool = True,
) -> None:
    """Print a report of *run* for one rank (default rank 0) to *console*.

    ``max_rows <= 0`` shows every step.  With several ranks a per-rank
    summary table is added; with a collector's ``cluster.jsonl``, the
    cluster view (slowest rank, skew and ranks reporting per step, how often
    each rank was the straggler).  ``show_warnings=False`` omits load warnings
    (the CLI prints them to stderr instead).
    """
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    console.print(
        f"[bold]steptrace run[/] {escape(run.run_id)}  "
        f"[dim]{escape(str(run.path))}  world size {run.world_size}, "
        f"ranks {', '.join(map(str, run.ranks)) or '— (cluster.jsonl only)'}[/]"
    )
    if run.ranks or not run.cluster_records:
        rank = run.resolve_rank(rank)
        steps = run.steps(rank)
        checkpoints = run.checkpoints(rank)
        summary = summarize(steps, checkpoints)
        if steps:
            console.print(_step_table(steps, rank, max_rows))
        else:
            console.print(f"[yellow]no step records for rank {rank}[/]")
        if checkpoints:
            console.print(_checkpoint_table(checkpoints, rank))
        console.print(_summary_panel(summary, f"Summary (rank {rank})"))
        if len(run.ranks) > 1:
            console.print(_rank_table(run))
    elif rank is not None:
        run.resolve_rank(rank)  # no rank files: asking for one is an error
    cluster_steps = run.cluster_steps()
    if cluster_steps:
        console.print(_cluster_table(cluster_steps, max_rows))
        console.print(_cluster_panel(summarize_cluster(cluster_steps, run.late_spans())))

    dropped = {k: v for k, v in run.dropped.items() if v}
    if dropped:
        parts = ", ".join(f"{escape(k)}={v}" for k, v in sorted(dropped.items()))
        console.print(f"[bold yellow]dropped records (all ranks): {parts}[/]")
    if show_warnings:
        for warning in run.warnings:
            console.print(f"[yellow]warning: {escape(warning)}[/]")


# --------------------------------------------------------------------------
# Timeline plot
# --------------------------------------------------------------------------


def _reason_colour(reason: str) -> str:
    """A colour that depends only on the reason name (stable across runs)."""
    if reason in _REASON_COLOURS:
        return _REASON_COLOURS[reason]
    # crc32 rather than hash(): str hashes are salted per process.
    return _USER_PALETTE[zlib.crc32(reason.encode("utf-8")) % len(_USER_PALETTE)]


def _reason_order(reasons: Iterable[str]) -> list[str]:
    """Known reasons first in a fixed order, user reasons sorted, 'other' on top."""
    reasons = set(reasons)
    ordered = [r for r in _KNOWN_REASON_ORDER if r in reasons]
    ordered += sorted(reasons - set(_KNOWN_REASON_ORDER) - {"other"})
    if "other" in reasons:
        ordered.append("other")
    return ordered


def plot_timeline(run: Run, out_png: str | Path, *, rank: int | None = None) -> Path:
    """Save a per-step stacked bar chart (compute, then idle reasons) as PNG."""
    # Build a Figure directly instead of going through pyplot: it renders with
    # Agg without switching the global backend of a caller's session.
    from matplotlib.figure import Figure

    rank = run.resolve_rank(rank)
    steps = [s for s in run.steps(rank) if _num(s.get("step")) is not None]
    checkpoints = run.checkpoints(rank)
    summary = summarize(steps, checkpoints)

    xs = [_num(s["step"]) for s in steps]
    # Steps may be logged sparsely (every N); size bars to the smallest gap.
    gaps = [b - a for a, b in zip(xs, xs[1:]) if b > a]
    width = 0.8 * (min(gaps) if gaps else 1.0)

    fig = Figure(figsize=(min(max(6.0, 0.12 * len(steps) + 4), 24.0), 4.5))
    ax = fig.add_subplot()

    bottoms = [0.0] * len(steps)
    # One Rectangle per bar gets slow (minutes for 20k steps) and the bars are
    # sub-pixel anyway, so long runs are drawn as filled step bands instead.
    as_bars = len(steps) <= _MAX_BARS

    def stack(label: str, heights: list[float]) -> None:
        tops = [b + h for b, h in zip(bottoms, heights)]
        colour = _reason_colour(label)
        if as_bars:
            ax.bar(xs, heights, width=width, bottom=bottoms, label=label,
                   color=colour, linewidth=0)
        else:
            ax.fill_between(xs, bottoms, tops, step="mid", label=label,
                            color=colour, linewidth=0)
        bottoms[:] = tops

    if steps:
        stack("compute", [_num(s.get("compute_seconds")) or 0.0 for s in steps])
        reasons = {
            reason
            for s in steps
            if isinstance(s.get("idle_breakdown"), dict)
            for reason in s["idle_breakdown"]
        }
        for reason in _reason_order(reasons):
            stack(reason, [
                (_num(s["idle_breakdown"].get(reason)) or 0.0)
                if isinstance(s.get("idle_breakdown"), dict) else 0.0
                for s in steps
            ])

        top = {x: b for x, b in zip(xs, bottoms)}
        span = max(bottoms) if bottoms else 1.0
        ckpt_steps = [_num(c.get("step")) for c in checkpoints]
        ckpt_xs = [x for x in ckpt_steps if x in top]
        if ckpt_xs:
            ax.scatter(ckpt_xs, [top[x] + 0.03 * span for x in ckpt_xs], marker="v",
                       color=_REASON_COLOURS["checkpoint"], zorder=3,
                       label="checkpoint saved")
        err_xs = [x for x, s in zip(xs, steps) if s.get("status") == "error"]
        if err_xs:
            ax.scatter(err_xs, [top[x] + 0.03 * span for x in err_xs], marker="x",
                       color="black", zorder=3, label="error step")
        # Matplotlib lists scatter markers before bars; put the stack first,
        # in stacking order, so the legend reads like the bars.
        handles, labels = ax.get_legend_handles_labels()
        markers = {"checkpoint saved", "error step"}
        order = sorted(range(len(labels)), key=lambda i: labels[i] in markers)
        ax.legend([handles[i] for i in order], [labels[i] for i in order],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no step records for rank {rank}", ha="center",
                va="center", transform=ax.transAxes)

    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title(f"{run.run_id} (rank {rank}): goodput {_pct(summary['goodput'])}")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, format="png", dpi=100)
    return out_png


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``report`` arguments to *parser* (shared with the main CLI)."""
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory, or a run_dir holding runs (newest is used)")
    parser.add_argument("--rank", type=int, default=None,
                        help="rank to report on (default: 0)")
    parser.add_argument("--max-rows", type=int, default=40, metavar="N",
                        help="show at most N step rows, eliding the middle (0: all)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write a per-step timeline PNG")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON instead of tables")
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Run the report for parsed *args*; returns the process exit code."""
    try:
        run = load_run(args.run_dir)
        # A collector's run dir may hold cluster.jsonl and no rank files.
        rank = run.resolve_rank(args.rank) if run.ranks or args.rank is not None else None
    except (RunDirError, OSError) as exc:  # OSError: e.g. an unreadable file
        print(f"steptrace report: {exc}", file=sys.stderr)
        return 2

    # Warnings go to stderr so that --json output on stdout stays parseable.
    for warning in run.warnings:
        print(f"steptrace report: warning: {warning}", file=sys.stderr)

    if args.json:
        summary = summarize(run.steps(rank), run.checkpoints(rank)) if rank is not None else {}
        cluster_steps = run.cluster_steps()
        payload = {
            "run_id": run.run_id,
            "path": str(run.path),
            "rank": rank,
            "ranks": run.ranks,
            **summary,
            "dropped": run.dropped,
            "warnings": run.warnings,
            # null when no collector joined the run
            "cluster": summarize_cluster(cluster_steps, run.late_spans()) if run.cluster_records else None,
        }
        print(json.dumps(payload, indent=2))
    else:
        render_report(run, rank=rank, max_rows=args.max_rows, show_warnings=False)

    if args.plot:
        if rank is None:
            print("steptrace report: --plot needs rank files; this run has only cluster.jsonl", file=sys.stderr)
            return 2
        try:
            written = plot_timeline(run, args.plot, rank=rank)
        except OSError as exc:
            print(f"steptrace report: cannot write plot: {exc}", file=sys.stderr)
            return 1
        # Keep stdout pure JSON in --json mode.
        print(f"wrote {written}", file=sys.stderr if args.json else sys.stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m steptrace.report`` / ``steptrace report``."""
    parser = argparse.ArgumentParser(
        prog="steptrace report",
        description="Summarize a steptrace run directory.",
    )
    add_report_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
