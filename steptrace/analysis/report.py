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
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

from steptrace.analysis._text import markup, visible
from steptrace.analysis.goodput import job_accounting, job_goodput
from steptrace.analysis.goodput_gmg import GMG_BADPUT_TYPES, gmg_view
from steptrace.analysis.hangs import job_view
from steptrace.analysis.plotting import plot_timeline
from steptrace.analysis.runs import Run, RunDirError, ranks_reporting, find_run, load_run
from steptrace.analysis.health import health_lines, rank_windows, straggler_cause, summarize_health
from steptrace.analysis.pauses import gc_finding, gc_sentence
from steptrace.analysis.stragglers import straggler_sentence, straggler_steps, summarize_stragglers
from steptrace.analysis.summary import (as_number, compile_by_function, compile_sentence, compute_beside_commits,
                                        flops_rate, percent_text, percentile, step_split, summarize,
                                        summarize_cluster)

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


#: Idle reasons that make a step worth showing when rows are limited.
NOTABLE_REASONS = ("checkpoint", "eval", "compile")
#: How many of the slowest steps --max-rows keeps.
SLOWEST_KEPT = 5
#: Columns of a report written to a file or pipe with no --width or COLUMNS: rows never wrap.
UNWRAPPED_WIDTH = 1000


def _failed_step(item: dict) -> bool:
    return item.get("status") not in ("ok", None)


def notable_rows(items: list[dict], max_rows: int, *, why: "Any" = None, why_label: str = "checkpoint/eval/compile",
                 failed: "Any" = _failed_step,
                 largest: Sequence[tuple[str, str]] = (("interval_seconds", "slowest"),),
                 ) -> tuple[list[dict], dict[str, int]]:
    """The rows to show when *max_rows* (``> 0``) is less than ``len(items)``, in their order.

    Kept first, in this priority: the first step, failed ones (*failed*: a step → whether it
    failed; by default a status other than ``ok``), those with notable work (*why*: a step →
    whether it is notable, counted as *why_label*; by default compile, checkpoint or eval idle),
    for each ``(key, label)`` of *largest* the ``SLOWEST_KEPT`` steps with the largest *key*, then
    steps spaced evenly through the rest of the run (typical ones). Returns the rows and how many
    were kept for each reason.
    """
    if max_rows <= 0 or len(items) <= max_rows:
        return list(items), {}
    if why is None:
        def why(item: dict) -> bool:
            breakdown = item.get("idle_breakdown")
            return isinstance(breakdown, dict) and any((as_number(breakdown.get(r)) or 0) > 0 for r in NOTABLE_REASONS)
    chosen: dict[int, str] = {}

    def keep(indices: "Any", reason: str) -> None:
        for index in indices:
            if len(chosen) >= max_rows:
                return
            chosen.setdefault(index, reason)

    keep([0], "first")
    keep([i for i, item in enumerate(items) if failed(item)], "failed")
    keep([i for i, item in enumerate(items) if why(item)], why_label)
    for key, label in largest:
        ranked = sorted((i for i, item in enumerate(items) if as_number(item.get(key)) is not None),
                        key=lambda i, key=key: -(as_number(items[i].get(key)) or 0.0))
        keep([i for i in ranked if i not in chosen][:SLOWEST_KEPT], label)
    rest = [i for i in range(len(items)) if i not in chosen]
    room = max_rows - len(chosen)
    if room > 0 and rest:
        keep([rest[round(k * (len(rest) - 1) / max(room - 1, 1))] for k in range(min(room, len(rest)))],
             "evenly spaced")
    counts: dict[str, int] = {}
    for reason in chosen.values():
        counts[reason] = counts.get(reason, 0) + 1
    return [items[i] for i in sorted(chosen)], counts


def _add_rows(table, items: list[dict], max_rows: int, add, *, noun: str = "steps", **choose: Any) -> None:
    """Add a row per item; beyond *max_rows* (``<= 0``: all) only the notable ones
    (:func:`notable_rows`, given *choose*), and a note (``table.steptrace_note``) saying how many
    were left out and which were kept."""
    shown, counts = notable_rows(items, max_rows, **choose)
    for item in shown:
        add(item)
    if len(shown) < len(items):
        kept = ", ".join(f"{reason} {count}" for reason, count in counts.items())
        # Printed after the table (render_report), on one line: a caption would wrap at its width.
        table.steptrace_note = (f"[dim]{len(shown)} of {len(items)} {noun} shown ({kept}); "
                                f"{len(items) - len(shown)} left out (--max-rows 0 shows all)[/]")


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
    return ", ".join(f"{markup(k)} {v:.2f}" for k, v in items[:limit])


def _status_cell(step: dict) -> str:
    from steptrace.analysis._text import markup as escape

    status = str(step.get("status", "?"))
    if status == "ok":
        return "[green]ok[/]"
    if status == "error":
        error = str(step.get("error") or "")
        if len(error) > 60:
            error = error[:57] + "..."
        return f"[bold red]error[/] {escape(error)}" if error else "[bold red]error[/]"
    return escape(status)


