"""All ranks of a run on one time axis: a Chrome/Perfetto trace and a PNG.

``steptrace timeline RUN_DIR -o trace.json`` writes the run's records as a
Trace Event Format file (open it in https://ui.perfetto.dev or
chrome://tracing); ``--png FILE.png`` draws the same timeline with matplotlib.
``--rank R`` (repeatable, or ``R,R``) keeps some ranks; ``--steps A:B`` keeps
steps A through B.  The default is every rank and every step, which for
thousands of steps makes a big trace and a PNG of sub-pixel slivers: pick a
window.

Layout: one process per rank (``pid`` = rank, named ``rank N``), and in it
one thread per track, in this order:

``host``
    what the training thread did: each ``with step(n)`` block
    (``host_start_time``..``host_end_time``), with the user spans, ``compile``
    spans and checkpoint saves (and, nested in a save, the part that blocked
    training, ``blocking_seconds``) that ran in or between steps.  Spans that
    overlap without nesting (a trace viewer cannot draw those on one thread)
    go to extra ``host (overlapping)`` tracks.
``device``
    what the device did, from the timing model (DESIGN.md §2): per step, the
    idle window ``[end(n-1), start(n)]`` cut into ``idle_segments`` named by
    reason (``data``, ``checkpoint``, ``compile``, ``other``, ...), then the
    step's compute ``[start(n), end(n)]``.  These tile the wall time: their
    durations add up to the steps' ``interval_seconds``.
``checkpoint commit``
    asynchronous checkpoint commits (``async_seconds`` after the save's host
    span), only when there are any.
``stage S chunk C``
    one track per pipeline (stage, chunk) that has microbatches; events are
    ``F3``/``B3`` for the forward/backward pass of microbatch 3.  Empty space
    on these tracks while the device track shows compute is the bubble.

Timestamps are microseconds since the earliest time recorded anywhere in the
run (every rank, every record), so they stay small and the same instant has
the same ``ts`` whichever ranks or steps are exported; the absolute origin is
in ``otherData.origin_unix_seconds``.  A host step is linked to its device
compute by a flow arrow (asynchronous dispatch made visible).  Failed steps
are named ``step N (error)``, coloured ``terrible`` in chrome://tracing, and
marked by an ``error`` instant event on the host track.

Only the standard library is imported at module level; the PNG picture of
the same lanes is :func:`steptrace.analysis.plotting.render_png`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

from steptrace.analysis.runs import Run, RunDirError, load_run
from steptrace.analysis.summary import _num

__all__ = [
    "build_trace",
    "write_trace",
    "parse_steps",
    "add_timeline_arguments",
    "run_timeline",
    "main",
]

# Thread ids double as sort order: Perfetto orders a process's threads by tid
# (it ignores thread_sort_index), chrome://tracing by thread_sort_index.
_TID_HOST = 1  # host lane k is tid 1 + k
_MAX_HOST_LANES = 90
_TID_DEVICE = 100
_TID_COMMIT = 101
_TID_MICROBATCH = 200  # + index of the (stage, chunk) track

_KIND_LETTER = {"forward": "F", "backward": "B"}

StepWindow = tuple[int | None, int | None]


class _Bar(NamedTuple):
    """One interval on one track: what both the trace and the PNG draw."""

    track: tuple  # ("host",) ("device",) ("commit",) ("mb", stage, chunk)
    name: str
    start: float  # unix seconds
    end: float
    kind: str  # step, span, checkpoint, blocking, commit, compute, idle, forward, backward
    cat: str
    args: dict
    error: bool = False
    reason: str = ""  # idle reason / span name, for colours
    label: str = ""  # short text for PNG bars (microbatch index, step number)


@dataclass
class _RankView:
    rank: int
    host: list[_Bar] = field(default_factory=list)
    device: list[_Bar] = field(default_factory=list)
    commit: list[_Bar] = field(default_factory=list)
    microbatch: dict[tuple, list[_Bar]] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------


def parse_steps(text: str) -> StepWindow:
    """Parse ``A:B`` (steps A through B, both included), ``A:``, ``:B`` or ``N``."""
    text = text.strip()
    try:
        if ":" not in text:
            n = int(text)
            return (n, n)
        lo_text, hi_text = text.split(":", 1)
        lo = int(lo_text) if lo_text.strip() else None
        hi = int(hi_text) if hi_text.strip() else None
    except ValueError:
        raise ValueError(f"invalid step window {text!r}: use A:B, A:, :B or N") from None
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"invalid step window {text!r}: {hi} < {lo}")
    return (lo, hi)


def _window(steps: str | StepWindow | None) -> StepWindow:
    if steps is None:
        return (None, None)
    if isinstance(steps, str):
        return parse_steps(steps)
    lo, hi = steps
    return (lo, hi)


def _window_text(window: StepWindow) -> str:
    lo, hi = window
    if lo is None and hi is None:
        return "all"
    if lo == hi:
        return str(lo)
    return f"{'' if lo is None else lo}:{'' if hi is None else hi}"


def _in_window(step: Any, window: StepWindow) -> bool:
    number = _num(step)
    if number is None:
        return False
    lo, hi = window
    return (lo is None or number >= lo) and (hi is None or number <= hi)


def _select_ranks(run: Run, ranks: Iterable[int] | None) -> list[int]:
    """Validated, sorted, de-duplicated ranks (all when None); RunDirError for unknown ones."""
    if not run.records_by_rank:
        raise RunDirError(f"{run.path}: no rank files")
    if ranks is None:
        return run.ranks
    chosen = sorted({run.resolve_rank(int(r)) for r in ranks})
    if not chosen:
        raise RunDirError(f"{run.path}: no ranks selected")
    return chosen


def _origin(run: Run) -> float:
    """The earliest ``*_time`` in the whole run (all ranks), the trace's time zero."""
    earliest: float | None = None
    for records in run.records_by_rank.values():
        for record in records:
            for key, value in record.items():
                if key.endswith("_time"):
                    t = _num(value)
                    if t is not None and (earliest is None or t < earliest):
                        earliest = t
    return earliest if earliest is not None else 0.0


