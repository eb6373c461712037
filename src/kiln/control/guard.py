"""The guard rails' rules for one RL stage (`eval.every`, `eval.select`, `eval.stopOnRegression`,
declared in `kiln.api.guard`): the score of an evaluation, the best evaluated step, and when a
regression ends the stage. Pure: the stage driver feeds it the held-out evaluations in step
order and acts on what it says (`kiln.control.driver`); the trainer keeps and restores the
checkpoints (`kiln.services.trainer.selection`).

An evaluated step is one whose weights the trainer checkpointed: step 0 (the stage's "before"
evaluation, when it runs), every `every` steps, and the stage's last step (its current weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.api.guard import EvalScore
from kiln.api.spec import EvalSpec


def score(rule: EvalScore, evaluations: dict[str, dict[str, Any]], tasks: list[str]) -> float:
    """`rule`'s figure of one step's evaluations ({task set: Evaluation as a dict}): the lowest
    over its task sets (every one of `tasks` unless it names some)."""
    return min(float(evaluations[t][rule.metric]) for t in (rule.task_sets or tasks))


def describe(rule: EvalScore, tasks: list[str]) -> str:
    sets = rule.task_sets or tasks
    return rule.metric + (f" of {sets[0]}" if len(sets) == 1 else f" (lowest of {', '.join(sets)})")


@dataclass
class Selection:
    step: int
    """The stage step whose weights the stage ends with."""
    reason: str
    stopped: bool = False
    """Ended early by `stopOnRegression`."""

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason, "stopped": self.stopped}


@dataclass
class Guard:
    spec: EvalSpec
    points: list[tuple[int, dict[str, dict[str, Any]]]] = field(default_factory=list)
    """(stage step, {task set: evaluation}) in step order."""
    stop: Selection | None = None
    """Set once a regression ended the stage."""

    @classmethod
    def of(cls, stage) -> Guard | None:
        """The stage's guard, if it evaluates inside itself (`eval.every`)."""
        ev = getattr(stage, "eval", None)
        return cls(ev) if ev is not None and ev.every else None

    @property
    def selects(self) -> bool:
        """Whether the stage may end on a checkpoint other than its last step."""
        return self.spec.select is not None or self.spec.stop_on_regression is not None

    @property
    def _rule(self) -> EvalScore:
        return self.spec.select or self.spec.stop_on_regression

    def best(self) -> tuple[int, float] | None:
        """(step, score) of the best evaluated step so far by `select` (else by the
        regression rule's metric); the later one on a tie."""
        if not self.selects or not self.points:
            return None
        scored = [(score(self._rule, ev, self.spec.tasks), step) for step, ev in self.points]
        value, step = max(scored)
        return step, value

    def observe(self, step: int, evaluations: dict[str, dict[str, Any]]) -> Selection | None:
        """Add a step's evaluations; a `Selection` (stopped) when the regression rule ends the
        stage at it, rolled back to the best step."""
        self.points.append((step, evaluations))
        rule = self.spec.stop_on_regression
        if rule is None or self.stop is not None:
            return self.stop
        values = [(s, score(rule, ev, self.spec.tasks)) for s, ev in self.points]
        fallen: list[tuple[int, float]] = []
        peak_step, peak = values[0]
        for s, v in values:
            if v > peak:
                peak_step, peak = s, v
            if v < peak - rule.drop:
                fallen.append((s, v))
            else:
                fallen = []
        if len(fallen) < rule.patience:
            return None
        best_step, best_value = self.best()
        what = describe(rule, self.spec.tasks)
        falls = ", ".join(f"{v:.3f} at step {s}" for s, v in fallen)
        self.stop = Selection(
            best_step, f"stopped on regression: {what} fell more than {rule.drop:g} below its best "
            f"{peak:.3f} (step {peak_step}) for {len(fallen)} evaluations ({falls}); rolled back to "
            f"step {best_step} ({describe(self._rule, self.spec.tasks)} {best_value:.3f})", True)
        return self.stop

    def selection(self) -> Selection | None:
        """What the stage ends with once it has run to its end (or stopped): the best step and
        why; None for a stage that only evaluates (`every` without select or a rule)."""
        if self.stop is not None:
            return self.stop
        best = self.best()
        if best is None:
            return None
        step, value = best
        last = self.points[-1][0]
        what = describe(self._rule, self.spec.tasks)
        if step == last:
            return Selection(step, f"the last step has the best {what}: {value:.3f}")
        return Selection(step, f"highest {what}: {value:.3f} at step {step}, against "
                               f"{score(self._rule, self.points[-1][1], self.spec.tasks):.3f} "
                               f"at the last step ({last})")
