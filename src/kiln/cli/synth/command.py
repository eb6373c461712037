"""`kiln synth ...`: build verified task sets.

    kiln synth swe --repo PATH_OR_URL [--rev-range A..B] [--max-tasks N] --out DIR
    kiln synth terminal (--seeds FILE | --pages DIR) --model-url URL --out DIR
    kiln synth search --corpus DIR --out DIR
    kiln synth difficulty TASKSET --model-url URL [--samples K] [--sft] --out DIR
    kiln synth import swe-bench FILE --out DIR
    kiln synth import terminal-bench DIR --out DIR

Each pipeline module provides `add_arguments(parser)` and `run(args) -> exit code`, imported
only when its subcommand runs. Every run writes `DIR/report.json` (the funnel and the reasons of
every rejection) and `DIR/funnel.png`, and a re-run into the same DIR skips what is verified.
"""
from __future__ import annotations

import argparse
import importlib

PIPELINES = {
    "swe": ("kiln.cli.synth.swe", "SWE tasks mined from a git repository's history"),
    "terminal": ("kiln.cli.synth.terminal", "terminal tasks drafted by a model and refined"),
    "search": ("kiln.cli.synth.search", "multi-hop search questions from a document corpus"),
    "difficulty": ("kiln.cli.synth.difficulty",
                   "keep tasks the policy solves sometimes; passing episodes as SFT data"),
}
IMPORTS = {
    "swe-bench": ("kiln.cli.synth.imports", "SWE-bench / SWE-Gym / SWE-smith / R2E JSONL"),
    "terminal-bench": ("kiln.cli.synth.imports", "Terminal-Bench task folders"),
}


def _lazy(module: str, attr: str):
    def call(args):
        return getattr(importlib.import_module(module), attr)(args)
    return call


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "synth", help="build verified agentic task sets",
        description="Build agentic task sets (SWE tasks from git history, terminal tasks, search "
                    "questions) or import the field's formats; every task is verified in a "
                    "sandbox before it is written out.")
    sub = parser.add_subparsers(dest="synth_command", required=True, metavar="PIPELINE")
    for name, (module, help_) in PIPELINES.items():
        p = sub.add_parser(name, help=help_, description=help_ + ".")
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(func=_lazy(module, "run"))
    imp = sub.add_parser("import", help="import and re-verify an existing task set",
                         description="Read a task set in one of the field's formats, re-verify "
                                     "every task in a sandbox (gold passes, null fails) and write "
                                     "the ones that pass as a Kiln task set.")
    isub = imp.add_subparsers(dest="import_format", required=True, metavar="FORMAT")
    for name, (module, help_) in IMPORTS.items():
        p = isub.add_parser(name, help=help_, description=help_ + ".")
        mod = importlib.import_module(module)
        mod.add_arguments(p, name)
        p.set_defaults(func=_lazy(module, "run"))
