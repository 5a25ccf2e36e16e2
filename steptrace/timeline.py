"""``steptrace.timeline``: kept as an import path and command (``python -m steptrace.timeline``).

The code lives in :mod:`steptrace.analysis.timeline` (the trace) and
:mod:`steptrace.analysis.plotting` (``render_png``).
"""

from steptrace.analysis.plotting import render_png
from steptrace.analysis.timeline import (
    StepWindow,
    add_timeline_arguments,
    build_trace,
    main,
    parse_steps,
    run_timeline,
    write_trace,
)

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

if __name__ == "__main__":
    raise SystemExit(main())
