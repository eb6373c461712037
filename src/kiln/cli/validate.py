"""`kiln validate FILE...`: check RLJob manifests with the torch-free API, one line per problem."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.api.validate import validate_file
from kiln.cli.conventions import add_set
from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check RLJob manifests against the schema",
        description="Check RLJob manifests: YAML syntax, schema, value ranges and cross-field "
                    "rules. Prints FILE:LINE: FIELD: what was expected and found, one line per "
                    "problem; exits 0 when every file is valid, 1 otherwise (as `kiln run` does "
                    "for a job it cannot run as written). --set edits every job before it is "
                    "checked, as it would edit the job of `kiln run`. Plugins a job names (env or reward "
                    "`{plugin: module:Name}`) are imported and checked: put their folder on "
                    "PYTHONPATH. Task files and checkpoints must be here: relative task paths "
                    "are read from the job file's folder, relative model and teacher "
                    "checkpoints from the working directory.")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="RLJob manifest(s)")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    add_set(p)
    p.set_defaults(func=run)


def _download_note(job) -> str | None:  # type: ignore[no-untyped-def]
    """What getting the job's model will download, if anything."""
    import os

    from kiln.cli.local.hub import recorded

    hub = job.spec.model.hub
    if hub is None:
        return None
    where = f"spec.model.pvc {job.spec.model.pvc}, " if job.spec.model.pvc else ""
    if not job.spec.model.pvc and recorded(hub, job.spec.model.local_path()):
        return f"model {hub.id}@{hub.revision} already downloaded to {job.spec.model.path}"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    # On a cluster the Secret's token, here HF_TOKEN (what the download will use).
    has_token = hub.token_secret if job.spec.model.pvc else os.environ.get("HF_TOKEN")
    return (f"will download {hub.id}@{hub.revision} from {endpoint} to {where}"
            f"{job.spec.model.path} ({'with' if has_token else 'without'} a token) before the "
            "job starts")


def run(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        jobs, problems = validate_file(path, local=True, overrides=args.overrides)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed += 1
        elif not args.quiet:
            names = ", ".join(j.metadata.name for j in jobs)
            print(f"{path}: OK ({names})")
            for job in jobs:
                if (note := _download_note(job)) is not None:
                    print(f"  {job.metadata.name}: {note}")
    if failed:
        print(f"{failed} of {len(args.files)} file(s) invalid", file=sys.stderr)
    return Exit.REFUSED if failed else Exit.OK