def _has(items: list[dict], key: str) -> bool:
    return any(as_number(item.get(key)) is not None for item in items)


def _step_table(steps: list[dict], rank: int, max_rows: int):
    from rich.table import Table

    table = Table(title=f"Steps (rank {rank})", title_justify="left")
    # Columns no step has data for (tokens, FLOPs, MFU not given) are left out, not dashes.
    columns: list[tuple[str, Any]] = [
        ("step", lambda step: markup(step.get("step", "?"))),
        ("interval s", lambda step: _fmt(step.get("interval_seconds"))),
    ]
    if _has(steps, "collective_wait_seconds"):
        # Waiting shown as waiting: own compute + wait + idle (by reason, less the wait) = interval.
        def idle_less_wait(step: dict) -> dict:
            return step_split(step).idle_breakdown

        columns += [
            ("own compute s", lambda step: _fmt(step_split(step).own_compute_seconds)
             if as_number(step.get("compute_seconds")) is not None else "—"),
            ("wait s", lambda step: _fmt(step.get("collective_wait_seconds"))),
            ("idle s", lambda step: _fmt(sum(idle_less_wait(step).values()))
             if as_number(step.get("idle_seconds")) is not None else "—"),
            ("top idle reasons", lambda step: _top_reasons(idle_less_wait(step))),
        ]
    else:
        columns += [
            ("compute s", lambda step: _fmt(step.get("compute_seconds"))),
            ("idle s", lambda step: _fmt(step.get("idle_seconds"))),
            ("top idle reasons", lambda step: _top_reasons(step.get("idle_breakdown"))),
        ]
    if _has(steps, "tokens_per_second"):
        columns.append(("tokens/s", lambda step: _fmt(step.get("tokens_per_second"), ",.0f")))
    if _has(steps, "tflops_per_second"):
        columns.append(("FLOP/s", lambda step: flops_rate(step.get("tflops_per_second"))))
    if _has(steps, "mfu"):
        columns.append(("MFU", lambda step: percent_text(as_number(step.get("mfu")))))
    columns.append(("status", _status_cell))
    for name, _ in columns:
        if name == "top idle reasons":
            table.add_column(name, ratio=1)
        else:
            table.add_column(name, justify="left" if name == "status" else "right")

    def add(step: dict) -> None:
        table.add_row(*(cell(step) for _, cell in columns))

    _add_rows(table, steps, max_rows, add)
    return table


def _checkpoint_table(checkpoints: list[dict], rank: int):
    from steptrace.analysis._text import markup as escape
    from rich.table import Table

    table = Table(title=f"Checkpoints (rank {rank})", title_justify="left")
    table.add_column("step", justify="right")
    # A trainer that calls the state after n steps `n` saves it before step n runs: then the save
    # follows step n - 1, and its blocking time counts from that step's end. Said only when it differs.
    after = any("after_step" in c and c.get("after_step") != c.get("step") for c in checkpoints)
    if after:
        table.add_column("after step", justify="right")
    table.add_column("host s", justify="right")
    table.add_column("blocking s", justify="right")
    table.add_column("async s", justify="right")
    table.add_column("status")
    for ckpt in checkpoints:
        status = str(ckpt.get("status", "?"))
        table.add_row(
            markup(ckpt.get("step", "?")),
            *([("—" if ckpt.get("after_step") is None else markup(ckpt.get("after_step")))] if after else []),
            _fmt(ckpt.get("host_seconds")),
            _fmt(ckpt.get("blocking_seconds")),
            _fmt(ckpt.get("async_seconds")),
            "[green]ok[/]" if status == "ok" else f"[red]{escape(status)}[/]",
        )
    return table


