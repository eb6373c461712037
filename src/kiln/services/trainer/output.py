"""A finished stage's results, written to the job's output folder (`spec.output`,
`kiln.api.outputs`): its Hugging Face export under `stages/<stage>/` and as `final-hf/`, the job
file and `summary.json`.

In a folder (a mounted PVC) each tree is copied beside its place first and renamed into it, so
a reader (`kiln export`) never finds half a checkpoint; writing a stage again (a retried stage
end) replaces it. At an S3 location (fsspec/s3fs, credentials from the environment) objects
are uploaded one by one, models first and `summary.json` last: a stage is there once the
summary names it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from kiln.api.spec import RLJob


def _replace_tree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _summary(previous: str | None, job: RLJob, stage: str, record: dict[str, Any]) -> str:
    summary = json.loads(previous) if previous else {"job": job.metadata.name, "stages": {}}
    summary["stages"][stage] = record
    summary["final_stage"] = stage
    summary["final_policy_version"] = record["policy_version"]
    return json.dumps(summary, indent=1, sort_keys=True)


def _job_yaml(job: RLJob) -> str:
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True),
                          sort_keys=False)


def is_remote(out: str | Path) -> bool:
    return "://" in str(out)


def write_stage_output(out: str | Path, job: RLJob, stage: str, export: Path,
                       record: dict[str, Any]) -> None:
    """Copy stage `stage`'s export (`export`, a Hugging Face checkpoint) to `out` (a folder or
    an `s3://` location) and add `record` (its steps, policy version, selected step) to the
    summary there."""
    if is_remote(out):
        _upload_stage(str(out), job, stage, export, record)
        return
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _replace_tree(export, out_dir / "stages" / stage)
    _replace_tree(export, out_dir / "final-hf")
    _write(out_dir / "job.yaml", _job_yaml(job))
    summary_file = out_dir / "summary.json"
    _write(summary_file, _summary(summary_file.read_text() if summary_file.exists() else None,
                                  job, stage, record))


def _upload_stage(uri: str, job: RLJob, stage: str, export: Path, record: dict[str, Any]) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    files = sorted(p for p in export.rglob("*") if p.is_file())
    names = {f.relative_to(export).as_posix() for f in files}
    for folder in (f"{root}/stages/{stage}", f"{root}/final-hf"):
        for f in files:
            fs.put_file(str(f), f"{folder}/{f.relative_to(export).as_posix()}")
        # What an earlier stage left there and this one's export does not have.
        stale = [k for k in (fs.find(folder) if fs.exists(folder) else [])
                 if k.removeprefix(f"{folder}/") not in names]
        if stale:
            fs.rm(stale)
    fs.pipe_file(f"{root}/job.yaml", _job_yaml(job).encode())
    summary = f"{root}/summary.json"
    previous = fs.cat_file(summary).decode() if fs.exists(summary) else None
    fs.pipe_file(summary, _summary(previous, job, stage, record).encode())
