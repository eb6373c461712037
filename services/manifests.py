"""`kiln validate` and `kiln crd`: manifest commands that need nothing but the torch-free API."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.api.crd import crd_yaml
from kiln.api.validate import validate_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check RLJob manifests against the schema")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.set_defaults(func=_validate)
    p = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition")
    p.set_defaults(func=_crd)


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        jobs, problems = validate_file(path)
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


def _crd(args: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0