# --------------------------------------------------------------------------
# Records -> bars (shared by the trace and the PNG)
# --------------------------------------------------------------------------


def _clean(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}


_STEP_ARG_KEYS = (
    "step", "trace_id", "status", "error", "backend",
    "interval_seconds", "compute_seconds", "idle_seconds", "idle_breakdown",
    "tokens", "samples", "flops", "tokens_per_second", "samples_per_second",
    "tflops_per_second", "mfu", "pipeline_bubble_ratio",
)


def _step_args(step: dict) -> dict:
    args = {k: step.get(k) for k in _STEP_ARG_KEYS}
    host_start, host_end = _num(step.get("host_start_time")), _num(step.get("host_end_time"))
    if host_start is not None and host_end is not None:
        args["host_seconds"] = round(host_end - host_start, 9)
    if step.get("attrs"):
        args["attrs"] = step["attrs"]
    return _clean(args)


def _step_name(step: dict) -> str:
    name = f"step {step.get('step', '?')}"
    return f"{name} (error)" if step.get("status") == "error" else name


def _rank_view(run: Run, rank: int, window: StepWindow) -> _RankView:
    view = _RankView(rank)
    all_window = window == (None, None)
    view.steps = [s for s in run.steps(rank) if all_window or _in_window(s.get("step"), window)]

    # The wall-time window the selected steps cover; spans recorded between
    # steps (step: null) are kept when they fall in it.
    t_lo: float | None = None
    t_hi: float | None = None

    def widen(*times: Any) -> None:
        nonlocal t_lo, t_hi
        for value in times:
            t = _num(value)
            if t is None:
                continue
            t_lo = t if t_lo is None or t < t_lo else t_lo
            t_hi = t if t_hi is None or t > t_hi else t_hi

    for step in view.steps:
        error = step.get("status") == "error"
        name = _step_name(step)
        args = _step_args(step)
        host_start, host_end = _num(step.get("host_start_time")), _num(step.get("host_end_time"))
        if host_start is not None and host_end is not None:
            view.host.append(_Bar(("host",), name, host_start, max(host_start, host_end), "step",
                                  "step", args, error, label=str(step.get("step", ""))))
        start, end = _num(step.get("start_time")), _num(step.get("end_time"))
        if start is None or end is None:
            continue
        segments = step.get("idle_segments")
        step_no = step.get("step")
        if isinstance(segments, list):
            for segment in segments:
                if not (isinstance(segment, (list, tuple)) and len(segment) == 3):
                    continue
                reason, seg_start, seg_end = str(segment[0]), _num(segment[1]), _num(segment[2])
                if seg_start is None or seg_end is None or seg_end <= seg_start:
                    continue
                view.device.append(_Bar(
                    ("device",), reason, seg_start, seg_end, "idle", f"idle.{reason}",
                    _clean({"step": step_no, "reason": reason, "seconds": round(seg_end - seg_start, 9),
                            "trace_id": step.get("trace_id")}),
                    reason=reason))
                widen(seg_start)
        else:
            # Records without segments: one piece for the whole idle window.
            idle = _num(step.get("idle_seconds")) or 0.0
            if idle > 0:
                view.device.append(_Bar(
                    ("device",), "idle", start - idle, start, "idle", "idle.other",
                    _clean({"step": step_no, "reason": "idle", "seconds": idle,
                            "idle_breakdown": step.get("idle_breakdown")}),
                    reason="other"))
                widen(start - idle)
        view.device.append(_Bar(("device",), name, start, max(start, end), "compute", "compute",
                                args, error, reason="compute", label=str(step_no)))
        interval = _num(step.get("interval_seconds"))
        widen(host_start, host_end, start, end, None if interval is None else end - interval)

    for ckpt in run.checkpoints(rank):
        if not (all_window or _in_window(ckpt.get("step"), window)):
            continue
        start, end = _num(ckpt.get("start_time")), _num(ckpt.get("end_time"))
        if start is None or end is None:
            continue
        end = max(start, end)
        status = ckpt.get("status", "ok")
        name = f"checkpoint {ckpt.get('step', '?')}" + ("" if status == "ok" else f" ({status})")
        args = _clean({k: ckpt.get(k) for k in ("step", "status", "error", "host_seconds",
                                                  "blocking_seconds", "async_seconds")})
        view.host.append(_Bar(("host",), name, start, end, "checkpoint", "checkpoint", args,
                              status == "error", reason="checkpoint"))
        blocking = _num(ckpt.get("blocking_seconds")) or 0.0
        if blocking > 0:
            view.host.append(_Bar(("host",), "blocking", max(start, end - blocking), end, "blocking",
                                  "checkpoint.blocking", args, reason="checkpoint"))
        commit = _num(ckpt.get("async_seconds")) or 0.0
        if commit > 0:
            view.commit.append(_Bar(("commit",), f"checkpoint {ckpt.get('step', '?')} commit", end,
                                    end + commit, "commit", "checkpoint.async", args, reason="checkpoint"))
        widen(start, end + commit)

    for span in run.records("span", rank):
        start, end = _num(span.get("start_time")), _num(span.get("end_time"))
        if start is None or end is None:
            continue
        if not all_window:
            if span.get("step") is not None:
                if not _in_window(span.get("step"), window):
                    continue
            elif t_lo is None or end <= t_lo or start >= t_hi:
                continue
        name = str(span.get("name", "span"))
        args = _clean({"step": span.get("step"), "seconds": span.get("seconds"),
                       "attrs": span.get("attrs") or None})
        view.host.append(_Bar(("host",), name, start, max(start, end), "span",
                              "compile" if name == "compile" else "span", args, reason=name))

    for mb in run.records("microbatch", rank):
        if not (all_window or _in_window(mb.get("step"), window)):
            continue
        start, end = _num(mb.get("start_time")), _num(mb.get("end_time"))
        if start is None or end is None:
            continue
        kind = str(mb.get("kind", "forward"))
        index = mb.get("microbatch", "?")
        letter = _KIND_LETTER.get(kind, kind[:1].upper() or "?")
        track = ("mb", mb.get("stage"), mb.get("chunk"))
        args = _clean({k: mb.get(k) for k in ("step", "microbatch", "stage", "chunk", "kind",
                                                "compute_seconds", "host_start_time", "host_end_time")})
        view.microbatch.setdefault(track, []).append(_Bar(
            track, f"{letter}{index}", start, max(start, end), kind if kind in _KIND_LETTER else "forward",
            f"microbatch.{kind}", args, label=str(index)))
    return view


