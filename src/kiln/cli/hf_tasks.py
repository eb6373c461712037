"""`kiln fetch-tasks JOB --out ROOT [--task-set NAME]`: the job's task sets kept on the Hugging Face Hub
(`spec.tasks[].source.hfDataset`) written as JSONL task files, `ROOT/<task set>/tasks.jsonl`,
where the sandbox's loader reads a mounted source (`kiln.api.task_sources.located`). On a cluster
the operator runs it as an init container of the pods that read task sets; `kiln run` calls
`fetch` in its pre-flight, into the run directory.

Rows to records: each row is one task record; each column becomes the record's field of the
same name, except the columns `columns` maps (`{field: column}`: the column is the named field,
not its own); a null cell is an absent field (a table gives every row every column). For a built-in environment the rows are checked against its task record before
anything is written: a dataset that lacks a column for a required field is refused, naming the
fields; the columns the record has no field for are left out, and said so (a Hub dataset often
carries metadata beside the task). A plugin environment's records are written as they come (its
loader in the sandbox checks them).

The `datasets` library reads the Hub through huggingface_hub: HF_ENDPOINT (a mirror, a test's
stand-in server) and HF_TOKEN are honoured. Its cache lives in the task set's folder while it
loads and is removed after, so a pod's emptyDir holds the task file alone. A folder whose record
(`.kiln-dataset.json`: id, split, revision, commit, columns) matches is not fetched again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

from kiln.api.spec import TaskSetSpec
from kiln.api.task_sources import HF_TASKS_FILE, HfDatasetSource
from kiln.cli.conventions import add_job
from kiln.cli.exits import Exit

RECORD = ".kiln-dataset.json"


class DatasetError(Exception):
    """The dataset could not be fetched or is not a task set. `retry`: whether running again
    can help (the Hub unreachable), or not (no such dataset, a missing column)."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def _recorded(src: HfDatasetSource, folder: Path) -> bool:
    try:
        rec = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return ((folder / HF_TASKS_FILE).exists() and rec.get("id") == src.id
            and rec.get("split") == src.split and rec.get("columns") == src.columns
            and src.revision in (rec.get("revision"), rec.get("commit")))


