"""``steptrace timeline``: the command, and the import path ``steptrace.timeline``.

The command writes a run with both renderers of the lane model (:mod:`steptrace.analysis.lanes`):
the Chrome/Perfetto trace (:mod:`steptrace.analysis.timeline`) and the PNG
(:func:`steptrace.analysis.plotting.render_png`). It lives here, above both, so that neither
renderer imports the other.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from steptrace.analysis.lanes import StepWindow, in_window, parse_steps, select_ranks, window_text
from steptrace.analysis.plotting import render_png
from steptrace.analysis.runs import RunDirError, load_run
from steptrace.analysis.timeline import build_trace, write_trace

__all__ = [
    "StepWindow",
    "add_timeline_arguments",
    "build_trace",
    "main",
    "parse_steps",
    "render_png",
    "run_timeline",
    "write_trace",
]


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
    if not args.output and not args.png:
        print("steptrace timeline: nothing to write: give -o TRACE.json and/or --png FILE.png",
              file=sys.stderr)
        return 2
    try:
        run = load_run(args.run_dir)
        ranks = select_ranks(run, args.rank)
    except (RunDirError, OSError) as exc:  # OSError: e.g. an unreadable file
        print(f"steptrace timeline: {exc}", file=sys.stderr)
        return 2
    for warning in run.warnings:
        print(f"steptrace timeline: warning: {warning}", file=sys.stderr)
    window = args.steps if args.steps is not None else (None, None)
    if not any(in_window(s.get("step"), window) for r in ranks for s in run.steps(r)):
        print(f"steptrace timeline: warning: no step records in ranks {ranks}, steps "
              f"{window_text(window)}", file=sys.stderr)

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
