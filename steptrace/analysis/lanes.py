"""The laid-out view of a run: what the Perfetto trace (``timeline``) and the PNG (``plotting``) both draw.

A run's records become, per rank, *bars* (one interval on one track, in unix seconds) on the
tracks both renderers show, in this order: the ``host`` track (each ``with step(n)`` block, user
spans, compile spans, checkpoint saves and the part of a save that blocked training), laid out in
*lanes* where the bars nest (:func:`host_lanes`: a trace viewer cannot draw overlapping slices
that do not nest on one thread, so those go to the next lane); the ``device`` track (per step the
idle window cut into ``idle_segments`` named by reason, then the step's compute, tiling the wall
time: DESIGN.md §2); the ``commit`` track (asynchronous checkpoint commits); and one microbatch
track per pipeline (stage, chunk) (:func:`microbatch_tracks`).

A *window* of step numbers (:func:`parse_steps`) selects steps and what belongs to them; the
run's earliest recorded time (:func:`time_origin`) is time zero for both pictures.

Only the standard library is imported; the renderers add the trace format and matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from steptrace._attribution import HostSpan, idle_segments
from steptrace.analysis.runs import Run, RunDirError
from steptrace.analysis.summary import as_number

__all__ = [
    "Bar",
    "RankView",
    "StepWindow",
    "as_window",
    "host_lanes",
    "in_window",
    "microbatch_tracks",
    "parse_steps",
    "rank_view",
    "select_ranks",
    "time_origin",
    "track_name",
    "window_text",
    "without_none",
]

_MAX_HOST_LANES = 90

# The letters torch.distributed.pipelining names its actions with (F, B, I, W).
_KIND_LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}

StepWindow = tuple[int | None, int | None]


class Bar(NamedTuple):
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
class RankView:
    """One rank's bars by track, and the step records they came from."""

    rank: int
    host: list[Bar] = field(default_factory=list)
    device: list[Bar] = field(default_factory=list)
    commit: list[Bar] = field(default_factory=list)
    microbatch: dict[tuple, list[Bar]] = field(default_factory=dict)
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


def as_window(steps: str | StepWindow | None) -> StepWindow:
    """A window from ``None`` (all steps), ``"A:B"`` or ``(A, B)``."""
    if steps is None:
        return (None, None)
    if isinstance(steps, str):
        return parse_steps(steps)
    lo, hi = steps
    return (lo, hi)


def window_text(window: StepWindow) -> str:
    """The window as the command line writes it (``all``, ``N``, ``A:B``, ``A:``, ``:B``)."""
    lo, hi = window
    if lo is None and hi is None:
        return "all"
    if lo == hi:
        return str(lo)
    return f"{'' if lo is None else lo}:{'' if hi is None else hi}"


def in_window(step: Any, window: StepWindow) -> bool:
    """Whether a record's ``step`` is a number inside *window*."""
    number = as_number(step)
    if number is None:
        return False
    lo, hi = window
    return (lo is None or number >= lo) and (hi is None or number <= hi)


def select_ranks(run: Run, ranks: Iterable[int] | None) -> list[int]:
    """Validated, sorted, de-duplicated ranks (all when None); RunDirError for unknown ones."""
    if not run.records_by_rank:
        raise RunDirError(f"{run.path}: no rank files")
    if ranks is None:
        return run.ranks
    chosen = sorted({run.resolve_rank(int(r)) for r in ranks})
    if not chosen:
        raise RunDirError(f"{run.path}: no ranks selected")
    return chosen


def time_origin(run: Run) -> float:
    """The earliest ``*_time`` in the whole run (all ranks): time zero of the trace and the PNG."""
    earliest: float | None = None
    for records in run.records_by_rank.values():
        for record in records:
            for key, value in record.items():
                if key.endswith("_time"):
                    t = as_number(value)
                    if t is not None and (earliest is None or t < earliest):
                        earliest = t
    return earliest if earliest is not None else 0.0


# --------------------------------------------------------------------------
# Records -> bars (shared by the trace and the PNG)
# --------------------------------------------------------------------------


def without_none(values: dict) -> dict:
    """*values* without its None entries (a bar's args, an event's args)."""
    return {k: v for k, v in values.items() if v is not None}


_STEP_ARG_KEYS = (
    "step", "trace_id", "status", "error", "backend",
    "interval_seconds", "compute_seconds", "idle_seconds", "idle_breakdown",
    "tokens", "samples", "flops", "tokens_per_second", "samples_per_second",
    "model_flops", "hardware_flops", "flops_source", "peak_flops",
    "tflops_per_second", "mfu", "hfu", "pipeline_bubble_ratio",
)