def _load(src: HfDatasetSource, where: str, cache: Path) -> tuple[list[dict[str, Any]], str]:
    """(the split's rows, the commit they came from)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    token = os.environ.get("HF_TOKEN") or None
    try:
        commit = HfApi().dataset_info(src.id, revision=src.revision, token=token).sha
        rows = datasets.load_dataset(src.id, split=src.split, revision=commit, token=token,
                                     cache_dir=str(cache))
    except (DatasetNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise DatasetError(f"{where}: {src.id}@{src.revision}: not found, or not readable "
                           f"with the token given ({type(exc).__name__})", retry=False) from None
    except ValueError as exc:  # datasets' words for an unknown split
        raise DatasetError(f"{where}.split: {src.split!r}: {exc}", retry=False) from None
    except (HfHubHTTPError, OSError) as exc:
        raise DatasetError(f"{where}: {src.id}: the Hub could not be read ({exc})",
                           retry=True) from None
    return [dict(row) for row in rows], commit or src.revision


def _absent_nulls(value: Any) -> Any:
    """`value` without the null entries of its objects: a dataset is a table (Arrow), which gives
    every row every column, and every object of a column every key any row's has, null where the
    row's record had none; a record's missing field is absent, not null."""
    if isinstance(value, dict):
        return {k: _absent_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_absent_nulls(v) for v in value]
    return value


def _records(rows: list[dict[str, Any]], src: HfDatasetSource, where: str) -> list[dict[str, Any]]:
    """Rows as task records: `columns` applied, every other column under its own name, null
    cells absent."""
    present = set(rows[0]) if rows else set()
    if missing := sorted(f"{field} <- {column}" for field, column in src.columns.items()
                         if column not in present):
        raise DatasetError(f"{where}.columns: no such column in {src.id} ({src.split}): "
                           f"{', '.join(missing)}; its columns: {', '.join(sorted(present))}",
                           retry=False)
    renamed = set(src.columns.values())
    return [_absent_nulls({**{k: v for k, v in row.items() if k not in renamed},
                           **{field: row[column] for field, column in src.columns.items()}})
            for row in rows]


def _checked(records: list[dict[str, Any]], ts: TaskSetSpec, where: str,
             out: TextIO) -> list[dict[str, Any]]:
    """The records of a built-in environment, the columns its record has no field for left out;
    DatasetError naming the required fields no column gives."""
    from pydantic import ValidationError

    from kiln.services.sandbox.environments.tasks import builtin_environment

    if not isinstance(ts.env, str) or not records:
        return records
    model = builtin_environment(ts.env).task_model
    try:
        model.model_validate(records[0])
        return records
    except ValidationError as exc:
        errors = exc.errors()
    missing = sorted({str(e["loc"][0]) for e in errors if e["type"] == "missing" and e["loc"]})
    if missing:
        raise DatasetError(
            f"{where}: dataset {ts.source.hf_dataset.id} ({ts.source.hf_dataset.split}) has no "
            f"column for the required field(s) {', '.join(missing)} of a {ts.env_name!r} task "
            f"(columns: {', '.join(sorted(records[0]))}); name the columns that hold them with "
            f"{where}.columns: {{field: column}}", retry=False)
    extra = sorted({str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and e["loc"]})
    if extra:
        out.write(f"{where}: columns left out (no field of a {ts.env_name!r} task): "
                  f"{', '.join(extra)}\n")
        records = [{k: v for k, v in r.items() if k not in extra} for r in records]
    return records


def fetch(ts: TaskSetSpec, root: Path, out: TextIO = sys.stdout, where: str | None = None) -> Path:
    """Write task set `ts`'s Hub dataset to `root/<name>/tasks.jsonl` (unless recorded there
    already) and return that file. DatasetError naming the field when it cannot."""
    assert ts.source is not None and ts.source.hf_dataset is not None, "not a Hub dataset"
    src = ts.source.hf_dataset
    where = where or f"spec.tasks[{ts.name}].source.hfDataset"
    folder = root / ts.name
    file = folder / HF_TASKS_FILE
    if _recorded(src, folder):
        return file
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / ".cache"
    try:
        rows, commit = _load(src, where, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if not rows:
        raise DatasetError(f"{where}: {src.id} ({src.split}) has no rows", retry=False)
    records = _checked(_records(rows, src, where), ts, where, out)
    tmp = file.with_name(file.name + ".tmp")
    # default=str: dates and other values JSON has no type for, as their text.
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    tmp.replace(file)
    (folder / RECORD).write_text(json.dumps({"id": src.id, "split": src.split, "revision": src.revision,
                                             "commit": commit, "columns": src.columns}))
    out.write(f"{where}: {len(records)} task(s) from {src.id}@{commit[:12]} ({src.split})\n")
    return file


def hub_task_sets(tasks: list[TaskSetSpec]) -> list[tuple[int, TaskSetSpec]]:
    return [(i, ts) for i, ts in enumerate(tasks)
            if ts.source is not None and ts.source.hf_dataset is not None]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-tasks", help="write the job's Hub dataset task sets as task files",
                       description="Load each task set of the job whose source is hfDataset "
                                   "with the `datasets` library and write it as "
                                   "OUT/<task set>/tasks.jsonl (skipped when already there).")
    add_job(p, "the RLJob manifest")
    p.add_argument("--out", type=Path, required=True, help="the folder task sets are read from")
    p.add_argument("--task-set", dest="names", action="append", default=[], metavar="NAME",
                   help="only this task set (repeatable; default: every Hub dataset set)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.api.validate import ManifestError, load_job

    try:
        # Not `local`: in a pod the job's other files (the model) are not this container's.
        job = load_job(args.job)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return Exit.REFUSED
    sets = hub_task_sets(job.spec.tasks)
    if unknown := sorted(set(args.names) - {ts.name for _, ts in sets}):
        print(f"kiln fetch-tasks: --task-set {', '.join(unknown)}: no task set of that name has an "
              "hfDataset source", file=sys.stderr)
        return Exit.REFUSED
    for i, ts in sets:
        if args.names and ts.name not in args.names:
            continue
        try:
            fetch(ts, args.out, where=f"spec.tasks[{i}].source.hfDataset")
        except DatasetError as exc:
            print(f"kiln fetch-tasks: {exc}", file=sys.stderr)
            return Exit.FAILED if exc.retry else Exit.REFUSED
    return Exit.OK
