"""Running one task end to end in a fresh sandbox: set-up, an agent's (or a reference)
solution, verification. Used by `kiln sandbox verify` and by tests; knows nothing of gRPC.

Not covered: the agent loop (the rollout service drives `setup`/tools/`verify` itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import BubblewrapConfig, DockerConfig
from kiln.env import Grade, Task
from .environments.tasks import load_taskset, make_environment
from .factory import config_for, make_sandbox


@dataclass
class TaskOutcome:
    task_id: str
    result: Grade | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.reward == 1.0 and self.error is None


async def run_solution(config: BubblewrapConfig | DockerConfig, task: Task, base_dir: Path,
                       solution: bytes | None) -> Grade:
    """Set the task up, play `solution` (None: nothing, as an agent that gave up), verify."""
    env = make_environment(task.type, base_dir)
    sandbox = make_sandbox(config_for(config, task.image, f"task {task.id}"))
    async with sandbox:
        await env.setup(sandbox, task)
        answer = None
        if solution is not None:
            answer = await env.apply_solution(sandbox, task, solution)
        return await env.grade(sandbox, task, answer)


async def verify_taskset(config: BubblewrapConfig | DockerConfig, taskset: Path,
                         solutions: Path, null_fails: bool = False) -> list[TaskOutcome]:
    """Each task's reference solution graded; with `null_fails` the task is also played with no
    solution at all, which must not pass (else the verifier checks nothing the agent does)."""
    tasks = load_taskset(taskset)
    outcomes = []
    for task in tasks:
        env = make_environment(task.type, taskset.parent)
        path = solutions / env.solution_name.format(id=task.id)
        if not path.is_file():
            outcomes.append(TaskOutcome(task.id, None, f"no reference solution at {path}"))
            continue
        try:
            result = await run_solution(config, task, taskset.parent.resolve(), path.read_bytes())
        except (RuntimeError, OSError, ValueError) as exc:
            outcomes.append(TaskOutcome(task.id, None, str(exc)))
            continue
        if null_fails and result.reward == 1.0:
            try:
                null = await run_solution(config, task, taskset.parent.resolve(), None)
            except (RuntimeError, OSError, ValueError) as exc:
                outcomes.append(TaskOutcome(task.id, result, f"the null run failed: {exc}"))
                continue
            if null.reward == 1.0:
                outcomes.append(TaskOutcome(task.id, result, "passes with no solution applied"))
                continue
        outcomes.append(TaskOutcome(task.id, result))
    return outcomes
