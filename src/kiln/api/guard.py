"""An RL stage's guard rails (`spec.stages[].eval.every`, `.select`, `.stopOnRegression`):
held-out evaluations inside the stage, the checkpoint it keeps, and when it stops. Torch-free.

The rules themselves (the score of an evaluation, the best step, the regression count) are
`kiln.control.guard`'s; the trainer's side (a checkpoint at every evaluated step, kept while it
is the best, and the restore) is `kiln.services.trainer.selection`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.components import Model

Metric = Literal["greedy_success", "sampled_success"]


class EvalScore(Model):
    """A held-out score: one figure of the stage's evaluations, over one or more task sets."""

    metric: Metric = "greedy_success"
    """The evaluation's figure: `greedy_success` or `sampled_success`."""
    task_sets: list[str] = Field(default_factory=list)
    """The task sets it is read on (each one of `eval.tasks`); empty: every one of them. With
    several, the score is the lowest of them: a stage that trains two skills is judged by the
    one it is worse at, so that neither can be given up for the other."""


class SelectSpec(EvalScore):
    """Which evaluated checkpoint the stage ends with."""

    mode: Literal["max"] = "max"
    """`max`: the highest score (on a tie, the later step)."""


class RegressionSpec(EvalScore):
    """When a stage gives up: its score fell well below its best and stayed there."""

    drop: float = Field(gt=0, le=1)
    """How far below the best score (of this metric, so far in the stage) counts as a fall."""
    patience: int = Field(1, ge=1)
    """Consecutive evaluations that must have fallen before the stage stops."""


def guard_problems(spec) -> list[str]:
    """Why a job's guard rails cannot run: on an SFT stage (whose weights reach rollout only at
    its end), naming a task set the stage does not evaluate, or selecting a checkpoint on a
    trainer with several data-parallel replicas (replica 0 alone keeps checkpoints)."""
    problems = []
    for i, stage in enumerate(spec.stages):
        ev, where = stage.eval, f"stages[{i}] ({stage.name}).eval"
        if ev is None or (ev.every is None and ev.select is None and ev.stop_on_regression is None):
            continue
        if stage.type == "sft":
            problems.append(f"{where}: every, select and stopOnRegression are for RL stages "
                            "(an SFT stage publishes its weights only at its end)")
            continue
        if ev.every is None:
            problems.append(f"{where}: select and stopOnRegression need `every` (the steps "
                            "between the evaluations they compare)")
        for name, rule in (("select", ev.select), ("stopOnRegression", ev.stop_on_regression)):
            unknown = [t for t in (rule.task_sets if rule else []) if t not in ev.tasks]
            if unknown:
                problems.append(f"{where}.{name}.taskSets: {unknown} not in eval.tasks {ev.tasks}")
        if (ev.select or ev.stop_on_regression) and spec.trainer.data_parallel > 1:
            problems.append(f"{where}: select and stopOnRegression need trainer.dataParallel 1 "
                            "(replica 0 alone keeps the checkpoints a rollback restores)")
    return problems