def _panel_grid():
    """The label / value / note grid the summary and job panels share."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(justify="right")
    grid.add_column()
    return grid


#: How each badput bucket is labelled in the summary (time that was not productive, by why).
_BUCKET_LABELS = {"collective_wait": "waiting in collectives", "wasted": "badput: wasted",
                  "downtime": "badput: downtime"}


def _summary_panel(summary: dict, job: dict, title: str):
    """One rank's summary: its wall from the process start, the productive part, step statistics,
    and the rest of the wall by why (adding up to the wall with the productive part)."""
    from steptrace.analysis._text import markup as escape
    from rich.panel import Panel

    grid = _panel_grid()

    errors = summary["error_steps"]
    error_text = f"[red]{errors} error{'' if errors == 1 else 's'}[/]" if errors else ""
    grid.add_row("steps", str(summary["steps"]), error_text)
    wall = job["total_seconds"]
    attempts = len(job["attempts"])
    grid.add_row("wall", f"{wall:.3f} s",
                 "process start → last record" + (f", {attempts} attempts" if attempts > 1 else ""))
    grid.add_row("productive", f"{job['productive_seconds']:.3f} s",
                 "own compute of the kept steps" + (" (waiting in collectives excluded)"
                                                    if summary.get("collective_wait_seconds") is not None else ""))
    if summary.get("collective_wait_seconds") is not None:
        grid.add_row("own compute p50 / p90", f"{_fmt(summary['own_compute_p50'])} / "
                     f"{_fmt(summary['own_compute_p90'])} s", "per step, waiting in collectives excluded")
    else:
        grid.add_row("compute p50 / p90", f"{_fmt(summary['compute_p50'])} / {_fmt(summary['compute_p90'])} s", "")
    grid.add_row("interval p50", f"{_fmt(summary['interval_p50'])} s", "")
    # Rates nobody gave the inputs for (tokens, flops) are left out, not dashes.
    if summary["tokens_per_second"] is not None:
        # The whole run's rate; `steptrace compare` shows "steady tokens/s", a median over steady steps.
        grid.add_row("tokens/s", _fmt(summary["tokens_per_second"], ",.0f"), "whole run: Σ tokens / Σ step intervals")
    if summary["tflops_per_second"] is not None:
        grid.add_row("FLOP/s", flops_rate(summary["tflops_per_second"]),
                     "hardware FLOPs per second of compute" if summary.get("hardware_flops_per_step") is not None
                     else "per second of compute")
    for row in _flops_rows(summary):
        grid.add_row(*row)
    for name, value in summary.get("scalars", {}).items():
        grid.add_row(markup(name), _fmt(value["last"], ".4g"), f"last; mean {value['mean']:.4g} (s.log)")
    if summary.get("memory_peak_bytes") is not None:
        percent = summary.get("memory_peak_percent")
        grid.add_row("peak device memory", f"{summary['memory_peak_bytes'] / 2**30:.2f} GiB",
                     "" if percent is None else f"{percent:.1f}% of the device's limit")
    grid.add_row(
        "checkpoint blocking",
        f"{summary['checkpoint_blocking_seconds']:.3f} s",
        f"{summary['checkpoints']} checkpoint{'' if summary['checkpoints'] == 1 else 's'}"
        + checkpoint_gap_note(summary["checkpoint_blocking_seconds"], job["badput"].get("checkpoint", 0.0)),
    )
    # The rest of the wall, by why: with "productive" it adds up to the wall.
    pieces = [(bucket, seconds) for bucket, seconds in job["badput"].items() if bucket != "custom"]
    pieces += list(job["custom"].items())
    for name, seconds in sorted(pieces, key=lambda kv: -kv[1]):
        if seconds <= 0:
            continue
        share = f"{seconds / wall * 100:.1f}% of wall" if wall > 0 else ""
        label = _BUCKET_LABELS.get(name, f"idle: {escape(name)}")
        if name == "collective_wait":
            share += " (exposed communication)"
        grid.add_row(label, f"{seconds:.3f} s", share)
    return Panel(grid, title=title, title_align="left", expand=False)


def checkpoint_gap_note(blocking_seconds: float, idle_seconds: float) -> str:
    """Why "checkpoint blocking" and "idle: checkpoint" differ, where they show different numbers: they
    count different things (docs/report.md), and two figures side by side must not look like a rounding slip."""
    if f"{blocking_seconds:.3f}" == f"{idle_seconds:.3f}":
        return ""
    difference = idle_seconds - blocking_seconds
    why = ("such as waits for an async commit outside a save (a `checkpoint` span: orbax's wait_until_finished "
           "or close, DeepSpeed's decoupled commit in a later step) are idle, not a save's blocking"
           if difference > 0 else
           "such as a span inside a save (a compile): its blocking, but idle under its own name")
    return f"; idle: checkpoint {'+' if difference > 0 else '-'}{abs(difference) * 1e3:.1f} ms: {why}"


#: An async commit's steps are named in the report from this much compute over the typical step's.
COMMIT_COMPUTE_RATIO_SHOWN = 1.1


def commit_sentence(entries: list[dict], steps: list[dict]) -> str:
    """One line on the steps async checkpoint commits ran beside, where their compute exceeds the typical
    step's by 10 % or more (:func:`compute_beside_commits`), and why it does: "" when none does."""
    shown = [e for e in entries if e["ratio"] >= COMMIT_COMPUTE_RATIO_SHOWN]
    if not shown:
        return ""
    parts = []
    for entry in shown[:4]:
        numbers = entry["steps"]
        consecutive = len(numbers) > 2 and all(isinstance(n, int) for n in numbers) and \
            numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        where = f"{numbers[0]}–{numbers[-1]}" if consecutive else ", ".join(str(n) for n in numbers)
        parts.append(f"checkpoint {entry['step']}'s commit ({entry['async_seconds']:.3f} s) ran beside step"
                     f"{'s' if len(entry['steps']) > 1 else ''} {where}: compute {entry['ratio']:.2f}× the typical "
                     f"step's ({entry['compute_seconds']:.3f} s; typical {entry['typical_compute_seconds']:.3f} s)")
    if len(shown) > 4:
        parts.append(f"{len(shown) - 4} more")
    beside = {n for e in shown for n in e["steps"]}
    observed = any(s.get("end_source") == "observed" for s in steps if s.get("step") in beside)
    why = ("JAX, no device clock: on CPU the commit's threads share the cores XLA computes on (real compute: the "
           "XLA trace shows it), and an end can be seen late while a garbage collection on the commit's thread holds "
           "the GIL (docs/devices.md)" if observed else "the device's own time: the commit slowed the device's work")
    return "; ".join(parts) + f". Why: {why}"


