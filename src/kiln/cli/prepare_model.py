"""`kiln prepare-model JOB`: get the job's model to `spec.model.path` if it is not there
yet: download it from the Hugging Face Hub (`spec.model.hub`) or create it (`spec.model.init`).
`kiln run` does this before it starts the services; in a cluster the operator runs it as an init
container of the trainer and rollout pods.

Safe to run from several processes on one folder at once (the development cluster's pods
share one): a lock file serialises them, and the second finds the model made. Each run from the
same job makes the same model (the tokenizer is trained on the job's own tasks and the weights
drawn from `init.seed`), so pods that cannot share a folder each make an identical copy.
"""
from __future__ import annotations

import argparse
import fcntl
import sys

from kiln.cli.conventions import add_job
from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-model", help="download (spec.model.hub) or create "
                       "(spec.model.init) the job's model if missing",
                       description="Download the checkpoint a job's spec.model.hub names, or "
                                   "create the model its spec.model.init describes, at "
                                   "spec.model.path, unless it is already there. Exits 1 "
                                   "for a job or model that cannot work as written, 2 for a "
                                   "download that stopped (run again to resume it).")
    add_job(p, "the RLJob manifest")
    p.usage = "kiln prepare-model [-h] JOB"  # JOB is required; argparse would show [JOB]
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.api.validate import ManifestError, load_job

    try:
        job = load_job(args.job, local=True)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return Exit.REFUSED
    path = job.spec.model.local_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    from kiln.cli.local.hub import HubError
    from kiln.cli.local.model import prepare_model

    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            prepare_model(job)
        except ValueError as exc:
            print(f"kiln prepare-model: {exc}", file=sys.stderr)
            return Exit.REFUSED
        except HubError as exc:
            # A rerun resumes a download that stopped (an init container is restarted); it
            # cannot help one the Hub refused (no such repository, no access).
            print(f"kiln prepare-model: {exc}", file=sys.stderr)
            return Exit.FAILED if exc.retry else Exit.REFUSED
    return Exit.OK
