"""`kiln run JOB.yaml`: run an RLJob on this machine (the launcher is `kiln.cli.local`)."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run an RLJob on this machine, every service a local process",
        description="Run an RLJob on this machine: every service (buffer, sandbox, weight-sync, "
                    "trainer, rollout) is started as a local process on loopback from the same "
                    "entry point a pod runs, and the job's stages are driven to the end. The run "
                    "directory gets the resolved job, metrics.jsonl, TensorBoard event files, "
                    "checkpoints, the buffer's log, service logs, report/*.png and "
                    "summary.json. Ctrl-C stops the services in order (the trainer "
                    "checkpoints); --resume continues.")
    p.add_argument("job", nargs="?", type=Path, help="RLJob manifest (not with --resume)")
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
