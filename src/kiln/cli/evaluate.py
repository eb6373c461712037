"""`kiln eval MODEL_DIR --job JOB --task-set NAME --samples N --out DIR`: a checkpoint's pass@k
on one of a job's task sets (the work is `kiln.cli.local.evaluation`)."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a checkpoint on a job's task set: pass@k, mean@N, greedy",
        description="Evaluate a Hugging Face checkpoint on one task set of a job, without "
                    "training: the job's sandbox and rollout services run locally on the "
                    "checkpoint, each task is attempted N times at the job's sampling settings "
                    "and once greedily, and DIR/eval.json gets per-task success counts, pass@k "
                    "(k = 1, 2, 4, ... <= N, the unbiased estimator of Chen et al. 2021), mean@N "
                    "and the greedy success rate. Exits 2 for arguments or a job that cannot "
                    "run, 1 when a service failed (DIR/services/logs says why).")
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--job", type=Path, required=True,
                   help="RLJob manifest giving the task sets, sandbox and rollout settings")
    p.add_argument("--task-set", required=True, metavar="NAME", help="task set of the job (spec.tasks)")
    p.add_argument("--samples", type=int, default=8, metavar="N",
                   help="sampled attempts per task (default 8)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="directory for eval.json (and the services' state and logs)")
    p.add_argument("--max-tasks", type=int, default=0, metavar="M",
                   help="evaluate the first M tasks of the set only (default 0: all)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kiln.cli.local.evaluation import main

    return main(args.model_dir, args.job, args.task_set, args.samples, args.out,
                max_tasks=args.max_tasks)
