"""A finished stage's results, written to the job's output folder (`spec.output`,
`kiln.api.outputs`): its Hugging Face export under `stages/<stage>/` and as `final-hf/`, the job
file, `report/*.png`, `trajectories.jsonl` and `summary.json`.

`trajectories.jsonl` is a sample of what the trainer trained on (every `rollout.sampleEvery`-th
trajectory a batch brought, `record_samples`), in the form `kiln trajectories` reads: on a
cluster the rollout pods' own samples stay in their pods, so the trainer keeps its own. Each
stage end writes the whole log so far (every stage's), each trajectory once.

`tensorboard/` holds the job's TensorBoard event files: the trainer's own (`trainer/`) and the
stage driver's (`driver/`: held-out evaluations, the job's progress, rollout's and the buffer's
figures, which the operator's driver sends with `RecordScalars`, `DriverScalars`). They are
copied out at each stage end and after each held-out evaluation, so the output lags the run by
at most a stage or an evaluation; `tensorboard --logdir OUTPUT/tensorboard` reads them.

The report is the run report's per-step plots (`kiln.plots`: loss over every stage, and the RL
stages' reward, masked fractions, mismatch and staleness) drawn from the trainer's own step
log, `<trainer dir>/steps.jsonl` (one line per optimizer step: the stage and its
`StepMetrics`). Rollout's pass rate and the held-out evaluations are the driver's, not the
trainer's: on a cluster they go to the job's trackers (`kiln.operator.driving`).

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

from kiln.api.spec import RLJob, RLStage
from kiln.metrics import StepMetrics
from kiln.plots import draw_steps
from kiln.tracking import Tracker


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


STEP_LOG = "steps.jsonl"


def record_step(trainer_dir: Path, stage: str, m: StepMetrics) -> None:
    """Append one optimizer step to the trainer's step log."""
    with open(Path(trainer_dir) / STEP_LOG, "a") as f:
        f.write(json.dumps({"stage": stage, "trainer": m.record()}) + "\n")


SAMPLE_LOG = "trajectories.jsonl"


def record_samples(trainer_dir: Path, stage: str, trajs: list, seen: int, every: int) -> int:
    """Append the trajectories of a batch, `seen` having come before it, whose count is a
    multiple of `every`; the count after it."""
    kept = [json.dumps({"stage": stage, **t.to_dict()}) + "\n"
            for i, t in enumerate(trajs) if (seen + i) % every == 0]
    if kept:
        with open(Path(trainer_dir) / SAMPLE_LOG, "a") as f:
            f.writelines(kept)
    return seen + len(trajs)


def _samples(trainer_dir: Path) -> str | None:
    """The sample log, each trajectory once (a batch served again after a restart is logged
    again), lines cut short by a kill left out; None when there is none."""
    path = Path(trainer_dir) / SAMPLE_LOG
    if not path.exists():
        return None
    lines: dict[tuple[str, str], str] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        lines.setdefault((rec["stage"], rec["id"]), line)
    return "".join(line + "\n" for line in lines.values())


def logged_steps(trainer_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(global step, record) of the step log, in order, each step once: the last record of a
    step taken again after a restart wins."""
    path = Path(trainer_dir) / STEP_LOG
    steps: dict[int, dict[str, Any]] = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        steps[int(rec["trainer"]["step"])] = rec
    return sorted(steps.items())


def draw_report(trainer_dir: Path, job: RLJob) -> Path:
    """`<trainer dir>/report/*.png` from the step log; the folder."""
    out = Path(trainer_dir) / "report"
    draw_steps(out, logged_steps(trainer_dir),
               rl_stages={s.name for s in job.spec.stages if isinstance(s, RLStage)})
    return out


def write_stage_output(out: str | Path, job: RLJob, stage: str, export: Path,
                       record: dict[str, Any], report: Path | None = None,
                       samples: Path | None = None) -> None:
    """Copy stage `stage`'s export (`export`, a Hugging Face checkpoint) to `out` (a folder or
    an `s3://` location), the PNGs in `report` (when given) to its `report/`, the sample log of
    the trainer folder `samples` (when given) to its `trajectories.jsonl`, and add `record` (its
    steps, policy version, selected step) to the summary there."""
    trajectories = _samples(samples) if samples is not None else None
    if is_remote(out):
        _upload_stage(str(out), job, stage, export, record, report, trajectories)
        return
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _replace_tree(export, out_dir / "stages" / stage)
    _replace_tree(export, out_dir / "final-hf")
    if report is not None:
        _replace_tree(report, out_dir / "report")
    _write(out_dir / "job.yaml", _job_yaml(job))
    if trajectories is not None:
        _write(out_dir / SAMPLE_LOG, trajectories)
    summary_file = out_dir / "summary.json"
    _write(summary_file, _summary(summary_file.read_text() if summary_file.exists() else None,
                                  job, stage, record))


def _upload_stage(uri: str, job: RLJob, stage: str, export: Path, record: dict[str, Any],
                  report: Path | None, trajectories: str | None) -> None:
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
    for png in sorted(report.glob("*.png")) if report is not None else []:
        fs.put_file(str(png), f"{root}/report/{png.name}")
    fs.pipe_file(f"{root}/job.yaml", _job_yaml(job).encode())
    if trajectories is not None:
        fs.pipe_file(f"{root}/{SAMPLE_LOG}", trajectories.encode())
    summary = f"{root}/summary.json"
    previous = fs.cat_file(summary).decode() if fs.exists(summary) else None
    fs.pipe_file(summary, _summary(previous, job, stage, record).encode())


def write_tensorboard(out: str | Path, tensorboard: Path) -> None:
    """Copy the event files under `tensorboard` (the trainer's folder) to `out`'s
    `tensorboard/`, replacing older copies (event files only grow)."""
    files = sorted(p for p in Path(tensorboard).rglob("*") if p.is_file())
    if not files:
        return
    if is_remote(out):
        import fsspec

        fs, root = fsspec.core.url_to_fs(str(out))
        for f in files:
            fs.put_file(str(f), f"{root}/tensorboard/{f.relative_to(tensorboard).as_posix()}")
        return
    for f in files:
        dst = Path(out) / "tensorboard" / f.relative_to(tensorboard)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copyfile(f, tmp)
        os.replace(tmp, dst)  # a reader sees the old copy or the new one, never half


class DriverScalars:
    """The stage driver's scalars, kept by the trainer beside its own (`<trainer dir>/
    tensorboard/driver`) and copied to the output after each held-out evaluation. W&B is not
    written here: the driver logs to W&B itself."""

    def __init__(self, job: RLJob, trainer_dir: Path, output_dir: str | Path | None) -> None:
        self.folder = Path(trainer_dir) / "tensorboard"
        self.output_dir = output_dir
        self.tracker = (Tracker(self.folder / "driver", run_name="driver",
                                group=job.metadata.name,
                                spec=job.spec.tracking.model_copy(update={"wandb": None}))
                        if job.spec.tracking.tensorboard else None)

    def record(self, step: int, scalars: dict[str, float]) -> None:
        if self.tracker is None:
            return
        self.tracker.log(step, scalars)
        if self.output_dir is not None and any(k.startswith("eval/") for k in scalars):
            self.tracker.flush()
            write_tensorboard(self.output_dir, self.folder)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
