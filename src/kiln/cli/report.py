"""`kiln report RUN_DIR`: (re)make a run's `report/*.png` from what it recorded.

`kiln run` draws the report when a run ends, fails or is interrupted; this command draws it
again (after a kill that left no time for it, or while the run is still going, from the steps
recorded so far) from `RUN_DIR/metrics.jsonl`, `state.json` and `job.yaml`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="(re)make a run's report/*.png from its recorded metrics",
        description="Draw RUN_DIR/report/*.png (loss, reward and pass rate, masked fractions, "
                    "mismatch, staleness, held-out evaluations, reward parts) from the run's "
                    "metrics.jsonl, state.json and job.yaml. Works on a finished, failed, "
                    "interrupted or still running run; files there are replaced.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory of `kiln run`")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from kiln.cli.local.report import remake

    try:
        written = remake(args.run_dir)
    except ValueError as exc:
        print(f"kiln report: RUN_DIR: {exc}", file=sys.stderr)
        return Exit.REFUSED
    for path in written:
        print(path)
    return Exit.OK
