"""`kiln validate FILE...`: check RLJob manifests with the torch-free API, one line per problem."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.api.validate import validate_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check RLJob manifests against the schema",
        description="Check RLJob manifests: YAML syntax, schema, value ranges and cross-field "
                    "rules. Prints FILE:LINE: FIELD: what was expected and found, one line per "
                    "problem; exits 0 when every file is valid, 1 otherwise. Plugins a job names "
                    "(env or reward `{plugin: module:Name}`) are imported and checked: put their "
                    "folder on PYTHONPATH.")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="RLJob manifest(s)")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        jobs, problems = validate_file(path, local=True)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed += 1
        elif not args.quiet:
            names = ", ".join(j.metadata.name for j in jobs)
            print(f"{path}: OK ({names})")
    if failed:
        print(f"{failed} of {len(args.files)} file(s) invalid", file=sys.stderr)
    return 1 if failed else 0