def goodput_line(job: dict) -> str:
    """The headline: the job's goodput with its parts, and its definition on the line below (rich markup)."""
    return (f"[bold]Goodput {percent_text(job['goodput'])}[/] = productive {job['productive_seconds']:.3f} s / "
            f"wall {job['total_seconds']:.3f} s\n[dim]  {job['definition']}[/]")


def _gmg_panel(view: dict):
    """The shown rank's badput in ml-goodput-measurement's names (``--vocabulary gmg``), each with the
    steptrace buckets it holds, and GMG's ideal step time beside steptrace's median interval."""
    from rich.panel import Panel

    grid = _panel_grid()
    total = view["total_seconds"]

    def share(seconds: float) -> str:
        return f"{seconds / total * 100:.1f}% of wall" if total > 0 else ""

    productive = view["productive_seconds"]
    grid.add_row("productive (GoodputType.TOTAL)", f"{productive:.3f} s", share(productive))
    for name in GMG_BADPUT_TYPES:
        value = view["badput_seconds"][name]
        sources = view["sources"].get(name, {})
        if isinstance(value, dict):
            for event, seconds in sorted(value.items(), key=lambda kv: -kv[1]):
                grid.add_row(f"{name}/{markup(event)}", f"{seconds:.3f} s", share(seconds))
            continue
        if value is None:
            grid.add_row(name, "—", f"[dim]{view['not_separated'][name]}[/]")
            continue
        parts = ", ".join(f"{markup(bucket)} {seconds:.3f}" for bucket, seconds in sources.items() if seconds)
        grid.add_row(name, f"{value:.3f} s", share(value) + (f" [dim](steptrace: {parts})[/]" if parts else ""))
    ideal = view["ideal_step_time"]
    grid.add_row("ideal step time (GMG)", "—" if ideal["gmg_seconds"] is None else f"{ideal['gmg_seconds']:.3f} s",
                 f"host step starts, {ideal['steps']} steps"
                 + (f", {ideal['steps_under_min']} under {ideal['min_step_seconds']:g} s ignored"
                    if ideal["steps_under_min"] else ""))
    grid.add_row("GMG's rule on device intervals", _fmt(ideal["gmg_rule_on_intervals_seconds"]) + " s", "")
    grid.add_row("steptrace interval p50", _fmt(ideal["steptrace_interval_p50_seconds"]) + " s", "")
    return Panel(grid, title=f"Badput in ml-goodput-measurement's words (rank {view['rank']})",
                 title_align="left", expand=False)


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


def after_restore_line(cost: dict) -> str:
    """One first step after a restore, in words: its interval = the run's typical step + its one-off cost."""
    head = f"step {cost['step']} (attempt {cost['attempt']}): interval {_fmt(cost['interval_seconds'])} s"
    if cost["one_off_seconds"] is None:
        return head + " (no typical step to compare with)"
    return (f"{head} = typical step {_fmt(cost['typical_step_interval_seconds'])} s + one-off "
            f"{_fmt(cost['one_off_seconds'])} s (compile, warm-up; {_fmt(cost['one_off_compute_seconds'])} s of "
            f"it compute, charged to startup)")


def capture_lines(run: Any) -> list[dict]:
    """Every rank's deep captures (``capture`` records, docs/capture.md), in time order, each with the
    one line the report prints (``sentence``)."""
    out = []
    for rank, records in sorted(run.records_by_rank.items()):
        for record in records:
            if record.get("type") != "capture":
                continue
            reason = str(record.get("reason") or record.get("trigger") or "capture")
            if record.get("status") == "ok":
                first, last = record.get("first_step"), record.get("last_step")
                steps = f"step {first}" if first == last else f"steps {first}–{last}"
                sentence = (f"rank {rank}: {reason}: {record.get('profiler')} trace at {record.get('path')} "
                            f"({steps}, {int(record.get('bytes') or 0) / 2**20:.1f} MiB)")
                paused = [as_number(record.get(k)) for k in ("start_seconds", "stop_seconds")]
                written = as_number(record.get("write_seconds"))
                if None not in paused and written is not None:
                    sentence += (f"; the training thread paused {sum(p for p in paused if p is not None):.3f} s "
                                 f"to start and stop it, the trace written in {written:.3f} s beside the steps")
            elif record.get("status") == "skipped":
                sentence = f"rank {rank}: {reason}: no trace ({record.get('skipped_because')})"
            else:
                sentence = f"rank {rank}: {reason}: the trace failed ({record.get('error')})"
            out.append({"rank": rank, **{k: record.get(k) for k in (
                "status", "trigger", "trigger_step", "first_step", "last_step", "path", "profiler", "bytes",
                "start_time", "start_seconds", "stop_seconds", "write_seconds", "skipped_because")},
                "sentence": sentence})
    out.sort(key=lambda c: (c["start_time"] or 0.0, c["rank"]))
    return out