def _sort_value(value: Any) -> tuple:
    if value is None:
        return (0, 0, "")
    number = _num(value)
    return (1, number, "") if number is not None else (2, 0, str(value))


def _mb_tracks(view: _RankView) -> list[tuple]:
    return sorted(view.microbatch, key=lambda t: (_sort_value(t[1]), _sort_value(t[2])))


def _mb_track_name(track: tuple) -> str:
    _, stage, chunk = track
    parts = []
    if stage is not None:
        parts.append(f"stage {stage}")
    if chunk is not None:
        parts.append(f"chunk {chunk}")
    return " ".join(parts) if parts else "microbatches"


_HOST_ORDER = {"step": 0, "checkpoint": 0, "span": 1, "blocking": 2}


def _host_lanes(bars: list[_Bar]) -> list[tuple[_Bar, int, int]]:
    """Assign host bars to lanes where they nest properly: (bar, lane, depth).

    Trace viewers draw the X events of one thread as a stack of nested slices;
    two that overlap without nesting would be drawn wrongly, so the second
    goes to the next lane where it nests.
    """
    placed: list[tuple[_Bar, int, int]] = []
    lanes: list[list[float]] = []  # per lane: ends of the currently open slices
    for bar in sorted(bars, key=lambda b: (b.start, -b.end, _HOST_ORDER.get(b.kind, 1))):
        for lane, stack in enumerate(lanes):
            while stack and stack[-1] <= bar.start:
                stack.pop()
            if not stack or bar.end <= stack[-1]:
                placed.append((bar, lane, len(stack)))
                stack.append(bar.end)
                break
        else:
            # Past the cap (pathological span soup) the last lane takes the rest.
            lane = min(len(lanes), _MAX_HOST_LANES - 1)
            if lane == len(lanes):
                lanes.append([])
            placed.append((bar, lane, len(lanes[lane])))
            lanes[lane].append(bar.end)
    return placed