def _step_args(step: dict) -> dict:
    args = {k: step.get(k) for k in _STEP_ARG_KEYS}
    host_start, host_end = as_number(step.get("host_start_time")), as_number(step.get("host_end_time"))
    if host_start is not None and host_end is not None:
        args["host_seconds"] = round(host_end - host_start, 9)
    if step.get("attrs"):
        args["attrs"] = step["attrs"]
    return without_none(args)


def _step_name(step: dict) -> str:
    name = f"step {step.get('step', '?')}"
    return f"{name} (error)" if step.get("status") == "error" else name


def _before_step_bars(run: Run, rank: int, step: dict, window_start: float, window_end: float) -> list[Bar]:
    """The device lane from ``init()`` to an attempt's first step, as the step's ``before_step_breakdown``
    counts it: split by the host spans recorded outside steps (an eval, a compile, a restore), innermost
    first, ``startup`` where none is (the resolver's rule, steptrace/_attribution.py)."""
    covers = [HostSpan(str(r.get("name", "span")), start, end) for r in run.records("span", rank)
              if r.get("step") is None and (start := as_number(r.get("start_time"))) is not None
              and (end := as_number(r.get("end_time"))) is not None]
    covers += [HostSpan("checkpoint", start, end) for r in run.checkpoints(rank)
               if (start := as_number(r.get("start_time"))) is not None
               and (end := as_number(r.get("end_time"))) is not None]
    bars = []
    for segment in idle_segments(window_start, window_end, covers, uncovered="startup"):
        bars.append(Bar(("device",), segment.name, segment.start, segment.end, "idle", f"idle.{segment.name}",
                        without_none({"before_step": step.get("step"), "reason": segment.name,
                                      "seconds": round(segment.end - segment.start, 9)}),
                        reason=segment.name))
    return bars