def capture_sentences(lines: list[dict]) -> list[str]:
    """The report's capture lines, a rank's run of refusals by the cooldown of one trigger in one line: every
    refused anomaly trigger is a record of its own (a slow stretch refuses one a step until the rule's window
    takes the new pace), which as many lines would bury the traces taken. ``report --json`` keeps each."""
    out: list[str] = []
    run: list[dict] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0]["sentence"])
        elif run:
            first, last = run[0], run[-1]
            out.append(f"rank {first['rank']}: {len(run)} {first['trigger']} triggers refused by the cooldown, "
                       f"steps {first['trigger_step']}–{last['trigger_step']} (the first: {first['sentence']})")
        run.clear()

    for line in lines:
        refused = line.get("status") == "skipped" and str(line.get("skipped_because") or "").startswith("cooldown")
        if refused and run and (run[0]["rank"], run[0]["trigger"]) == (line["rank"], line["trigger"]):
            run.append(line)
            continue
        close()
        if refused:
            run.append(line)
        else:
            out.append(line["sentence"])
    close()
    return out


def _stall_panel(view: dict):
    from rich.panel import Panel

    escape = markup  # names and frames come from the run files: data, never markup
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


def _rank_table(run: Run, jobs: dict):
    from steptrace.analysis._text import markup as escape
    from rich.table import Table

    table = Table(title="Per-rank summary (goodput: each rank's own compute / its wall)", title_justify="left")
    summaries = [(rank, summarize(run.steps(rank), run.checkpoints(rank))) for rank in run.ranks]
    # Short headers: the columns must still fit an 80-column terminal. Rates no rank has are left out.
    rates = [key for key in ("tokens_per_second", "tflops_per_second")
             if any(s[key] is not None for _, s in summaries)]
    waits = any(s["collective_wait_seconds"] is not None for _, s in summaries)
    headers = ["rank", "steps", "wall s", "goodput"] + (["wait s"] if waits else []) + ["compute p50"]
    headers += [{"tokens_per_second": "tok/s", "tflops_per_second": "FLOP/s"}[key] for key in rates]
    headers += ["top idle", "ckpt s", "errors"]
    for name in headers:
        table.add_column(name, justify="left" if name == "top idle" else "right")
    for rank, s in summaries:
        job = jobs.get(rank)
        # The largest reason the rank was idle, from its accounting (start-up from the process start).
        idle = ({**{b: v for b, v in job["badput"].items() if b not in ("custom", "collective_wait")},
                 **job["custom"]} if job else s["idle_breakdown_totals"])
        top = max(((k, v) for k, v in idle.items() if v > 0), key=lambda kv: kv[1], default=None)
        table.add_row(
            str(rank),
            str(s["steps"]),
            "—" if job is None else f"{job['total_seconds']:.3f}",
            "—" if job is None else percent_text(job["goodput"]),
            *([_fmt(s["collective_wait_seconds"])] if waits else []),
            _fmt(s["own_compute_p50"] if waits else s["compute_p50"]),
            *(_fmt(s[key], ",.0f") if key == "tokens_per_second" else flops_rate(s[key]) for key in rates),
            f"{escape(top[0])} {top[1]:.2f}" if top else "",
            f"{s['checkpoint_blocking_seconds']:.3f}",
            f"[red]{s['error_steps']}[/]" if s["error_steps"] else "0",
        )
    if waits:
        table.steptrace_note = ("[dim]wait s: time waiting for other ranks in collectives (exposed communication), "
                                "not the rank's productive time; compute p50: its own compute per step[/]")
    return table


def _cluster_table(steps: list[dict], max_rows: int, joined_by: str = "steptrace collector"):
    from rich.table import Table

    table = Table(title=f"Cluster view: each step across ranks ({joined_by})", title_justify="left")
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
            markup(step.get("step", "?")),
            markup(ranks) if step.get("complete") else f"[yellow]{markup(ranks)}[/]",
            str(straggler) if isinstance(straggler, int) else "—",
            _fmt(step.get("skew_seconds")),
            _fmt(step.get("compute_min_seconds")),
            _fmt(step.get("compute_median_seconds")),
            _fmt(step.get("compute_max_seconds")),
            _fmt(step.get("interval_median_seconds")),
            f"[yellow]{_rank_list(missing, total=step.get('missing_rank_count'))}[/]" if missing else "",
        )

    # Kept when rows are limited (docs/report.md): the first step, steps a rank failed, incomplete
    # steps, the largest skews, the slowest. A cluster_step's ``status`` counts ranks per status.
    _add_rows(table, steps, max_rows, add, failed=_cluster_step_failed, why=lambda step: not step.get("complete"),
              why_label="incomplete", largest=(("skew_seconds", "largest skew"),
                                               ("interval_median_seconds", "slowest")))
    return table


