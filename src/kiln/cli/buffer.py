"""`kiln buffer check DIR` and `kiln buffer repair DIR`: inspect and salvage a buffer's files.

DIR is a buffer's store (`side.log` and `segments/seg-*.log`) or the buffer service's run
directory holding it (`RUN_DIR/buffer` of `kiln run`, the buffer PVC on a cluster). `check` reads every record and reports, per
file, how many verify, a torn tail (an interrupted append the buffer truncates when it opens:
healthy), or damage with its offset; it exits 0 when nothing is damaged, 3 otherwise. `repair`
shows what salvaging would keep and drop, and with `--yes` does it: the damaged file is kept
beside as `<name>.damaged`, and a new file holds every record that still verifies. Records in
a damaged stretch are lost, and a trajectory recorded as consumed in a lost side-log record may
be served again; both are said before anything is written.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import sys
from pathlib import Path

from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("buffer", help="check or repair a buffer directory",
                       description=__doc__.split("\n\n")[1])
    cmds = p.add_subparsers(dest="action", required=True)
    check = cmds.add_parser("check", help="verify every record; exit 3 on damage",
                            description="Verify every record of a buffer directory: exit 0 when "
                                        "nothing is damaged (a torn tail is not damage), 3 naming "
                                        "the file and offset otherwise.")
    check.add_argument("directory", type=Path, metavar="DIR", help="buffer store or service run directory")
    check.set_defaults(func=run_check)
    repair = cmds.add_parser("repair", help="salvage damaged files (asks for --yes)",
                             description="Show what salvaging the damaged files of a buffer "
                                         "directory keeps and drops; with --yes, keep the damaged "
                                         "files as <name>.damaged and write the salvaged ones. "
                                         "Exits 3 when damage was found and nothing written.")
    repair.add_argument("directory", type=Path, metavar="DIR", help="buffer store or service run directory")
    repair.add_argument("--yes", action="store_true", help="write the salvaged files")
    repair.set_defaults(func=run_repair)


def _store_dir(directory: Path) -> Path:
    """The store folder: DIR itself, or DIR/buffer for a buffer service's run directory."""
    inner = directory / "buffer"
    if (inner / "segments").is_dir() or (inner / "side.log").exists():
        return inner
    return directory


def _files(directory: Path) -> list[Path] | str:
    directory = _store_dir(directory)
    if not (directory / "segments").is_dir() and not (directory / "side.log").exists():
        return f"{directory} is not a buffer directory (no side.log, no segments/)"
    out = [directory / "side.log"] if (directory / "side.log").exists() else []
    out += sorted((directory / "segments").glob("seg-*.log"))
    return out


def _inspect(path: Path) -> tuple[str, bool]:
    """(a line about `path`, whether it is damaged)."""
    from kiln.services.buffer import records

    data = path.read_bytes()
    try:
        result = records.parse(data, path)
    except records.CorruptLog as exc:
        return f"{path}: DAMAGED: {str(exc).split(': ', 1)[1]}", True
    line = f"{path}: {len(result.records)} records, {len(data)} bytes"
    if result.torn:
        line += (f"; torn tail at offset {result.valid_end} ({len(data) - result.valid_end} bytes of an "
                 "interrupted append; the buffer truncates it when it opens)")
    return line, False


def run_check(args: argparse.Namespace) -> int:
    files = _files(args.directory)
    if isinstance(files, str):
        print(f"kiln buffer check: {files}", file=sys.stderr)
        return Exit.REFUSED
    damaged = 0
    for path in files:
        line, bad = _inspect(path)
        print(line, file=sys.stderr if bad else sys.stdout)
        damaged += bad
    if damaged:
        print(f"{damaged} damaged file(s); `kiln buffer repair {args.directory}` shows what can be "
              "salvaged", file=sys.stderr)
        return Exit.PROBLEMS_FOUND
    print(f"{args.directory}: OK ({len(files)} file(s))")
    return Exit.OK


def run_repair(args: argparse.Namespace) -> int:
    from kiln.services.buffer import records

    files = _files(args.directory)
    if isinstance(files, str):
        print(f"kiln buffer repair: {files}", file=sys.stderr)
        return Exit.REFUSED
    lock = os.open(_store_dir(args.directory) / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"kiln buffer repair: {args.directory} is in use by a buffer process; stop it first",
              file=sys.stderr)
        return Exit.FAILED
    try:
        plans = []
        for path in files:
            data = path.read_bytes()
            try:
                records.parse(data, path)
                continue
            except records.CorruptLog:
                pass
            kept, damage = records.salvage(data)
            plans.append((path, kept))
            where = ", ".join(f"offset {d.offset} ({d.problem})" for d in damage)
            print(f"{path}: keeps {len(kept)} records; damaged at {where}")
        if not plans:
            print(f"{args.directory}: nothing damaged")
            return 0
        if not args.yes:
            print("nothing written; run again with --yes to salvage (the damaged files are kept "
                  "beside as <name>.damaged)", file=sys.stderr)
            return Exit.PROBLEMS_FOUND
        for path, kept in plans:
            os.replace(path, path.with_name(path.name + ".damaged"))
            with open(path, "ab") as f:
                records.append_durably(f, records.encode_many((kind, payload) for _, kind, payload in kept))
            records.fsync_dir(path.parent)
            print(f"{path}: rewritten with {len(kept)} records")
        return 0
    finally:
        os.close(lock)