# --------------------------------------------------------------------------
# Trace Event Format
# --------------------------------------------------------------------------


def _meta(pid: int, tid: int | None, name: str, args: dict) -> dict:
    event = {"ph": "M", "pid": pid, "name": name, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def build_trace(run: Run, ranks: Iterable[int] | None = None,
                steps: str | StepWindow | None = None) -> dict:
    """The run as a Trace Event Format dict (``json.dump`` it to get a trace file).

    *ranks*: the ranks to include (default all; an unknown rank raises
    :class:`RunDirError`).  *steps*: a window of step numbers, ``(A, B)`` or
    ``"A:B"`` with both ends included and either end open (None / empty);
    default all steps.  Checkpoints, spans and microbatches of the selected
    steps come along, and so do spans recorded between steps that fall inside
    the window's wall time.
    """
    selected = _select_ranks(run, ranks)
    window = _window(steps)
    origin = _origin(run)

    # Whole microseconds (what the trace format expects): integers keep the
    # device track's pieces exactly contiguous (no float noise from subtracting
    # unix times); rounding both ends costs at most 1 µs per slice.
    origin_us = round(origin * 1e6)

    def us(t: float) -> int:
        return round(t * 1e6) - origin_us

    meta: list[dict] = []
    events: list[dict] = []
    flow_id = 0

    def complete(bar: _Bar, pid: int, tid: int) -> dict:
        ts = us(bar.start)
        event = {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0, us(bar.end) - ts),
                 "name": bar.name, "cat": bar.cat, "args": bar.args}
        if bar.error:
            event["cname"] = "terrible"
        events.append(event)
        return event

    def thread(pid: int, tid: int, name: str) -> None:
        meta.append(_meta(pid, tid, "thread_name", {"name": name}))
        meta.append(_meta(pid, tid, "thread_sort_index", {"sort_index": tid}))

    for rank in selected:
        view = _rank_view(run, rank, window)
        meta.append(_meta(rank, None, "process_name", {"name": f"rank {rank}"}))
        meta.append(_meta(rank, None, "process_sort_index", {"sort_index": rank}))

        lanes = _host_lanes(view.host)
        n_lanes = max([lane for _, lane, _ in lanes], default=0) + 1
        for lane in range(n_lanes):
            thread(rank, _TID_HOST + lane, "host" if lane == 0 else "host (overlapping)")
        host_step: dict[Any, tuple[int, float]] = {}
        for bar, lane, _depth in lanes:
            complete(bar, rank, _TID_HOST + lane)
            if bar.kind == "step":
                host_step[bar.args.get("step")] = (_TID_HOST + lane, bar.start, bar.end)
                if bar.error:
                    events.append({"ph": "i", "s": "t", "pid": rank, "tid": _TID_HOST + lane,
                                   "ts": us(bar.end), "name": "error", "cat": "error",
                                   "args": _clean({"step": bar.args.get("step"),
                                                   "error": bar.args.get("error")})})

        thread(rank, _TID_DEVICE, "device")
        for bar in view.device:
            complete(bar, rank, _TID_DEVICE)
            # Flow arrow from the host step to its compute on the device: the
            # asynchronous dispatch.  Both ends sit strictly inside their slices
            # (not on a boundary shared with a neighbour) so viewers bind them
            # to the right one.
            source = host_step.get(bar.args.get("step")) if bar.kind == "compute" else None
            if source is not None:
                flow_id += 1
                tid, host_start, host_end = source
                common = {"name": "dispatch", "cat": "dispatch", "id": flow_id, "pid": rank}
                events.append({**common, "ph": "s", "tid": tid,
                               "ts": us(host_start) + min(0.5, (us(host_end) - us(host_start)) / 2)})
                events.append({**common, "ph": "f", "bp": "e", "tid": _TID_DEVICE,
                               "ts": (us(bar.start) + us(bar.end)) / 2})

        if view.commit:
            thread(rank, _TID_COMMIT, "checkpoint commit")
            for bar in view.commit:
                complete(bar, rank, _TID_COMMIT)

        for index, track in enumerate(_mb_tracks(view)):
            tid = _TID_MICROBATCH + index
            thread(rank, tid, _mb_track_name(track))
            for bar in view.microbatch[track]:
                complete(bar, rank, tid)

    # Parents before children at equal start: some importers nest by order.
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    from steptrace._version import __version__

    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": f"steptrace {__version__}",
            "run_id": run.run_id,
            "path": str(run.path),
            "origin_unix_seconds": origin,
            "time_unit": "ts/dur: whole microseconds since origin_unix_seconds",
            "world_size": run.world_size,
            "ranks": selected,
            "steps": _window_text(window),
        },
    }