def _cluster_step_failed(step: dict) -> bool:
    """Whether a rank's step failed: the collector's ``status`` is ranks per status, e.g. ``{"ok": 3}``."""
    status = step.get("status")
    if not isinstance(status, dict):
        return False
    return any(name != "ok" and isinstance(count, int) and count > 0 for name, count in status.items())


def _rank_list(ranks: list, limit: int = 8, total: object = None) -> str:
    # The collector lists at most 64 missing ranks; missing_rank_count has them all.
    count = total if isinstance(total, int) and not isinstance(total, bool) and total > len(ranks) else len(ranks)
    shown = markup(", ".join(str(r) for r in ranks[:limit]))
    return shown + (f", … ({count} in all)" if count > limit else "")


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
    grid.add_row("compute share of steps", percent_text(summary["compute_share_of_steps"]),
                 "all ranks: Σ own compute / Σ interval of the joined steps (not goodput: no time outside steps)")
    for rank, count in list(summary["straggler_steps"].items())[:8]:
        share = f"{count / complete * 100:.0f}% of complete steps" if complete else ""
        grid.add_row(f"straggler: rank {markup(rank)}", f"{count} step{'' if count == 1 else 's'}", share)
    for rank, count in list(summary["missing_rank_steps"].items())[:8]:
        grid.add_row(f"missing: rank {markup(rank)}", f"{count} step{'' if count == 1 else 's'}",
                     "not in the step when it was written")
    return Panel(grid, title="Cluster summary", title_align="left", expand=False)


def _print_table(console: Console, table: Any) -> None:
    console.print(table)
    note = getattr(table, "steptrace_note", None)
    if note:
        console.print(note)


def _stragglers(run: Run) -> dict:
    """Who slowed the run: from the collector's cluster.jsonl when there is one, else by joining the
    rank files here (the same rule)."""
    cluster_steps = run.cluster_steps()
    if cluster_steps:
        return summarize_stragglers(cluster_steps)
    return summarize_stragglers(straggler_steps(run.records_by_rank, run.world_size))


def _health(run: Run, stragglers: dict | None) -> tuple[dict[int, dict], dict | None]:
    """Each rank's GPU health (docs/health.md) and what it says of the run's straggler, if any."""
    windows = rank_windows(run.records_by_rank, run.cluster_steps())
    health = {rank: summarize_health(found) for rank, found in windows.items()}
    return health, straggler_cause(stragglers.get("top") if stragglers else None, health)


def _straggler_line(stragglers: dict, cause: dict | None) -> str | None:
    """The straggler sentence, with its GPU's cause (or its absence) where the GPU was sampled."""
    sentence = straggler_sentence(stragglers)
    return sentence if sentence is None or cause is None else f"{sentence}; {cause['clause']}"


