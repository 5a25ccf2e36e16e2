"""The PNG pictures: the report's per-step stacked bars (:func:`plot_timeline`) and the timeline's
per-rank host/device lanes (:func:`render_png`, drawn from :mod:`steptrace.analysis.lanes` like the
Perfetto trace). One module, one palette (``palette``); matplotlib is imported inside the functions,
so importing this module stays cheap."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from steptrace.analysis._text import literal_text
from steptrace.analysis.lanes import (
    Bar,
    StepWindow,
    as_window,
    host_lanes,
    microbatch_tracks,
    rank_view,
    select_ranks,
    time_origin,
    track_name,
    window_text,
)
from steptrace.analysis.palette import (
    BACKWARD_COLOUR,
    BLOCKING_COLOUR,
    ERROR_COLOUR,
    ERROR_EDGE,
    FORWARD_COLOUR,
    REASON_COLOURS,
    SEPARATE,
    STEP_COLOUR,
    STEP_EDGE,
    reason_colour,
    reason_order,
)
from steptrace.analysis.runs import Run
from steptrace.analysis.goodput import job_goodput
from steptrace.analysis.summary import as_number, percent_text, step_split, summarize

_MAX_BARS = 500


def _before_first_step_bar(ax, first: dict, x: float, width: float, labelled: set[str], span: float,
                           before_init: float = 0.0) -> None:
    """The time before the first step (start-up, an eval before step 0, ...) as a hatched bar left
    of it, stacked by reason: wall time of the run that no step's interval holds. ``before_init``:
    the process start to ``init()`` (start-up too: goodput's wall starts at the process start)."""
    before = first.get("before_step_breakdown")
    before = dict(before) if isinstance(before, dict) else {}
    if before_init > 0:
        before["startup"] = (as_number(before.get("startup")) or 0.0) + before_init
    if not before:
        return
    bottom = 0.0
    for reason in reason_order(before):
        height = as_number(before.get(reason)) or 0.0
        ax.bar([x], [height], width=width, bottom=[bottom], color=reason_colour(reason), hatch="//",
               edgecolor="white", linewidth=0, label=None if reason in labelled else reason)
        bottom += height
    label = f"before\nfirst step\n{bottom:.2f} s"
    if bottom > 3 * span:
        # A long start-up would flatten every step: clip the axis and say the bar's height in words.
        ax.set_ylim(0, 1.3 * span)
        ax.annotate(label + " (clipped)", (x, 1.3 * span), xytext=(0, -4), textcoords="offset points",
                    ha="center", va="top", fontsize="x-small")
    else:
        ax.annotate(label, (x, bottom), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                    fontsize="x-small")


@literal_text
def plot_timeline(run: Run, out_png: str | Path, *, rank: int | None = None) -> Path:
    """Save a per-step stacked bar chart (compute, then idle reasons) as PNG."""
    # Build a Figure directly instead of going through pyplot: it renders with
    # Agg without switching the global backend of a caller's session.
    from matplotlib.figure import Figure

    rank = run.resolve_rank(rank)
    steps = [s for s in run.steps(rank) if as_number(s.get("step")) is not None]
    checkpoints = run.checkpoints(rank)
    summary = summarize(steps, checkpoints)

    xs = [as_number(s["step"]) for s in steps]
    # Steps may be logged sparsely (every N); size bars to the smallest gap.
    gaps = [b - a for a, b in zip(xs, xs[1:]) if b > a]
    width = 0.8 * (min(gaps) if gaps else 1.0)

    fig = Figure(figsize=(min(max(6.0, 0.12 * len(steps) + 4), 24.0), 4.5))
    ax = fig.add_subplot()

    bottoms = [0.0] * len(steps)
    # One Rectangle per bar gets slow (minutes for 20k steps) and the bars are
    # sub-pixel anyway, so long runs are drawn as filled step bands instead.
    as_bars = len(steps) <= _MAX_BARS

    def stack(label: str, heights: list[float], colour: str | None = None) -> None:
        tops = [b + h for b, h in zip(bottoms, heights)]
        colour = colour or reason_colour(label)
        if as_bars:
            ax.bar(xs, heights, width=width, bottom=bottoms, label=label,
                   color=colour, linewidth=0)
        else:
            ax.fill_between(xs, bottoms, tops, step="mid", label=label,
                            color=colour, linewidth=0)
        bottoms[:] = tops

    if steps:
        # Waiting shown as waiting: own compute, the wait in collectives, host idle by reason (less
        # the wait that fell in it); the three add up to each step's interval.
        splits = [step_split(s) for s in steps]
        waited = summary["collective_wait_seconds"] is not None
        stack("own compute" if waited else "compute", [p.own_compute_seconds for p in splits],
              REASON_COLOURS["compute"])
        if waited:
            stack("waiting in collectives", [p.collective_wait_seconds for p in splits],
                  REASON_COLOURS["collective_wait"])
        reasons = {reason for p in splits for reason in p.idle_breakdown}
        for reason in reason_order(reasons):
            stack(reason, [p.idle_breakdown.get(reason, 0.0) for p in splits])

        top = {x: b for x, b in zip(xs, bottoms)}
        span = max(bottoms) if bottoms else 1.0
        attempt = next((r for r in run.records_by_rank.get(rank, []) if r.get("type") == "attempt"
                        and r.get("attempt") == steps[0].get("attempt")), {})
        start, init = as_number(attempt.get("start_time")), as_number(attempt.get("init_time"))
        _before_first_step_bar(ax, steps[0], xs[0] - (min(gaps) if gaps else 1.0), width, reasons, span,
                               before_init=init - start if start is not None and init is not None else 0.0)
        ckpt_steps = [as_number(c.get("step")) for c in checkpoints]
        ckpt_xs = [x for x in ckpt_steps if x in top]
        if ckpt_xs:
            ax.scatter(ckpt_xs, [top[x] + 0.03 * span for x in ckpt_xs], marker="v",
                       color=REASON_COLOURS["checkpoint"], zorder=3,
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
    job = job_goodput(run.records_by_rank)
    title = f"{run.run_id} (rank {rank}): goodput {percent_text(job['goodput'])}"
    if len(job["ranks"]) > 1 and rank in job["ranks"]:
        title += f" (the job's; rank {rank}'s own {percent_text(job['ranks'][rank]['goodput'])})"
    ax.set_title(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, format="png", dpi=100)
    return out_png


_FIG_WIDTH_IN = 16.0
_LEFT_IN = 1.9
_RIGHT_IN = 0.3
_TOP_IN = 0.45
_BOTTOM_IN = 1.1  # x label and the legend under it
_MAX_LABELS = 3000


@literal_text
def render_png(run: Run, path: str | Path, *, ranks: Iterable[int] | None = None,
               steps: str | StepWindow | None = None, dpi: int = 100) -> Path:
    """Draw the timeline as a PNG: per rank a host row, a device row and one row per (stage, chunk).

    x is seconds since the run's earliest recorded time.  Device rows show
    compute in green and each idle reason in its own stable colour (those of
    ``steptrace report --plot``); microbatch rows show forward (light) and
    backward (dark) passes with the microbatch index written in bars wide
    enough to hold it, so a 1F1B or interleaved schedule reads as its usual
    staircase.  For long runs pass *steps* (``"A:B"``): every step is drawn
    by default, and thousands of steps turn into sub-pixel slivers.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("steptrace timeline --png needs matplotlib: pip install 'steptrace[report]'") from exc

    selected = select_ranks(run, ranks)
    window = as_window(steps)
    origin = time_origin(run)
    views = [rank_view(run, rank, window) for rank in selected]

    # Rows top to bottom: (label, draw list of (bar, depth)).
    rows: list[tuple[str, list[tuple[Bar, int]]]] = []
    rank_first_row: list[int] = []
    for view in views:
        rank_first_row.append(len(rows))
        lanes = host_lanes(view.host)
        n_lanes = max([lane for _, lane, _ in lanes], default=0) + 1
        for lane in range(n_lanes):
            drawn = [(bar, depth) for bar, bar_lane, depth in lanes if bar_lane == lane]
            if lane == 0:
                # Async commits overlap later steps: a thin band under the host row.
                drawn += [(bar, 0) for bar in view.commit]
            rows.append((f"rank {view.rank}  host" + ("" if lane == 0 else f" ({lane + 1})"), drawn))
        rows.append((f"rank {view.rank}  device", [(bar, 0) for bar in view.device]))
        for track in microbatch_tracks(view):
            rows.append((f"rank {view.rank}  {track_name(track)}",
                         [(bar, 0) for bar in view.microbatch[track]]))

    row_in = 0.4 if len(rows) <= 60 else max(0.12, 20.0 / len(rows))
    height = _TOP_IN + _BOTTOM_IN + row_in * max(len(rows), 1)
    fig = Figure(figsize=(_FIG_WIDTH_IN, height), dpi=dpi)
    fig.subplots_adjust(left=_LEFT_IN / _FIG_WIDTH_IN, right=1 - _RIGHT_IN / _FIG_WIDTH_IN,
                        top=1 - _TOP_IN / height, bottom=_BOTTOM_IN / height)
    ax = fig.add_subplot()

    bars = [bar for _, drawn in rows for bar, _ in drawn]
    x_lo = min((b.start for b in bars), default=origin) - origin
    x_hi = max((b.end for b in bars), default=origin + 1.0) - origin
    if x_hi <= x_lo:
        x_hi = x_lo + 1e-3
    pad = (x_hi - x_lo) * 0.01
    ax.set_xlim(x_lo - pad, x_hi + pad)
    px_per_second = (_FIG_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * dpi / ((x_hi - x_lo) + 2 * pad)
    row_px = row_in * dpi
    font_pt = max(4.5, min(7.0, row_px * 0.45 * 72 / dpi))
    char_px = 0.62 * font_pt * dpi / 72

    legend: dict[str, Patch] = {}

    def style(bar: Bar) -> tuple[str, dict, str]:
        """(facecolour, extra broken_barh kwargs, legend label) for a bar."""
        if bar.kind == "step":
            if bar.error:
                return ERROR_COLOUR, {"edgecolor": ERROR_EDGE, "linewidth": 0.8}, "error step"
            return STEP_COLOUR, {"edgecolor": STEP_EDGE, "linewidth": 0.6}, "host step"
        if bar.kind == "compute":
            if bar.error:
                return REASON_COLOURS["compute"], {"edgecolor": ERROR_EDGE, "hatch": "xx",
                                                     "linewidth": 0.8}, "error step"
            # White edges keep back-to-back steps (and microbatches) apart.
            return REASON_COLOURS["compute"], SEPARATE, "compute"
        if bar.kind == "idle":
            # A reason has one colour: its host span and the device idle it caused.
            return reason_colour(bar.reason), {}, bar.reason
        if bar.kind == "checkpoint":
            return reason_colour("checkpoint"), {}, "checkpoint"
        if bar.kind == "blocking":
            return BLOCKING_COLOUR, {}, "checkpoint blocking"
        if bar.kind == "commit":
            return "white", {"edgecolor": reason_colour("checkpoint"), "hatch": "////",
                             "linewidth": 0.5}, "checkpoint async commit"
        if bar.kind == "span":
            return reason_colour(bar.reason), {}, bar.reason
        if bar.kind == "backward":
            return BACKWARD_COLOUR, SEPARATE, "backward microbatch"
        if bar.kind == "backward_input":
            return BACKWARD_COLOUR, SEPARATE, "backward (input) microbatch"
        if bar.kind == "backward_weight":
            return BACKWARD_COLOUR, {**SEPARATE, "hatch": "///"}, "backward (weight) microbatch"
        return FORWARD_COLOUR, SEPARATE, "forward microbatch"

    labels_left = _MAX_LABELS
    for index, (_, drawn) in enumerate(rows):
        y = len(rows) - 1 - index
        groups: dict[tuple, list[tuple[float, float]]] = {}  # one broken_barh per style
        kwargs_of: dict[tuple, dict] = {}
        for bar, depth in drawn:
            colour, kwargs, label = style(bar)
            if legend.get(label) is None:
                legend[label] = Patch(facecolor=colour, label=label, **kwargs)
            narrow = (bar.end - bar.start) * px_per_second < 4
            if narrow and not bar.error:
                # Outlines of sub-pixel bars would paint over their fill (long runs).
                kwargs = {"linewidth": 0}
            if bar.kind == "commit":
                extent = (y - 0.4, 0.22)
            elif bar.track == ("host",):
                # Nested host spans are drawn thinner, on top of their parents.
                extent = (y - 0.4 * 0.72 ** depth, 0.8 * 0.72 ** depth)
            else:
                extent = (y - 0.4, 0.8)
            key = (depth + (1 if bar.kind == "commit" else 0), colour, label, extent, narrow)
            groups.setdefault(key, []).append((bar.start - origin, bar.end - bar.start))
            kwargs_of[key] = kwargs
        for key in sorted(groups, key=lambda k: k[0]):
            layer, colour, _label, extent, _narrow = key
            ax.broken_barh(groups[key], extent, facecolors=colour, zorder=2 + layer, **kwargs_of[key])
        # Text: microbatch indices and step numbers where they fit.
        for bar, _depth in drawn:
            if labels_left <= 0:
                break
            if bar.kind in ("forward", "backward", "backward_input", "backward_weight"):
                text = bar.name
                if (bar.end - bar.start) * px_per_second < len(text) * char_px + 3:
                    text = bar.label
            elif bar.kind == "compute":
                text = f"step {bar.label}"
                if (bar.end - bar.start) * px_per_second < len(text) * char_px + 3:
                    text = bar.label
            else:
                continue
            if (bar.end - bar.start) * px_per_second < len(text) * char_px + 3:
                continue
            colour = "white" if bar.kind in ("backward", "backward_input", "backward_weight", "compute") else "black"
            ax.text((bar.start + bar.end) / 2 - origin, y, text, ha="center", va="center",
                    fontsize=font_pt, color=colour, zorder=5, clip_on=True)
            labels_left -= 1

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    for first in rank_first_row[1:]:
        ax.axhline(len(rows) - first - 0.5, color="#555555", linewidth=0.8, zorder=1)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("seconds since run start")

    n_steps = max((len(v.steps) for v in views), default=0)
    rank_text = f"rank {selected[0]}" if len(selected) == 1 else f"{len(selected)} ranks"
    if window == (None, None):
        step_text = "all steps"
    else:
        step_text = f"step{'' if window[0] == window[1] else 's'} {window_text(window)}"
    title = f"{run.run_id}: {rank_text}, {step_text} ({n_steps} step{'' if n_steps == 1 else 's'})"
    if n_steps and (x_hi - x_lo) * px_per_second / n_steps < 3:
        title += " - steps are narrower than a few pixels: zoom in with --steps A:B"
    ax.set_title(title, loc="left", fontsize=10)
    if not bars:
        ax.text(0.5, 0.5, "no records in the selected ranks and steps", ha="center", va="center",
                transform=ax.transAxes)
    if legend:
        fixed_head = ["host step", "error step", "compute"]
        fixed_tail = ["checkpoint blocking", "checkpoint async commit", "forward microbatch",
                      "backward microbatch"]
        reasons = reason_order(k for k in legend if k not in fixed_head and k not in fixed_tail)
        handles = [legend[k] for k in fixed_head + reasons + fixed_tail if k in legend]
        fig.legend(handles=handles, loc="lower left", ncol=min(6, len(handles)), fontsize=8,
                   frameon=False, bbox_to_anchor=(_LEFT_IN / _FIG_WIDTH_IN - 0.01, 0.05 / height))
    path = Path(path)
    fig.savefig(path, format="png", dpi=dpi)
    return path
