"""``steptrace.report``: kept as an import path and command (``python -m steptrace.report``).

The code lives in :mod:`steptrace.analysis` (``runs``, ``summary``, ``report``, ``plotting``).
"""

from steptrace.analysis.plotting import plot_timeline
from steptrace.analysis.report import add_report_arguments, main, render_report, run_report
from steptrace.analysis.runs import CLUSTER_FILE, Run, RunDirError, find_run, load_run
from steptrace.analysis.summary import percentile, summarize, summarize_cluster

__all__ = [
    "CLUSTER_FILE",
    "Run",
    "RunDirError",
    "add_report_arguments",
    "find_run",
    "load_run",
    "main",
    "percentile",
    "plot_timeline",
    "render_report",
    "run_report",
    "summarize",
    "summarize_cluster",
]

if __name__ == "__main__":
    raise SystemExit(main())
