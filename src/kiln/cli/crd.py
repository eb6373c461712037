"""`kiln crd`: print the RLJob CustomResourceDefinition generated from the spec models."""
from __future__ import annotations

import argparse
import sys

from kiln.api.crd import crd_yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "crd", help="print the RLJob CustomResourceDefinition",
        description="Print the RLJob CustomResourceDefinition, generated from the same pydantic "
                    "models `kiln validate` uses. The chart's copy is "
                    "charts/kiln/crds/rljobs.kiln.dev.yaml.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0
