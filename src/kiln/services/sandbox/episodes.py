"""Episodes: every environment of the job, played by rollout one action at a time.

An episode is a task, its environment and the sandbox its tool calls run in. `open` gives the
task's messages and tools; `step` takes what a model reply asked for (tool calls, a final
answer, or a reply that could not be read), runs the calls with the environment in the
episode's sandbox and returns their outputs, or ends the episode with the environment's grade
(and the task set's custom reward and reward rules, when it has them). The sandbox is
created, and the task set up in it, the first time the episode needs it: an episode that never calls a tool (or whose grade
reads no state) costs no sandbox. `demonstrate` plays the environment's scripted solution for
SFT, with its tool calls run for real unless the solver knows their outputs.

Task sets come from the job (`spec.tasks`, loaded by `task_sets.py`); a plugin (environment or
reward) runs in a confined worker process of its own (`plugins.py`), never in the service.

Not covered: gRPC (`env_servicer.py`), tokens and log-probs (rollout).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kiln.api.base import quantity_value
from kiln.api.spec import RLJob
from kiln.env import Grade, Task, ToolResult
from kiln.episode import Action, Demonstration, Turn, EpisodeInfo, Message, StepResult, ToolOutput
from kiln.services.common import metrics

from .config import BubblewrapConfig, DockerConfig, config_from_spec
from .factory import config_for, make_sandbox, reap_orphans
from .interface import Sandbox
from .latency import sleep_command
from .plugins import PluginEnvironment
from .rules import apply_rules
from .task_sets import EpisodeError, TaskSet, load_task_set

log = logging.getLogger(__name__)


class SubtaskRefused(EpisodeError):
    """The environment cannot make a sub-task of what the orchestrator assigned (its mistake,
    shown to it as an observation)."""


@dataclass
class _Episode:
    id: str
    task_set: TaskSet
    task: Task
    max_actions: int
    owner: str
    sandbox: Sandbox | None = None
    actions: int = 0
    invalid_replies: int = 0
    done: bool = False
    turns: list[Turn] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    subtasks: int = 0
    """Sub-tasks opened for this episode's subagents so far."""


class _LazySandbox:
    """The episode's sandbox, created and set up for the task on first use."""

    def __init__(self, manager: "EpisodeManager", ep: _Episode) -> None:
        self.manager, self.ep = manager, ep

    async def _get(self) -> Sandbox:
        if self.ep.sandbox is None:
            await self.manager._start_sandbox(self.ep)
        return self.ep.sandbox

    async def exec(self, cmd, **kwargs):
        sandbox = await self._get()
        async with self.manager._slots:
            result = await sandbox.exec(cmd, **kwargs)
        if result.timed_out or result.oom_killed:
            metrics.SANDBOX_FAILURES.labels(self.manager.config.type,
                                            "timeout" if result.timed_out else "oom").inc()
        return result

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await (await self._get()).read_file(path, max_bytes)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await (await self._get()).write_file(path, data, mode)


