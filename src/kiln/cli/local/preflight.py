"""What `kiln run` checks before it writes into the run directory, and which job it runs.

A fresh run: the job file is validated as `kiln validate` does (`local=True`), its relative
paths resolved (`kiln.api.paths`), the run directory refused if it holds a previous run, the
model made or downloaded, and the model's capabilities checked once more. Only when all of that
passed is `RUN_DIR/job.yaml` written: a run refused before it started leaves nothing there that
would make the same command, run again, be taken for a second run.

A resumed run (`--resume RUN_DIR`) runs the job saved in `RUN_DIR/job.yaml`. Given a job file
as well (`--resume RUN_DIR JOB`), it runs that one instead, saying what changed, provided that
what changed may change on a running job: what an RLJob on a cluster may change
(`kiln.operator.children.IMMUTABLE_FIELDS` may not: the model, the parallelism, the storage
classes) and not its name (the run's identity). Otherwise it refuses, naming the fields.

`--set PATH=VALUE` overrides (`kiln.api.overrides`) edit the job before it is validated; with
`--resume` they edit the job the run continues with, as an edited job file would.

Exit codes (`kiln.cli.exits`): REFUSED for a job that cannot run as written (as `kiln validate`
and `kiln prepare-model`), FAILED for a download that stopped (running the same command again
resumes it).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from kiln.api.paths import resolve
from kiln.api.spec import RLJob
from kiln.api.outputs import local_refusals as output_refusals
from kiln.api.task_sources import TASKS_ROOT_ENV, local_refusals
from kiln.api.validate import ManifestError, load_job
from kiln.cli.exits import Exit


def dump(job: RLJob) -> str:
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False)


def _tree(job: RLJob) -> dict[str, Any]:
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    """`field: old -> new` for each value that differs between two dumped jobs."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in dict.fromkeys([*old, *new])
                for line in changes(old.get(key), new.get(key), f"{path}.{key}" if path else key)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in changes(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def resume_refusals(old: RLJob, new: RLJob) -> list[str]:
    """The changes of `new` over `old` that a resumed run cannot take."""
    from kiln.operator.children import IMMUTABLE_FIELDS

    refused = [] if old.metadata.name == new.metadata.name else [
        f"metadata.name: {old.metadata.name!r} -> {new.metadata.name!r} (the run's name)"]
    a, b = _tree(old)["spec"], _tree(new)["spec"]
    for path in IMMUTABLE_FIELDS:
        va, vb = _dig(a, path), _dig(b, path)
        if va != vb:
            refused.append(f"spec.{'.'.join(path)}: {va!r} -> {vb!r}")
    return refused


def _dig(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _load(path: Path, err: TextIO, overrides: Sequence[str] = ()) -> RLJob | None:
    try:
        job = resolve(load_job(path, local=True, overrides=overrides), path)
    except ManifestError as exc:
        print(f"kiln run: invalid job:\n{exc}", file=err)
        return None
    if refused := local_refusals(job.spec) + output_refusals(job.spec.output):
        print(f"kiln run: {path}: " + "\n".join(refused), file=err)
        return None
    return job


def prepare(args: argparse.Namespace, out: TextIO | None = None,
            err: TextIO | None = None) -> tuple[RLJob, Path] | int:
    """(the job to run, its run directory, whose job.yaml now holds it), or an exit code."""
    # Looked up now, not when the module was imported: the streams may have been replaced since.
    out, err = out or sys.stdout, err or sys.stderr
    if args.resume:
        run_dir = args.resume.resolve()
        saved = run_dir / "job.yaml"
        if not saved.exists():
            print(f"kiln run: --resume {args.resume}: no job.yaml there; not a run directory", file=err)
            return Exit.REFUSED
        job = _load(saved, err)
        if job is None:
            return Exit.REFUSED
        overrides = getattr(args, "overrides", [])
        if args.job is not None or overrides:
            edited = args.job if args.job is not None else saved
            new = _load(edited, err, overrides)
            if new is None:
                return Exit.REFUSED
            if refused := resume_refusals(job, new):
                print(f"kiln run: --resume {args.resume} {edited}: a resumed run keeps what "
                      f"its checkpoints and buffer were made with; these cannot change: "
                      f"{'; '.join(refused)}. Restore them, or start a new run (another "
                      "--run-dir)", file=err)
                return Exit.REFUSED
            diff = changes(_tree(job), _tree(new))
            out.write(f"resuming with {edited}{' and --set' if overrides else ''}: "
                      + ("; ".join(diff) if diff else "no changes") + "\n")
            job = new
    elif args.job is None:
        print("kiln run: give a job file, or --resume RUN_DIR", file=err)
        return Exit.REFUSED
    else:
        job = _load(args.job, err, getattr(args, "overrides", []))
        if job is None:
            return Exit.REFUSED
        run_dir = (args.run_dir or Path("runs") / job.metadata.name).resolve()
        # A run stopped during its first stage has no state.json yet, but its job.yaml (and
        # maybe checkpoints) would be mixed into this one's.
        if (run_dir / "state.json").exists() or (run_dir / "job.yaml").exists():
            print(f"kiln run: {run_dir} holds a previous run; use --resume {run_dir} or another "
                  "--run-dir", file=err)
            return Exit.REFUSED
    fetched = _fetch_tasks(job, run_dir, out, err)
    if isinstance(fetched, int):
        return fetched
    if (code := _check_model(job, out, err)) is not None:
        _unfetch(run_dir, fetched)
        return code
    if job.spec.tracking.wandb is not None and importlib.util.find_spec("wandb") is None:
        print("kiln run: spec.tracking.wandb is set but the `wandb` package is not installed "
              "(pip install wandb), or unset spec.tracking.wandb", file=err)
        return Exit.REFUSED
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.yaml").write_text(dump(job))
    return job, run_dir


def _fetch_tasks(job: RLJob, run_dir: Path, out: TextIO, err: TextIO) -> list[Path] | int:
    """Fetch the Hub dataset task sets into `RUN_DIR/tasks/<set>/` (a resumed run finds them
    recorded there) and tell the services to read them there, as a pod's init container and
    TASKS_ROOT_ENV do. The folders it made (removed again if the pre-flight fails), or an exit
    code, having removed them."""
    from kiln.cli.hf_tasks import DatasetError, fetch, hub_task_sets

    root, made = run_dir / "tasks", []
    for i, ts in hub_task_sets(job.spec.tasks):
        if not (root / ts.name).exists():
            made.append(root / ts.name)
        try:
            fetch(ts, root, out, where=f"spec.tasks[{i}].source.hfDataset")
        except DatasetError as exc:
            _unfetch(run_dir, made)
            print(f"kiln run: {exc}" + ("; run the same command again to retry"
                                        if exc.retry else ""), file=err)
            return Exit.FAILED if exc.retry else Exit.REFUSED
    if hub_task_sets(job.spec.tasks):
        os.environ[TASKS_ROOT_ENV] = str(root)
    return made


def _unfetch(run_dir: Path, made: list[Path]) -> None:
    """Leave nothing of a refused run behind: the task folders it fetched, and the folders above
    them it made."""
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)
    for folder in (run_dir / "tasks", run_dir):
        try:
            folder.rmdir()  # only if empty: a resumed run's folder stays
        except OSError:
            pass


def _check_model(job: RLJob, out: TextIO, err: TextIO) -> int | None:
    """Make or download the model, then check its capabilities; an exit code if that fails."""
    from kiln.api.capabilities import job_model_refusals
    from kiln.cli.local.hub import HubError
    from kiln.cli.local.model import prepare_model

    model = job.spec.model
    if model.init is None and model.hub is None and not (Path(model.path) / "config.json").exists():
        print(f"kiln run: spec.model.path: {model.path} holds no config.json, and neither "
              "spec.model.init nor spec.model.hub is set to get one there", file=err)
        return Exit.REFUSED
    try:
        prepare_model(job, out)
    except HubError as exc:
        print(f"kiln run: {exc}" + ("; run the same command again to continue the download"
                                    if exc.retry else ""), file=err)
        return Exit.FAILED if exc.retry else Exit.REFUSED
    # The model capabilities once more: spec.model.init may just have made the checkpoint.
    try:
        problems = [r.message for r in job_model_refusals(job.spec)]
    except ValueError as exc:
        problems = [str(exc)]
    if problems:
        print(f"kiln run: spec.model.path: {model.path}: {problems[0]}", file=err)
        return Exit.REFUSED
    return None
