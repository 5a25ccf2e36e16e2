"""All ranks of a run on one time axis, as a Chrome/Perfetto trace.

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

The lanes, bars and step windows are :mod:`steptrace.analysis.lanes`, shared with the PNG
(:func:`steptrace.analysis.plotting.render_png`); the ``steptrace timeline`` command that writes
both is :mod:`steptrace.timeline`.  Only the standard library is imported at module level.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable

from steptrace.analysis.lanes import (
    Bar,
    StepWindow,
    as_window,
    host_lanes,
    microbatch_tracks,
    parse_steps,
    rank_view,
    select_ranks,
    time_origin,
    track_name,
    window_text,
    without_none,
)
from steptrace.analysis.runs import Run

__all__ = [
    "StepWindow",
    "build_trace",
    "write_trace",
    "parse_steps",
]

# Thread ids double as sort order: Perfetto orders a process's threads by tid
# (it ignores thread_sort_index), chrome://tracing by thread_sort_index.
_TID_HOST = 1  # host lane k is tid 1 + k
_TID_DEVICE = 100
_TID_COMMIT = 101
_TID_MICROBATCH = 200  # + index of the (stage, chunk) track


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
    selected = select_ranks(run, ranks)
    window = as_window(steps)
    origin = time_origin(run)

    # Whole microseconds (what the trace format expects): integers keep the
    # device track's pieces exactly contiguous (no float noise from subtracting
    # unix times); rounding both ends costs at most 1 µs per slice.
    origin_us = round(origin * 1e6)

    def us(t: float) -> int:
        return round(t * 1e6) - origin_us

    meta: list[dict] = []
    events: list[dict] = []
    flow_id = 0

    def complete(bar: Bar, pid: int, tid: int) -> dict:
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
        view = rank_view(run, rank, window)
        meta.append(_meta(rank, None, "process_name", {"name": f"rank {rank}"}))
        meta.append(_meta(rank, None, "process_sort_index", {"sort_index": rank}))

        lanes = host_lanes(view.host)
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
                                   "args": without_none({"step": bar.args.get("step"),
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

        for index, track in enumerate(microbatch_tracks(view)):
            tid = _TID_MICROBATCH + index
            thread(rank, tid, track_name(track))
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
            "steps": window_text(window),
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

