"""``steptrace report``: a run directory's summary as rich tables, a PNG, or JSON.

The run is loaded by :mod:`steptrace.analysis.runs` and summarized by
:mod:`steptrace.analysis.summary`; this module renders per-step tables, the
checkpoint table and the summary panel, and with ``cluster.jsonl`` the cluster
view (slowest rank and skew per step) next to the per-rank view; ``--plot``
draws :func:`steptrace.analysis.plotting.plot_timeline`.

Only the standard library is imported at module level: ``rich`` and
``matplotlib`` are imported inside the functions that use them, so that
``import steptrace.report`` stays cheap inside a training process.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Sequence

from steptrace.analysis.goodput import BUCKETS, job_accounting
from steptrace.analysis.hangs import job_view
from steptrace.analysis.plotting import plot_timeline
from steptrace.analysis.runs import Run, RunDirError, ranks_reporting, find_run, load_run
from steptrace.analysis.stragglers import straggler_sentence, straggler_steps, summarize_stragglers
from steptrace.analysis.summary import as_number, percent_text, percentile, summarize, summarize_cluster

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
    number = as_number(value)
    return "—" if number is None else format(number, spec)




def _top_reasons(breakdown: Any, limit: int = 3) -> str:
    """``"checkpoint 18.60, other 0.01"``: the largest idle reasons.

    Reasons that would print as 0.00 are left out: at this precision they
    are noise (e.g. the sub-millisecond "other" gap between spans).
    """
    if not isinstance(breakdown, dict):
        return ""
    items = [(k, as_number(v)) for k, v in breakdown.items()]
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
    grid.add_row("wall", f"{summary['wall_seconds']:.3f} s", "step intervals + time before the first step")
    grid.add_row("compute", f"{summary['compute_seconds']:.3f} s", "")
    grid.add_row("goodput", percent_text(summary["goodput"]), "compute / wall")
    grid.add_row("compute p50 / p90", f"{_fmt(summary['compute_p50'])} / {_fmt(summary['compute_p90'])} s", "")
    grid.add_row("interval p50", f"{_fmt(summary['interval_p50'])} s", "")
    grid.add_row("tokens/s", _fmt(summary["tokens_per_second"], ",.0f"), "")
    grid.add_row("TFLOP/s", _fmt(summary["tflops_per_second"], ".2f"),
                 "hardware FLOPs per second of compute" if summary.get("hardware_flops_per_step") is not None
                 else "per second of compute")
    for row in _flops_rows(summary):
        grid.add_row(*row)
    for name, value in summary.get("scalars", {}).items():
        grid.add_row(name, _fmt(value["last"], ".4g"), f"last; mean {value['mean']:.4g} (s.log)")
    if summary.get("memory_peak_bytes") is not None:
        percent = summary.get("memory_peak_percent")
        grid.add_row("peak device memory", f"{summary['memory_peak_bytes'] / 2**30:.2f} GiB",
                     "" if percent is None else f"{percent:.1f}% of the device's limit")
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


def _attempts_table(job: dict, rank: int):
    from rich.table import Table

    table = Table(title=f"Attempts (rank {rank}): each process start of the run", title_justify="left")
    for name in ("attempt", "steps", "first", "last", "wasted steps", "seconds", "productive s", "startup s",
                 "ended"):
        table.add_column(name, justify="left" if name == "ended" else "right")
    for attempt in job["attempts"]:
        ended = attempt["status"]
        table.add_row(str(attempt["attempt"]), str(attempt["steps"]), str(attempt["first_step"]),
                      str(attempt["last_step"]), str(attempt["wasted_steps"]), f"{attempt['seconds']:.3f}",
                      f"{attempt['productive_seconds']:.3f}", f"{attempt['badput']['startup']:.3f}",
                      ended if ended == "clean" else f"[yellow]{ended}[/]")
    return table


def _job_panel(job: dict, rank: int):
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(justify="right")
    grid.add_column()
    total = job["total_seconds"]

    def share(seconds: float) -> str:
        return f"{seconds / total * 100:.1f}% of the job" if total > 0 else ""

    grid.add_row("job wall", f"{total:.3f} s", "first process start → last record, every attempt")
    grid.add_row("productive", f"{job['productive_seconds']:.3f} s", f"goodput {percent_text(job['goodput'])}")
    for bucket in BUCKETS:
        seconds = job["badput"][bucket]
        if seconds > 0:
            detail = share(seconds)
            if bucket == "custom" and job["custom"]:
                detail += " (" + ", ".join(f"{escape(k)} {v:.2f}" for k, v in job["custom"].items()) + ")"
            grid.add_row(f"badput: {bucket}", f"{seconds:.3f} s", detail)
    return Panel(grid, title=f"Job goodput across attempts (rank {rank}; docs/goodput.md)", title_align="left",
                 expand=False)


def _stall_panel(view: dict):
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    cause = view["cause_ranks"]
    grid.add_row("cause", escape(view["summary"]) if cause else f"[yellow]no single rank: {escape(view['reason'])}[/]")
    if cause:
        grid.add_row("why", escape(view["reason"]))
    for rank in view["ranks"]:
        ended = view["ended_after"][rank]
        state = "still stalled" if ended is None else f"moved on after {ended:.1f} s"
        span = view["span"][rank]
        grid.add_row(f"rank {rank}", escape(f"step {view['step'][rank]}{f', span {span}' if span else ''}: "
                                            f"{view['where'][rank]} ({state})"))
    return Panel(grid, title="Stall: where each rank was when it stopped moving (docs/hangs.md)",
                 title_align="left", expand=False)


def _flops_rows(summary: dict) -> list[tuple[str, str, str]]:
    """FLOPs per step, the peak, and MFU / HFU each with its formula line: the parts travel with
    the ratio, so a reader can redo the division."""
    rows = []
    peak = summary.get("peak_flops")
    for kind, ratio, what in (("model", "mfu", "MFU"), ("hardware", "hfu", "HFU")):
        per_step = summary.get(f"{kind}_flops_per_step")
        if per_step is None:
            continue
        source = summary.get("flops_source") if kind == "hardware" else "step(flops=...)"
        rows.append((f"{kind} FLOPs", f"{per_step / 1e9:,.3f} GFLOP", f"per step and device, from {source}"))
        tflops = summary.get(f"{kind}_tflops_per_second")
        if summary.get(ratio) is not None:
            rows.append((what, percent_text(summary[ratio]),
                         f"= {kind} FLOPs / compute s / peak = {_fmt(tflops, '.3f')} / {peak / 1e12:,.1f} TFLOP/s"
                         if peak else "mean of the steps' own (their records name no peak)"))
    if peak is None and rows and summary.get("mfu") is None and summary.get("hfu") is None:
        rows.append(("MFU / HFU", "-", "no peak for this device: set peak_tflops (docs/flops.md)"))
    elif peak is not None and not rows:
        rows.append(("MFU", "-", f"no FLOPs per step (peak {peak / 1e12:,.1f} TFLOP/s): pass flops"))
    return rows


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
            percent_text(s["goodput"]),
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
        reporting = ranks_reporting(step)
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
    grid.add_row("goodput", percent_text(summary["goodput"]), "all ranks: Σcompute / Σinterval")
    for rank, count in list(summary["straggler_steps"].items())[:8]:
        share = f"{count / complete * 100:.0f}% of complete steps" if complete else ""
        grid.add_row(f"straggler: rank {rank}", f"{count} step{'' if count == 1 else 's'}", share)
    for rank, count in list(summary["missing_rank_steps"].items())[:8]:
        grid.add_row(f"missing: rank {rank}", f"{count} step{'' if count == 1 else 's'}",
                     "not in the step when it was written")
    return Panel(grid, title="Cluster summary", title_align="left", expand=False)


def _stragglers(run: Run) -> dict:
    """Who slowed the run: from the collector's cluster.jsonl when there is one, else by joining the
    rank files here (the same rule)."""
    cluster_steps = run.cluster_steps()
    if cluster_steps:
        return summarize_stragglers(cluster_steps)
    return summarize_stragglers(straggler_steps(run.records_by_rank, run.world_size))


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
        job = job_accounting(run.records_by_rank.get(rank, []))
        if len(job["attempts"]) > 1:
            console.print(_attempts_table(job, rank))
            console.print(_job_panel(job, rank))
        if len(run.ranks) > 1:
            console.print(_rank_table(run))
        stalls = job_view(run)
        if stalls is not None:
            console.print(_stall_panel(stalls))
    elif rank is not None:
        run.resolve_rank(rank)  # no rank files: asking for one is an error
    cluster_steps = run.cluster_steps()
    if cluster_steps:
        console.print(_cluster_table(cluster_steps, max_rows))
        console.print(_cluster_panel(summarize_cluster(cluster_steps, run.late_spans())))
    sentence = straggler_sentence(_stragglers(run)) if len(run.ranks) > 1 or cluster_steps else None
    if sentence is not None:
        console.print(f"[bold]Straggler:[/] {escape(sentence)}")

    dropped = {k: v for k, v in run.dropped.items() if v}
    if dropped:
        parts = ", ".join(f"{escape(k)}={v}" for k, v in sorted(dropped.items()))
        console.print(f"[bold yellow]dropped records (all ranks): {parts}[/]")
    if show_warnings:
        for warning in run.warnings:
            console.print(f"[yellow]warning: {escape(warning)}[/]")




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
            # where each stalled rank was, and the cause (docs/hangs.md); null without stall records
            "stalls": job_view(run) if run.ranks else None,
            # every second of the job across attempts (docs/goodput.md); null without rank files
            "job": job_accounting(run.records_by_rank[rank]) if rank is not None else None,
        }
        stragglers = _stragglers(run)
        payload["stragglers"] = {**stragglers, "sentence": straggler_sentence(stragglers)}
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