def write_trace(run: Run, path: str | Path, *, ranks: Iterable[int] | None = None,
                steps: str | StepWindow | None = None) -> Path:
    """Write :func:`build_trace` as JSON to *path* (gzip-compressed when it ends in ``.gz``)."""
    path = Path(path)
    trace = build_trace(run, ranks=ranks, steps=steps)
    text = json.dumps(trace, separators=(",", ":"))
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rank {text!r}: use R or R,R,...") from None


def _steps_arg(text: str) -> StepWindow:
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_timeline_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``timeline`` arguments to *parser* (shared with the main CLI)."""
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory, or a run_dir holding runs (newest is used)")
    parser.add_argument("-o", "--output", metavar="TRACE.json", default=None,
                        help="write a Chrome/Perfetto trace (Trace Event Format JSON; .gz compresses)")
    parser.add_argument("--png", metavar="FILE.png", default=None,
                        help="also draw the timeline as a PNG")
    parser.add_argument("--rank", metavar="R", type=_rank_list, action="extend", default=None,
                        help="only these ranks (repeat or comma-separate; default: all)")
    parser.add_argument("--steps", metavar="A:B", type=_steps_arg, default=None,
                        help="only steps A through B (A:, :B and N work too; default: all steps)")
    return parser


def run_timeline(args: argparse.Namespace) -> int:
    """Run the timeline command for parsed *args*; returns the process exit code."""
    from steptrace.analysis.plotting import render_png  # the PNG renderer lives with the other plot

    if not args.output and not args.png:
        print("steptrace timeline: nothing to write: give -o TRACE.json and/or --png FILE.png",
              file=sys.stderr)
        return 2
    try:
        run = load_run(args.run_dir)
        ranks = _select_ranks(run, args.rank)
    except (RunDirError, OSError) as exc:  # OSError: e.g. an unreadable file
        print(f"steptrace timeline: {exc}", file=sys.stderr)
        return 2
    for warning in run.warnings:
        print(f"steptrace timeline: warning: {warning}", file=sys.stderr)
    window = args.steps if args.steps is not None else (None, None)
    if not any(_in_window(s.get("step"), window) for r in ranks for s in run.steps(r)):
        print(f"steptrace timeline: warning: no step records in ranks {ranks}, steps "
              f"{_window_text(window)}", file=sys.stderr)

    if args.output:
        try:
            written = write_trace(run, args.output, ranks=ranks, steps=window)
        except OSError as exc:
            print(f"steptrace timeline: cannot write trace: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {written} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.png:
        try:
            written = render_png(run, args.png, ranks=ranks, steps=window)
        except (OSError, ImportError) as exc:
            print(f"steptrace timeline: cannot write PNG: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m steptrace.timeline`` / ``steptrace timeline``."""
    parser = argparse.ArgumentParser(
        prog="steptrace timeline",
        description="Write a run's ranks as a Chrome/Perfetto trace and/or a PNG timeline.",
    )
    add_timeline_arguments(parser)
    return run_timeline(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