def render_report(
    run: Run,
    *,
    rank: int | None = None,
    max_rows: int = 40,
    console: Console | None = None,
    show_warnings: bool = True,
    vocabulary: str = "steptrace",
) -> None:
    """Print a report of *run* for one rank (default rank 0) to *console*.

    ``max_rows <= 0`` shows every step.  With several ranks a per-rank
    summary table is added; with a collector's ``cluster.jsonl``, the
    cluster view (slowest rank, skew and ranks reporting per step, how often
    each rank was the straggler).  ``show_warnings=False`` omits load warnings
    (the CLI prints them to stderr instead). ``vocabulary="gmg"`` adds the badput in
    ml-goodput-measurement's names (docs/goodput.md).
    """
    from rich.console import Console
    from steptrace.analysis._text import markup as escape

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
        job = job_goodput(run.records_by_rank)
        mine = job["ranks"].get(rank) or job_accounting(run.records_by_rank.get(rank, []))
        if steps:
            _print_table(console, _step_table(steps, rank, max_rows))
        else:
            console.print(f"[yellow]no step records for rank {rank}[/]")
        if checkpoints:
            console.print(_checkpoint_table(checkpoints, rank))
            beside = commit_sentence(compute_beside_commits(steps, checkpoints), steps)
            if beside:
                console.print(f"[bold]Compute beside async commits[/] (rank {rank}): {escape(beside)}")
        console.print(_summary_panel(summary, mine, f"Summary (rank {rank})"))
        if len(mine["attempts"]) > 1:
            console.print(_attempts_table(mine, rank))
        for cost in mine.get("after_restore") or ():
            console.print(f"[bold]First step after a restore[/] (rank {rank}): {escape(after_restore_line(cost))}")
        if len(run.ranks) > 1:
            _print_table(console, _rank_table(run, job["ranks"]))
        if job["ranks"]:
            console.print(goodput_line(job))
        if vocabulary == "gmg" and mine["attempts"]:
            console.print(_gmg_panel(gmg_view(run.records_by_rank.get(rank, []), mine, job, rank,
                                              summary["interval_p50"])))
        stalls = job_view(run)
        if stalls is not None:
            console.print(_stall_panel(stalls))
        compiles = compile_by_function(run.records("span", rank))
        if compiles:
            console.print(f"[bold]Compile by function[/] (rank {rank}): {escape(compile_sentence(compiles))}")
        for sentence in capture_sentences(capture_lines(run)):
            console.print(f"[bold]Capture[/] {markup(sentence)}")
    elif rank is not None:
        run.resolve_rank(rank)  # no rank files: asking for one is an error
    cluster_steps = run.cluster_steps()
    if cluster_steps:
        joined_by = str(getattr(run.path, "joined_by", "steptrace collector"))
        _print_table(console, _cluster_table(cluster_steps, max_rows, joined_by))
        console.print(_cluster_panel(summarize_cluster(cluster_steps, run.late_spans())))
    stragglers = _stragglers(run) if len(run.ranks) > 1 or cluster_steps else None
    health, cause = _health(run, stragglers)
    sentence = _straggler_line(stragglers, cause) if stragglers is not None else None
    if sentence is not None:
        console.print(f"[bold]Straggler:[/] {escape(sentence)}")
    gc_line = gc_sentence(gc_finding(run.records_by_rank)) if len(run.ranks) > 1 else None
    if gc_line is not None:
        console.print(f"[bold]GC:[/] {escape(gc_line)}")
    for line in health_lines(health):
        console.print(f"[bold]GPU health[/] {escape(line)}")

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
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                        help="a run directory, or a run_dir holding runs (newest is used)")
    parser.add_argument("--clickhouse", metavar="URL", default=None,
                        help="read the run from ClickHouse (the OpenTelemetry Collector's otel_traces table) "
                             "instead of a run directory: http(s)://host:8123[/?database=NAME] or "
                             "chdb:///path (docs/clickhouse.md); with --run")
    parser.add_argument("--run", metavar="RUN_ID", default=None, help="with --clickhouse: the run to report on")
    parser.add_argument("--clickhouse-table", metavar="TABLE", default="otel_traces",
                        help="with --clickhouse: the exporter's traces table (default otel_traces)")
    parser.add_argument("--rank", type=int, default=None,
                        help="rank to report on (default: 0)")
    parser.add_argument("--max-rows", type=int, default=40, metavar="N",
                        help="show at most N step rows: the first, failed, checkpoint/eval/compile and "
                             "slowest steps, then evenly spaced ones (0: all; default 40)")
    parser.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                        help="table width in columns (default: the terminal's; written to a file or pipe, "
                             "$COLUMNS or else wide enough that no row wraps)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write a per-step timeline PNG")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON instead of tables")
    parser.add_argument("--vocabulary", choices=("steptrace", "gmg"), default="steptrace",
                        help="gmg: also print the badput in ml-goodput-measurement's names and its ideal step "
                             "time (docs/goodput.md); --json always has them (gmg)")
    return parser


def report_width(width: int | None = None, stream: Any = None) -> int | None:
    """Columns to render at: *width* if given; the terminal's when *stream* (stdout) is one
    (None: rich asks the terminal); else ``$COLUMNS``; else ``UNWRAPPED_WIDTH``, so that a report
    written to a file or a pipe keeps one line per row instead of wrapping at 80 columns."""
    if width is not None:
        return width
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else UNWRAPPED_WIDTH


def _load(args: argparse.Namespace) -> Run:
    """The run dir's run, or with ``--clickhouse`` the run ``--run`` read from ClickHouse."""
    clickhouse = getattr(args, "clickhouse", None)
    if clickhouse is not None:
        if args.run_dir is not None or not args.run:
            raise RunDirError("--clickhouse URL takes --run RUN_ID and no RUN_DIR")
        from steptrace.analysis.clickhouse import open_run

        return open_run(clickhouse, args.run, table=args.clickhouse_table)
    if getattr(args, "run", None) is not None:
        raise RunDirError("--run RUN_ID goes with --clickhouse URL")
    if args.run_dir is None:
        raise RunDirError("give a RUN_DIR (or --clickhouse URL --run RUN_ID)")
    return load_run(args.run_dir)


