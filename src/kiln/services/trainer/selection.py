"""A guarded stage's checkpoints, on the trainer's side (`eval.every`, `select`,
`stopOnRegression`; the rules that pick a step are the driver's, `kiln.control.guard`).

The stage runner checkpoints the weights of every evaluated step: stage step 0 (the weights the
stage starts from) and each step it waits at for an evaluation. `StageGuard` keeps, in
`<run dir>/stages/<stage>.guard.json`, which trainer checkpoint holds each of those stage
steps, which one is the best so far (spared from `keepCheckpoints` pruning through
`checkpoint.protect`), and once the stage ended on one, which and why: a restarted trainer
then reports the stage done rather than training the steps it gave up.

`restore_weights` puts a checkpoint's weights, optimizer and scheduler state back without
moving the step and version counters back: versions only grow (rollout and the buffer order
weights by them), and the trainer's step count stays the optimizer steps it has taken, so the
checkpoints written after a rollback never collide with older ones.

Not covered: data-parallel replicas other than 0 keep no checkpoints to restore (the API
refuses select and stopOnRegression with dataParallel > 1).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.services.trainer import checkpoint as ckpt

# What a rollback leaves as it is (`restore_weights`).
_KEPT = ("step_count", "policy_version", "published_step", "last_step", "stage", "stage_steps",
         "resumed_from")


class StageGuard:
    """The evaluated checkpoints of one stage, kept in a JSON file beside its export."""

    def __init__(self, stages_dir: Path, stage: str, checkpoint_dir: Path | None) -> None:
        self.path = Path(stages_dir) / f"{stage}.guard.json"
        self.stage, self.checkpoint_dir = stage, checkpoint_dir
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.checkpoints: dict[int, int] = {int(k): v for k, v in data.get("checkpoints", {}).items()}
        """Stage step -> the trainer step whose checkpoint holds its weights."""
        self.keep: int | None = data.get("keep")
        self.selected: dict[str, Any] | None = data.get("selected")
        """{"step", "reason"} once the stage ended on one of its checkpoints."""

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"checkpoints": self.checkpoints, "keep": self.keep,
                                   "selected": self.selected}, indent=2))
        os.replace(tmp, self.path)

    def record(self, stage_step: int, trainer_step: int) -> None:
        """Stage step `stage_step`'s weights are trainer checkpoint `trainer_step`."""
        self.checkpoints[stage_step] = trainer_step
        self._save()

    def protect(self, stage_step: int) -> None:
        """Spare `stage_step`'s checkpoint from pruning (the best so far), and only it."""
        if stage_step not in self.checkpoints:
            raise ValueError(f"stage {self.stage!r} has no checkpoint of step {stage_step} "
                             f"(evaluated steps: {sorted(self.checkpoints)})")
        self.keep = stage_step
        self._save()
        if self.checkpoint_dir is not None:
            ckpt.protect(self.checkpoint_dir, [self.checkpoints[stage_step]])

    def checkpoint(self, stage_step: int) -> Path:
        """The checkpoint directory of an evaluated stage step (ValueError if there is none)."""
        if self.checkpoint_dir is None or stage_step not in self.checkpoints:
            raise ValueError(f"stage {self.stage!r} has no checkpoint of step {stage_step} "
                             f"(evaluated steps: {sorted(self.checkpoints)})")
        path = Path(self.checkpoint_dir) / ckpt.step_dir_name(self.checkpoints[stage_step])
        if not (path / "meta.json").exists():
            raise ValueError(f"the checkpoint of stage {self.stage!r} step {stage_step} ({path}) "
                             "is gone (pruned: it was not the best when the next was written)")
        return path

    def select(self, stage_step: int, reason: str) -> None:
        self.selected = {"step": stage_step, "reason": reason}
        self._save()


def restore_weights(engine, path: Path) -> None:
    """The model, optimizer, scheduler and RNG state of checkpoint `path`, with the engine's
    step and version counters (and its stage bookkeeping) left where they are."""
    kept = {name: getattr(engine, name) for name in _KEPT}
    engine.load_checkpoint(path)
    for name, value in kept.items():
        setattr(engine, name, value)
    # The weights differ from the version's: the caller publishes them as a new one.
    engine.published_step = -1
