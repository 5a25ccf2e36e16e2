"""``python -m steptrace.compare RUN_A RUN_B``: see :mod:`steptrace.analysis.compare`."""

from steptrace.analysis.compare import compare_runs, main

__all__ = ["compare_runs", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
