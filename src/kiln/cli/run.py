"""`kiln run JOB.yaml`: run an RLJob on this machine (the launcher is `kiln.cli.local`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cli.conventions import add_job, add_set


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run an RLJob on this machine, every service a local process",
        description="Run an RLJob on this machine: every service (buffer, sandbox, weight-sync, "
                    "trainer, rollout) is started as a local process on loopback from the same "
                    "entry point a pod runs, and the job's stages are driven to the end. The run "
                    "directory gets the resolved job, metrics.jsonl, TensorBoard event files, "
                    "checkpoints, the buffer's log, service logs, report/*.png and "
                    "summary.json. Ctrl-C stops the services in order (the trainer "
                    "checkpoints); --resume continues. Exits 1 for a job that cannot run as "
                    "written (nothing is written to the run directory then), 2 when the run "
                    "stopped on a failure (--resume continues), 130 when interrupted.")
    add_job(p, "RLJob manifest; with --resume, an edited job to continue with (what a running "
               "job cannot change, such as the model or the parallelism, is refused)",
            required=False)
    add_set(p)
    p.add_argument("--run-dir", type=Path,
                   help="run directory (default: runs/<metadata.name> under the working "
                        "directory); must not hold a previous run")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue a stopped run from its directory: finished stages and "
                        "evaluations are skipped, the trainer and buffer resume their state")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kiln.cli.local.launcher import main

    return main(args)