class EpisodeManager:
    def __init__(self, job: RLJob, *, base_dir: Path, owner: str = "env",
                 config: BubblewrapConfig | DockerConfig | None = None,
                 idle_ttl: float | None = None, room: asyncio.Semaphore | None = None,
                 room_timeout_s: float = 600.0, tasks_root: str | None = None) -> None:
        self.job = job
        self.room, self.room_timeout_s = room, room_timeout_s
        """`room`: the sandbox service's count of living sandboxes (its sessions' and these
        episodes' together: spec.sandbox.maxConcurrent bounds them all); each episode sandbox
        holds one unit from its start to its destruction."""
        self.config = config or config_from_spec(job.spec.sandbox, owner)
        reaped = reap_orphans(self.config)
        if reaped:
            log.info("reaped %d sandboxes left by a previous run", len(reaped))
        self.task_sets: dict[str, TaskSet] = {}
        try:
            for ts in job.spec.tasks:
                self.task_sets[ts.name] = load_task_set(
                    ts, base_dir, tasks_root, confine_plugins=True,
                    plugin_memory=int(quantity_value(job.spec.sandbox.plugin_memory)))
            # A task naming its own image runs only on the docker backend: refused at start.
            for ts in self.task_sets.values():
                for task in ts.tasks:
                    try:
                        config_for(self.config, task.image, f"task set {ts.name!r}, task {task.id!r}")
                    except ValueError as exc:
                        raise EpisodeError(str(exc)) from None
        except BaseException:
            self.close_plugins()
            raise
        self.default_max_actions = job.spec.rollout.max_turns
        # An episode outlives its deadline plus grading; after that its sandbox is reclaimed.
        self.idle_ttl = idle_ttl or job.spec.rollout.episode_timeout_seconds + 60
        self._episodes: dict[str, _Episode] = {}
        self._slots = asyncio.Semaphore(job.spec.sandbox.max_concurrent)

    def task_set_sizes(self) -> dict[str, tuple[str, int]]:
        """Task set name -> (environment, number of tasks)."""
        return {name: (ts.env_name, len(ts.tasks)) for name, ts in self.task_sets.items()}

    def task(self, task_set: str, index: int) -> Task:
        return self._lookup(task_set, index)[1]

    def _lookup(self, task_set: str, index: int) -> tuple[TaskSet, Task]:
        ts = self.task_sets.get(task_set)
        if ts is None:
            raise EpisodeError(f"task set {task_set!r} is not served (known: {sorted(self.task_sets)})")
        if not 0 <= index < len(ts.tasks):
            raise EpisodeError(f"task set {task_set!r} has {len(ts.tasks)} tasks; index {index} is out of range")
        return ts, ts.tasks[index]

    def _opening(self, ts: TaskSet, task: Task) -> tuple[list[Message], list]:
        env = ts.environment
        system = env.system_prompt(task)
        messages = ([Message("system", system)] if system else []) + [
            Message("user", env.user_prompt(task))]
        return messages, env.tools(task)

    def open(self, task_set: str, index: int, *, owner: str = "", max_actions: int = 0) -> EpisodeInfo:
        ts, task = self._lookup(task_set, index)
        eid = uuid.uuid4().hex
        self._episodes[eid] = _Episode(eid, ts, task, max_actions or self.default_max_actions, owner)
        messages, tools = self._opening(ts, task)
        return EpisodeInfo(eid, task.id, ts.env_name, messages, tools)

    async def open_subtask(self, parent_episode_id: str, role: str, instructions: str, task: str,
                           *, owner: str = "", max_actions: int = 0) -> EpisodeInfo:
        """A subagent's episode (agent swarms): the environment's sub-task of the parent
        episode's task for the text assigned, in its own sandbox, graded by the sub-task's own
        verifier (the task set's custom reward and rules are the orchestrator's, not its)."""
        parent = self._episodes.get(parent_episode_id)
        if parent is None:
            raise EpisodeError(f"episode {parent_episode_id!r} does not exist (closed or expired)")
        ts = parent.task_set
        try:
            if isinstance(ts.environment, PluginEnvironment):
                sub = await ts.environment.subtask_async(parent.task, role, instructions, task,
                                                         index=parent.subtasks)
            else:
                sub = ts.environment.subtask(parent.task, role, instructions, task,
                                             index=parent.subtasks)
        except NotImplementedError as exc:
            raise EpisodeError(f"environment {ts.env_name!r}: {exc}") from None
        except ValueError as exc:
            raise SubtaskRefused(str(exc)) from None
        parent.subtasks += 1
        sub_ts = dataclasses.replace(ts, reward_fn=None, rules=None, latency=None)
        eid = uuid.uuid4().hex
        self._episodes[eid] = _Episode(eid, sub_ts, sub, max_actions or self.default_max_actions,
                                       owner)
        messages, tools = self._opening(sub_ts, sub)
        return EpisodeInfo(eid, sub.id, ts.env_name, messages, tools)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        ep = self._episodes.get(episode_id)
        if ep is None:
            raise EpisodeError(f"episode {episode_id!r} does not exist (closed or expired)")
        if ep.done:
            raise EpisodeError(f"episode {episode_id!r} has already ended")
        ep.last_used = time.monotonic()
        ep.actions += 1
        env, sandbox = ep.task_set.environment, _LazySandbox(self, ep)
        turn = Turn(action.content, list(action.tool_calls))
        ep.turns.append(turn)
        if action.unparseable:
            ep.invalid_replies += 1
            if getattr(env, "end_on_invalid_action", False):
                return await self._finish(ep, None, ["invalid_action"], note=action.problem)
            turn.outputs = [ToolOutput("", "", f"error: {action.problem}")]
        elif not action.tool_calls:
            return await self._finish(ep, action.content, [])
        for call in action.tool_calls:
            try:
                result = await env.call_tool(sandbox, ep.task, call)
            except Exception as exc:  # a plugin's bug must not take the service down
                log.exception("tool %s of %s failed", call.name, ep.task_set.env_name)
                result = ToolResult(f"error: the tool failed: {type(exc).__name__}: {exc}")
            turn.outputs.append(ToolOutput(call.id, call.name, result.output))
            if ep.task_set.latency is not None:
                seconds = ep.task_set.latency.draw()
                await sandbox.exec(sleep_command(seconds), timeout=seconds + 30)
            if result.done:
                return await self._finish(ep, result.answer, [])
        if ep.actions >= ep.max_actions:
            return await self._finish(ep, None, ["max_actions"])
        return StepResult(outputs=list(turn.outputs))

    async def _start_sandbox(self, ep: _Episode) -> None:
        if self.room is not None:
            try:
                await asyncio.wait_for(self.room.acquire(), self.room_timeout_s)
            except asyncio.TimeoutError:
                raise EpisodeError(f"every sandbox of this service is in use for "
                                   f"{self.room_timeout_s:g} s (spec.sandbox.maxConcurrent)") from None
        async with self._slots:
            start = time.perf_counter()
            sandbox = make_sandbox(config_for(self.config, ep.task.image))
            try:
                await sandbox.start()
            except Exception:
                metrics.SANDBOX_FAILURES.labels(self.config.type, "start").inc()
                await sandbox.destroy()
                if self.room is not None:
                    self.room.release()
                raise
            metrics.SANDBOX_START_SECONDS.labels(self.config.type).observe(time.perf_counter() - start)
            metrics.SANDBOX_ACTIVE.labels(self.config.type).inc()
        ep.sandbox = sandbox
        await ep.task_set.environment.setup(sandbox, ep.task)

    async def _finish(self, ep: _Episode, answer: str | None, flags: list[str],
                      note: str = "") -> StepResult:
        ep.done = True
        grade = await self._grade(ep.task_set, ep.task, _LazySandbox(self, ep), answer, ep.turns)
        if ep.task_set.rules is not None:
            well_formed = answer is not None and not ep.invalid_replies and "max_actions" not in flags
            # Off the event loop: a regex rule may take up to its time limit.
            grade = await asyncio.to_thread(apply_rules, ep.task_set.rules, grade, answer,
                                            well_formed)
        output = f"{note}; {grade.output}" if note else grade.output
        reference = ep.task_set.environment.reference(ep.task) or ""
        return StepResult(done=True, reward=grade.reward, reward_parts=grade.parts,
                          verifier_output=output, flags=flags + grade.flags,
                          answer=answer or "", reference=reference)

    async def _grade(self, ts: TaskSet, task: Task, sandbox, answer: str | None,
                     transcript: list[Turn]) -> Grade:
        grade = await ts.environment.grade(sandbox, task, answer)
        if ts.reward_fn is None:
            return grade
        custom = ts.reward_fn(task, grade, transcript)
        if asyncio.iscoroutine(custom):
            custom = await custom
        if isinstance(custom, Grade):
            return Grade(custom.reward, {**grade.parts, **custom.parts, "verifier": grade.reward},
                         custom.output or grade.output, grade.flags + custom.flags)
        return Grade(float(custom), {**grade.parts, "verifier": grade.reward}, grade.output,
                     grade.flags)

    async def close(self, episode_id: str) -> None:
        ep = self._episodes.pop(episode_id, None)
        if ep is not None and ep.sandbox is not None:
            await self._destroy(ep)

    async def _destroy(self, ep: _Episode) -> None:
        try:
            await ep.sandbox.destroy()
        finally:
            ep.sandbox = None
            metrics.SANDBOX_ACTIVE.labels(self.config.type).dec()
            if self.room is not None:
                self.room.release()

    async def reap_idle(self) -> int:
        now = time.monotonic()
        stale = [eid for eid, ep in self._episodes.items() if now - ep.last_used > self.idle_ttl]
        for eid in stale:
            await self.close(eid)
        return len(stale)

    async def close_all(self) -> None:
        for eid in list(self._episodes):
            await self.close(eid)

    def close_plugins(self) -> None:
        """Stop the task sets' plugin workers (at the service's end)."""
        for ts in self.task_sets.values():
            if ts.worker is not None:
                ts.worker.close()

    async def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration:
        """The environment's scripted solution of a task, played for real. EpisodeError if the
        environment has no solver."""
        ts, task = self._lookup(task_set, index)
        plugin = isinstance(ts.environment, PluginEnvironment)
        solution = (await ts.environment.demonstrate_async(task, seed) if plugin else
                    ts.environment.demonstrate(task, random.Random(seed)))
        if solution is None:
            raise EpisodeError(f"task set {task_set!r}: environment {ts.env_name} has no scripted "
                               "solver (or this task no reference solution) to demonstrate")
        ep = _Episode(uuid.uuid4().hex, ts, task, len(solution) + 1, "demonstration")
        sandbox = _LazySandbox(self, ep)
        answer = None
        known = (await ts.environment.grade_demonstration_async(task, solution) if plugin else
                 ts.environment.grade_demonstration(task, solution))
        try:
            for step in solution:
                turn = Turn(step.content, list(step.tool_calls))
                ep.turns.append(turn)
                if not step.tool_calls:
                    answer = step.content
                    break
                for i, call in enumerate(step.tool_calls):
                    if step.outputs is not None:
                        result = ToolResult(step.outputs[i])
                    else:
                        result = await ts.environment.call_tool(sandbox, task, call)
                    turn.outputs.append(ToolOutput(call.id, call.name, result.output))
                    if result.done:
                        answer = result.answer
            grade = known if known is not None else await self._grade(ts, task, sandbox, answer, ep.turns)
        finally:
            if ep.sandbox is not None:
                await self._destroy(ep)
        messages, tools = self._opening(ts, task)
        return Demonstration(task.id, messages, tools, ep.turns, grade.reward, grade.output)