def rank_view(run: Run, rank: int, window: StepWindow) -> RankView:
    """*rank*'s records in *window* as bars on their tracks (host bars not yet in lanes)."""
    view = RankView(rank)
    all_window = window == (None, None)
    view.steps = [s for s in run.steps(rank) if all_window or in_window(s.get("step"), window)]

    # The wall-time window the selected steps cover; spans recorded between
    # steps (step: null) are kept when they fall in it.
    t_lo: float | None = None
    t_hi: float | None = None

    def widen(*times: Any) -> None:
        nonlocal t_lo, t_hi
        for value in times:
            t = as_number(value)
            if t is None:
                continue
            t_lo = t if t_lo is None or t < t_lo else t_lo
            t_hi = t if t_hi is None or t > t_hi else t_hi

    for step in view.steps:
        error = step.get("status") == "error"
        name = _step_name(step)
        args = _step_args(step)
        host_start, host_end = as_number(step.get("host_start_time")), as_number(step.get("host_end_time"))
        if host_start is not None and host_end is not None:
            view.host.append(Bar(("host",), name, host_start, max(host_start, host_end), "step",
                                  "step", args, error, label=str(step.get("step", ""))))
        start, end = as_number(step.get("start_time")), as_number(step.get("end_time"))
        if start is None or end is None:
            continue
        segments = step.get("idle_segments")
        step_no = step.get("step")
        if isinstance(segments, list):
            for segment in segments:
                if not (isinstance(segment, (list, tuple)) and len(segment) == 3):
                    continue
                reason, seg_start, seg_end = str(segment[0]), as_number(segment[1]), as_number(segment[2])
                if seg_start is None or seg_end is None or seg_end <= seg_start:
                    continue
                view.device.append(Bar(
                    ("device",), reason, seg_start, seg_end, "idle", f"idle.{reason}",
                    without_none({"step": step_no, "reason": reason, "seconds": round(seg_end - seg_start, 9),
                            "trace_id": step.get("trace_id")}),
                    reason=reason))
                widen(seg_start)
        else:
            # Records without segments: one piece for the whole idle window.
            idle = as_number(step.get("idle_seconds")) or 0.0
            if idle > 0:
                view.device.append(Bar(
                    ("device",), "idle", start - idle, start, "idle", "idle.other",
                    without_none({"step": step_no, "reason": "idle", "seconds": idle,
                            "idle_breakdown": step.get("idle_breakdown")}),
                    reason="other"))
                widen(start - idle)
        view.device.append(Bar(("device",), name, start, max(start, end), "compute", "compute",
                                args, error, reason="compute", label=str(step_no)))
        interval = as_number(step.get("interval_seconds"))
        widen(host_start, host_end, start, end, None if interval is None else end - interval)
        before = as_number(step.get("before_step_seconds"))
        if before and before > 0 and host_start is not None:
            for bar in _before_step_bars(run, rank, step, host_start - before, host_start):
                view.device.append(bar)
                widen(bar.start)

    for ckpt in run.checkpoints(rank):
        if not (all_window or in_window(ckpt.get("step"), window)):
            continue
        start, end = as_number(ckpt.get("start_time")), as_number(ckpt.get("end_time"))
        if start is None or end is None:
            continue
        end = max(start, end)
        status = ckpt.get("status", "ok")
        name = f"checkpoint {ckpt.get('step', '?')}" + ("" if status == "ok" else f" ({status})")
        args = without_none({k: ckpt.get(k) for k in ("step", "status", "error", "host_seconds",
                                                  "blocking_seconds", "async_seconds")})
        view.host.append(Bar(("host",), name, start, end, "checkpoint", "checkpoint", args,
                              status == "error", reason="checkpoint"))
        blocking = as_number(ckpt.get("blocking_seconds")) or 0.0
        if blocking > 0:
            view.host.append(Bar(("host",), "blocking", max(start, end - blocking), end, "blocking",
                                  "checkpoint.blocking", args, reason="checkpoint"))
        commit = as_number(ckpt.get("async_seconds")) or 0.0
        if commit > 0:
            view.commit.append(Bar(("commit",), f"checkpoint {ckpt.get('step', '?')} commit", end,
                                    end + commit, "commit", "checkpoint.async", args, reason="checkpoint"))
        widen(start, end + commit)

    for span in run.records("span", rank):
        start, end = as_number(span.get("start_time")), as_number(span.get("end_time"))
        if start is None or end is None:
            continue
        if not all_window:
            if span.get("step") is not None:
                if not in_window(span.get("step"), window):
                    continue
            elif t_lo is None or end <= t_lo or start >= t_hi:
                continue
        name = str(span.get("name", "span"))
        args = without_none({"step": span.get("step"), "seconds": span.get("seconds"),
                       "attrs": span.get("attrs") or None})
        label = name
        function = (span.get("attrs") or {}).get("function") if isinstance(span.get("attrs"), dict) else None
        if name == "compile" and isinstance(function, str) and function:
            label = f"compile {function}"  # which jitted function (adapters/jax.py): 25 unnamed slices say nothing
        view.host.append(Bar(("host",), label, start, max(start, end), "span",
                              "compile" if name == "compile" else "span", args, reason=name))

    for mb in run.records("microbatch", rank):
        if not (all_window or in_window(mb.get("step"), window)):
            continue
        start, end = as_number(mb.get("start_time")), as_number(mb.get("end_time"))
        if start is None or end is None:
            continue
        kind = str(mb.get("kind", "forward"))
        index = mb.get("microbatch", "?")
        letter = _KIND_LETTER.get(kind, kind[:1].upper() or "?")
        track = ("mb", mb.get("stage"), mb.get("chunk"))
        args = without_none({k: mb.get(k) for k in ("step", "microbatch", "stage", "chunk", "kind",
                                                "compute_seconds", "host_start_time", "host_end_time")})
        view.microbatch.setdefault(track, []).append(Bar(
            track, f"{letter}{index}", start, max(start, end), kind if kind in _KIND_LETTER else "forward",
            f"microbatch.{kind}", args, label=str(index)))
    return view


def _sort_value(value: Any) -> tuple:
    if value is None:
        return (0, 0, "")
    number = as_number(value)
    return (1, number, "") if number is not None else (2, 0, str(value))


def microbatch_tracks(view: RankView) -> list[tuple]:
    """The view's (stage, chunk) tracks in drawing order: by stage, then chunk."""
    return sorted(view.microbatch, key=lambda t: (_sort_value(t[1]), _sort_value(t[2])))


def track_name(track: tuple) -> str:
    """A microbatch track's name: ``stage S chunk C``, ``stage S`` or ``microbatches``."""
    _, stage, chunk = track
    parts = []
    if stage is not None:
        parts.append(f"stage {stage}")
    if chunk is not None:
        parts.append(f"chunk {chunk}")
    return " ".join(parts) if parts else "microbatches"


_HOST_ORDER = {"step": 0, "checkpoint": 0, "span": 1, "blocking": 2}


def host_lanes(bars: list[Bar]) -> list[tuple[Bar, int, int]]:
    """Assign host bars to lanes where they nest properly: (bar, lane, depth).

    Trace viewers draw the X events of one thread as a stack of nested slices;
    two that overlap without nesting would be drawn wrongly, so the second
    goes to the next lane where it nests.
    """
    placed: list[tuple[Bar, int, int]] = []
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


