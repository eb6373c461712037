"""Where a job is among its stages, in steps and held-out evaluations: what `kiln run`'s ETA
counts and what the stage driver tracks as `progress/<name>` (`kiln.metrics.PROGRESS`). Stages run in spec order, so
every stage after the running one is still to come. And where a held-out evaluation is, told
every few seconds while it runs (`evaluate_reporting`)."""
from __future__ import annotations

import threading
import time
from typing import Callable

from kiln.api.spec import RLJob
from kiln.control.records import Evaluation, RolloutControl
from kiln.metrics import PROGRESS


def steps_left(job: RLJob, stage: str, stage_step: int) -> int:
    """Optimizer steps left in the job while `stage` has taken `stage_step` of its steps."""
    names = [s.name for s in job.spec.stages]
    index = names.index(stage)
    return (max(0, job.spec.stages[index].max_steps - stage_step)
            + sum(s.max_steps for s in job.spec.stages[index + 1:]))


def evaluations_left(job: RLJob, stage: str, stage_step: int) -> list[str]:
    """The held-out evaluations still to come while `stage` has taken `stage_step` of its
    steps, one task-set name per evaluation: this stage's `eval.every` ones past the step and
    its "after" ones, then every later stage's ("before" when asked, `every`, "after")."""
    index = [s.name for s in job.spec.stages].index(stage)
    left: list[str] = []
    for offset, s in enumerate(job.spec.stages[index:]):
        ev = s.eval
        if ev is None or not ev.tasks:
            continue
        count = 1 + (offset > 0 and ev.before)
        if ev.every and s.type == "rl":
            # Held at the multiples of `every` before the last step (the "after" covers it).
            done = stage_step if offset == 0 else 0
            count += len(range((done // ev.every + 1) * ev.every, s.max_steps, ev.every))
        left += list(ev.tasks) * count
    return left


def progress_scalars(job: RLJob, stage: str, stage_step: int) -> dict[str, float]:
    """`progress/<name>` for a tracker."""
    values = {"stage_index": [s.name for s in job.spec.stages].index(stage),
              "stage_step": stage_step, "steps_left": steps_left(job, stage, stage_step)}
    return {f"progress/{name}": values[name] for name in PROGRESS}


EVAL_REPORT_SECONDS = 5.0
"""How often a held-out evaluation's progress is told while it runs."""


def evaluate_reporting(rollout: RolloutControl, task_set: str, *, samples: int,
                       say: Callable[[str], None], label: str,
                       transient: tuple[type[BaseException], ...] = (),
                       every: float = EVAL_REPORT_SECONDS) -> Evaluation:
    """Rollout's `evaluate(task_set)` (greedy and `samples` sampled attempts per task): says
    `label` as it starts, then every `every` seconds how many of its tasks are done (rollout's
    status), so that a long evaluation is not silence. Its errors are the call's; a status call
    that fails with a `transient` error skips that report."""
    result: list[Evaluation] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(rollout.evaluate(task_set, samples=samples, greedy=True))
        except BaseException as exc:  # handed to the caller's thread below
            error.append(exc)

    # A daemon thread: a Ctrl-C in the caller must not wait for the evaluation to end (the
    # services are stopped next, which ends the call).
    worker = threading.Thread(target=run, daemon=True, name=f"evaluate-{task_set}")
    say(label)
    start = time.monotonic()
    worker.start()
    while True:
        worker.join(every)
        if not worker.is_alive():
            break
        try:
            s = rollout.status()
        except transient:
            continue
        if s.eval_tasks:
            say(f"  {label}: {s.eval_tasks_done}/{s.eval_tasks} tasks done "
                f"({time.monotonic() - start:.0f} s)")
    if error:
        raise error[0]
    return result[0]
