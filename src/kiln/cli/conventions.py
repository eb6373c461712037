"""What every `kiln` command spells the same way: the job as the first argument (`kiln
prepare-model JOB`), `--set PATH=VALUE` overrides of the job, and sizes as Kubernetes quantities
(`256Mi`, as in the manifest). Exit codes are `kiln.cli.exits`.

Not covered: the services' own entry points (`python -m kiln.services.<name>.main --job FILE`),
which pods and `kiln run` start, not people.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.api.base import quantity_value
from kiln.cli.exits import deprecated_flag


def add_job(p: argparse.ArgumentParser, help_: str, *, required: bool = True,
            shifts_to: str | None = None) -> None:
    """The job manifest as the first positional argument, JOB. `--job JOB`, the older
    spelling, still works this release with a one-line warning (the operator's init containers
    of earlier versions run `kiln prepare-model --job FILE`). `shifts_to`: the positional that
    the first argument is when `--job` is given (`kiln eval MODEL_DIR --job JOB` was the older
    order of `kiln eval JOB MODEL_DIR`)."""
    p.add_argument("job", nargs="?", type=Path, metavar="JOB", help=help_)
    p.add_argument("--job", dest="job_flag", type=Path, metavar="JOB",
                   help="deprecated: give JOB as the first argument instead")
    p.set_defaults(job_required=required, job_shifts_to=shifts_to)


def take_job(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Settle `args.job` from JOB or the deprecated `--job`; a usage error (exit 1) when it is
    missing or given twice. Run by `kiln.cli.main` after parsing, for commands using `add_job`."""
    if not hasattr(args, "job_flag"):
        return
    flag, shift = args.job_flag, args.job_shifts_to
    if flag is not None:
        if args.job is not None:
            if shift is None or getattr(args, shift) is not None:
                parser.error(f"the job is given twice (JOB {args.job} and --job {flag}); "
                             "give it once, as JOB")
            setattr(args, shift, args.job)
        print(deprecated_flag("--job JOB", f"give the job as the first argument: kiln "
                                           f"{args.command} {flag} ..."), file=sys.stderr)
        args.job = flag
    if args.job is None and args.job_required:
        parser.error("the following arguments are required: JOB (the RLJob manifest)")


def add_set(p: argparse.ArgumentParser) -> None:
    """`--set PATH=VALUE`, repeatable: edits of the job applied before it is validated."""
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="PATH=VALUE",
                   help="set a field of the job before it is validated (repeatable): PATH as "
                        "kiln validate names fields, e.g. spec.stages[1].rl.groupSize=8; VALUE "
                        "read as YAML (8, true, null, [a, b]; quote a string that looks like "
                        "a number)")


def byte_quantity(flag: str):  # type: ignore[no-untyped-def]
    """An argparse `type` reading a size as the manifest does: a Kubernetes quantity
    (`256Mi`, `1Gi`, `1000000`, `1M`), in bytes. `256m` is refused: in a manifest `m` is
    milli, so it would be a quarter of a byte, never what was meant."""

    def parse(text: str) -> int:
        if text.endswith("m") and text[:-1].replace(".", "", 1).isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r}: 'm' is milli in a Kubernetes quantity (as in the manifest); for "
                f"mebibytes write {text[:-1]}Mi")
        try:
            value = quantity_value(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a Kubernetes quantity (expected bytes such as 256Mi, 1Gi, "
                "500M or 1048576)") from None
        if value < 1 or value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes of 1 "
                                             "or more")
        return int(value)

    parse.__name__ = flag  # argparse names the type in its message when it has no other
    return parse
