"""`kiln eval JOB MODEL_DIR --task-set NAME --samples N --out DIR`: a checkpoint's pass@k on one
of a job's task sets (the work is `kiln.cli.local.evaluation`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.cli.conventions import add_job
from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a checkpoint on a job's task set: pass@k, mean@N, greedy",
        description="Evaluate a Hugging Face checkpoint on one task set of a job, without "
                    "training: the job's sandbox and rollout services run locally on the "
                    "checkpoint, each task is attempted N times at the job's sampling settings "
                    "and once greedily, and DIR/eval.json gets per-task success counts, pass@k "
                    "(k = 1, 2, 4, ... <= N, the unbiased estimator of Chen et al. 2021), mean@N "
                    "and the greedy success rate. Exits 1 for arguments or a job that cannot "
                    "run, 2 when a service failed (DIR/services/logs says why).")
    # MODEL_DIR came first when the job was `--job JOB`: with that flag, the first argument is
    # still read as MODEL_DIR.
    add_job(p, "RLJob manifest giving the task sets, sandbox and rollout settings",
            shifts_to="model_dir")
    p.add_argument("model_dir", nargs="?", type=Path, metavar="MODEL_DIR",
                   help="Hugging Face checkpoint directory")
    p.add_argument("--task-set", required=True, metavar="NAME", help="task set of the job (spec.tasks)")
    p.add_argument("--samples", type=int, default=8, metavar="N",
                   help="sampled attempts per task (default 8)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="directory for eval.json (and the services' state and logs)")
    p.add_argument("--max-tasks", type=int, default=0, metavar="M",
                   help="evaluate the first M tasks of the set only (default 0: all)")
    # argparse would show both positionals as optional ([JOB] [MODEL_DIR]): the old flag's doing.
    p.usage = ("kiln eval [-h] JOB MODEL_DIR --task-set NAME --out DIR [--samples N] "
               "[--max-tasks M]")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.model_dir is None:
        print("kiln eval: MODEL_DIR is missing: kiln eval JOB MODEL_DIR --task-set NAME --out "
              "DIR", file=sys.stderr)
        return Exit.REFUSED
    from kiln.cli.local.evaluation import main

    return main(args.model_dir, args.job, args.task_set, args.samples, args.out,
                max_tasks=args.max_tasks)
