"""Experiment tracking: scalars into TensorBoard event files, and into Weights & Biases when the
job asks for it.

`Tracker(log_dir, run_name=..., spec=job.spec.tracking)` is what a process that tracks (the
trainer, and the stage driver: `kiln run`'s, the operator's) holds; `log(step, {"train/loss": 0.3, ...})` records one step.
The TensorBoard side is TensorBoard's own event-file writer (no TensorFlow, no torch), one
directory per process (`tensorboard --logdir RUN_DIR` shows them side by side). The W&B side
logs one run per process, grouped under the job's name; `mode: offline` keeps it under
`log_dir` for a later `wandb sync`.

Tracking must never stop training: a failing W&B backend is logged once and then left alone.
A missing `wandb` package with W&B enabled is a configuration error, raised at construction.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

from kiln.api.spec import TrackingSpec

log = logging.getLogger("kiln.tracking")


class Tracker:
    def __init__(self, log_dir: Path, *, run_name: str, group: str, spec: TrackingSpec | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        spec = spec or TrackingSpec()
        self.log_dir = Path(log_dir)
        self._writer = None
        self._wandb = None
        if spec.tensorboard:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(self.log_dir), flush_secs=10)
        if spec.wandb is not None:
            try:
                import wandb
            except ModuleNotFoundError:
                raise ValueError("spec.tracking.wandb is set but the `wandb` package is not "
                                 "installed (pip install wandb), or unset spec.tracking.wandb"
                                 ) from None
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=spec.wandb.project, entity=spec.wandb.entity, mode=spec.wandb.mode,
                group=group, name=f"{group}/{run_name}", job_type=run_name,
                dir=str(self.log_dir), config=dict(config or {}), reinit="create_new")

    def log(self, step: int, scalars: Mapping[str, float | int | None]) -> None:
        """Record `scalars` (tag -> value; None and non-finite values are skipped) at `step`."""
        values = {k: float(v) for k, v in scalars.items()
                  if v is not None and math.isfinite(float(v))}
        if not values:
            return
        if self._writer is not None:
            from tensorboard.compat.proto import event_pb2, summary_pb2

            summary = summary_pb2.Summary(value=[
                summary_pb2.Summary.Value(tag=tag, simple_value=value)
                for tag, value in values.items()])
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                                   summary=summary))
        if self._wandb is not None:
            try:
                self._wandb.log(values, step=int(step))
            except Exception:
                log.exception("W&B logging failed; W&B is off for the rest of this run")
                self._wandb = None

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
