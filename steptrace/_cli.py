"""The ``steptrace`` command: ``steptrace report RUN_DIR``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from steptrace import __version__, report

    parser = argparse.ArgumentParser(prog="steptrace", description="steptrace: device-true training step timings.")
    parser.add_argument("--version", action="version", version=f"steptrace {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report_parser = commands.add_parser("report", help="per-step table and summary of a run directory",
                                        description="Per-step table and summary of a run directory.")
    report.add_report_arguments(report_parser)
    report_parser.set_defaults(handler=report.run_report)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