def run_report(args: argparse.Namespace) -> int:
    """Run the report for parsed *args*; returns the process exit code."""
    try:
        run = _load(args)
        # A collector's run dir may hold cluster.jsonl and no rank files.
        rank = run.resolve_rank(args.rank) if run.ranks or args.rank is not None else None
    except (RunDirError, OSError) as exc:  # OSError: e.g. an unreadable file
        print(f"steptrace report: {exc}", file=sys.stderr)
        return 2
    if args.width is not None and args.width < 20:
        print("steptrace report: --width must be at least 20", file=sys.stderr)
        return 2

    # Warnings go to stderr so that --json output on stdout stays parseable.
    for warning in run.warnings:
        print(f"steptrace report: warning: {visible(warning)}", file=sys.stderr)

    if args.json:
        summary = summarize(run.steps(rank), run.checkpoints(rank)) if rank is not None else {}
        cluster_steps = run.cluster_steps()
        job = job_goodput(run.records_by_rank) if rank is not None else None
        mine = (job["ranks"].get(rank) if job else None) or (
            job_accounting(run.records_by_rank[rank]) if rank is not None else None)
        payload = {
            "run_id": run.run_id,
            "path": str(run.path),
            "rank": rank,
            "ranks": run.ranks,
            # The one goodput: the job's (every rank), with what it divides (docs/goodput.md)
            "goodput": job["goodput"] if job else None,
            "goodput_definition": job["definition"] if job else None,
            **summary,
            # the shown rank: its wall from the process start and its productive part
            "wall_seconds": mine["total_seconds"] if mine else None,
            "productive_seconds": mine["productive_seconds"] if mine else None,
            # each rank's own goodput, productive time and wait in collectives
            "per_rank": {str(r): _rank_json(run, r, a) for r, a in job["ranks"].items()} if job else {},
            "dropped": run.dropped,
            "warnings": run.warnings,
            # null when no collector joined the run
            "cluster": summarize_cluster(cluster_steps, run.late_spans()) if run.cluster_records else None,
            # where each stalled rank was, and the cause (docs/hangs.md); null without stall records
            "stalls": job_view(run) if run.ranks else None,
            # the shown rank's compile time by jitted function, largest first, with its compilations' steps
            "compile_by_function": compile_by_function(run.records("span", rank)) if rank is not None else {},
            # the steps each async checkpoint commit ran beside, their compute against the typical step's
            "compute_beside_commits": (compute_beside_commits(run.steps(rank), run.checkpoints(rank))
                                       if rank is not None else []),
            # deep captures (docs/capture.md): the profiler traces taken, or why not
            "captures": capture_lines(run) if run.ranks else [],
            # every second of the job across attempts and ranks (docs/goodput.md), with the shown
            # rank's attempts; null without rank files
            "job": ({**{k: v for k, v in job.items() if k != "ranks"}, "ranks": len(job["ranks"]),
                     "attempts": mine["attempts"] if mine else [],
                     "kept_steps": mine["kept_steps"] if mine else 0,
                     "wasted_steps": mine["wasted_steps"] if mine else 0,
                     # the shown rank's first steps after a restore, with their one-off cost
                     "after_restore": mine["after_restore"] if mine else []} if job else None),
        }
        # the shown rank's (and the job's) badput in ml-goodput-measurement's names, and its ideal step
        # time (docs/goodput.md); null without rank files
        payload["gmg"] = (gmg_view(run.records_by_rank.get(rank, []), mine, job, rank, summary.get("interval_p50"))
                          if rank is not None and job and mine and mine["attempts"] else None)
        stragglers = _stragglers(run)
        health, cause = _health(run, stragglers)
        # the straggler's GPU cause (docs/health.md): null without a straggler or its GPU's health
        payload["stragglers"] = {**stragglers, "sentence": _straggler_line(stragglers, cause), "gpu": cause}
        # the job-level garbage-collection finding (pauses=True, docs/pauses.md); null without it
        finding = gc_finding(run.records_by_rank)
        payload["gc"] = None if finding is None else {**finding, "sentence": gc_sentence(finding)}
        # per rank, its GPU's health over the run (health="nvml"); {} when no rank sampled it
        payload["health"] = {str(rank): summary for rank, summary in health.items()}
        print(json.dumps(payload, indent=2))
    else:
        from rich.console import Console

        render_report(run, rank=rank, max_rows=args.max_rows, show_warnings=False,
                      console=Console(width=report_width(args.width)),
                      vocabulary=getattr(args, "vocabulary", "steptrace"))

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


def _rank_json(run: Run, rank: int, accounting: dict) -> dict:
    """One rank's entry of ``report --json``'s ``per_rank``."""
    summary = summarize(run.steps(rank), run.checkpoints(rank))
    return {
        "goodput": accounting["goodput"],
        "wall_seconds": accounting["total_seconds"],
        "productive_seconds": accounting["productive_seconds"],
        "steps": summary["steps"],
        "compute_seconds": summary["compute_seconds"],
        "own_compute_seconds": summary["own_compute_seconds"],
        "collective_wait_seconds": summary["collective_wait_seconds"],
        "idle_seconds": summary["idle_seconds"],
    }


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
