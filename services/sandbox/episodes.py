"""Episodes: the environment side of the agent loop, as the rollout service sees it.

An episode is a task plus the sandbox its tool calls run in. The rollout service sends each
action text the model produced; `EpisodeManager.step` parses it with the environment's protocol,
runs the tool call in the episode's sandbox (created on the first call, destroyed when the
episode closes) and returns the observation text, or ends the episode with the verifier's reward.
Task sets come from the job (`spec.tasks`): generated (`generate`) or read from JSONL (`path`).

Episodes are served for the `chain` environment; the terminal, swe, search and code environments
have verifiers (`environments/`) and are used through `kiln sandbox verify`, but their
multi-turn tool protocols are not served as episodes yet (OpenEpisode says so).

Not covered: gRPC (`env_servicer.py`), tokens and log-probs (the rollout service).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kiln.api.spec import RLJob, TaskSetSpec
from kiln.episode import Demonstration, EpisodeInfo, StepResult
from kiln.services.common import metrics

from .config import BubblewrapConfig, DockerConfig, config_from_spec
from .environments import chain
from .factory import make_sandbox, reap_orphans
from .interface import Sandbox

log = logging.getLogger(__name__)


# The expert's blind spot fires on 3 of 4 trailing-zero copies: imitation still learns the
# mistake (greedy decoding makes it), but sampling sometimes copies right, which is what RL
# needs to discover the fix. At 1.0 the SFT model never samples a correct copy.
DEMONSTRATION_MISTAKE_RATE = 0.75


class EpisodeError(ValueError):
    """The request names something that does not exist or is not supported; do not retry."""


@dataclass
class _Episode:
    id: str
    task: chain.ChainTask
    max_actions: int
    owner: str
    sandbox: Sandbox | None = None
    actions: int = 0
    done: bool = False
    last_used: float = field(default_factory=time.monotonic)


def load_task_set(spec: TaskSetSpec, base_dir: Path) -> list[chain.ChainTask]:
    if spec.env != "chain":
        raise EpisodeError(
            f"spec.tasks[{spec.name}]: env {spec.env!r} is verified by `kiln sandbox verify` but "
            "not yet served as episodes; only 'chain' is")
    if spec.generate is not None:
        gen = spec.generate
        try:
            sampler = None if gen.length_tail is None else chain.ZipfRepeats(gen.num_steps, gen.length_tail)
            return chain.generate_tasks(gen.count, gen.seed, split=gen.split, num_steps=gen.num_steps,
                                        sample_repeats=sampler)
        except ValueError as exc:
            # A setting the environment cannot hold; retrying will not help.
            raise EpisodeError(f"spec.tasks[{spec.name}].generate: {exc}") from exc
    path = Path(spec.path)
    return chain.read_tasks(path if path.is_absolute() else base_dir / path)


class EpisodeManager:
    def __init__(self, job: RLJob, *, base_dir: Path, owner: str = "env",
                 config: BubblewrapConfig | DockerConfig | None = None,
                 idle_ttl: float | None = None) -> None:
        self.job = job
        self.config = config or config_from_spec(job.spec.sandbox, owner)
        reaped = reap_orphans(self.config)
        if reaped:
            log.info("reaped %d sandboxes left by a previous run", len(reaped))
        self.task_sets: dict[str, tuple[str, list[chain.ChainTask]]] = {}
        for ts in job.spec.tasks:
            if ts.env == "chain":
                self.task_sets[ts.name] = (ts.env, load_task_set(ts, base_dir))
        self.default_max_actions = job.spec.rollout.max_turns
        # An episode outlives its deadline plus grading; after that its sandbox is reclaimed.
        self.idle_ttl = idle_ttl or job.spec.rollout.episode_timeout_seconds + 60
        self._episodes: dict[str, _Episode] = {}
        self._slots = asyncio.Semaphore(job.spec.sandbox.max_concurrent)

    def task(self, task_set: str, index: int) -> chain.ChainTask:
        if task_set not in self.task_sets:
            raise EpisodeError(f"task set {task_set!r} is not served (known: {sorted(self.task_sets)})")
        tasks = self.task_sets[task_set][1]
        if not 0 <= index < len(tasks):
            raise EpisodeError(f"task set {task_set!r} has {len(tasks)} tasks; index {index} is out of range")
        return tasks[index]

    def task_set_sizes(self) -> dict[str, tuple[str, int]]:
        """Task set name -> (environment type, number of tasks)."""
        return {name: (env, len(tasks)) for name, (env, tasks) in self.task_sets.items()}

    def open(self, task_set: str, index: int, *, owner: str = "", max_actions: int = 0) -> EpisodeInfo:
        task = self.task(task_set, index)
        eid = uuid.uuid4().hex
        self._episodes[eid] = _Episode(eid, task, max_actions or self.default_max_actions, owner)
        return EpisodeInfo(eid, task.id, "chain", task.prompt, list(chain.STOP_TAGS))

    async def step(self, episode_id: str, action: str) -> StepResult:
        ep = self._episodes.get(episode_id)
        if ep is None:
            raise EpisodeError(f"episode {episode_id!r} does not exist (closed or expired)")
        if ep.done:
            raise EpisodeError(f"episode {episode_id!r} has already ended")
        ep.last_used = time.monotonic()
        ep.actions += 1
        parsed = chain.parse_action(action)
        if isinstance(parsed, chain.Answer):
            return self._finish(ep, parsed.value, [])
        if isinstance(parsed, chain.Invalid):
            out = self._finish(ep, None, ["invalid_action"])
            out.verifier_output = parsed.reason
            return out
        if ep.actions >= ep.max_actions:
            return self._finish(ep, None, ["max_actions"])
        observation = await self._run_tool(ep, chain.tool_call(ep.task, parsed))
        return StepResult(observation=observation)

    async def _run_tool(self, ep: _Episode, call: chain.Call) -> str:
        async with self._slots:
            if ep.sandbox is None:
                start = time.perf_counter()
                ep.sandbox = make_sandbox(self.config)
                try:
                    await ep.sandbox.start()
                except Exception:
                    metrics.SANDBOX_FAILURES.labels(self.config.type, "start").inc()
                    ep.sandbox = None
                    raise
                metrics.SANDBOX_START_SECONDS.labels(self.config.type).observe(time.perf_counter() - start)
                metrics.SANDBOX_ACTIVE.labels(self.config.type).inc()
            result = await ep.sandbox.exec(chain.tool_command(call))
        if result.timed_out or result.oom_killed:
            metrics.SANDBOX_FAILURES.labels(self.config.type, "timeout" if result.timed_out else "oom").inc()
        return chain.format_observation(result.stdout, result.exit_code)

    def _finish(self, ep: _Episode, answer: str | None, flags: list[str]) -> StepResult:
        ep.done = True
        reward, parts, output = chain.verify(ep.task, answer)
        return StepResult(done=True, reward=reward, reward_parts=parts, verifier_output=output, flags=flags)

    async def close(self, episode_id: str) -> None:
        ep = self._episodes.pop(episode_id, None)
        if ep is not None and ep.sandbox is not None:
            await ep.sandbox.destroy()
            metrics.SANDBOX_ACTIVE.labels(self.config.type).dec()

    async def reap_idle(self) -> int:
        now = time.monotonic()
        stale = [eid for eid, ep in self._episodes.items() if now - ep.last_used > self.idle_ttl]
        for eid in stale:
            await self.close(eid)
        return len(stale)

    async def close_all(self) -> None:
        for eid in list(self._episodes):
            await self.close(eid)

    def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration:
        """The scripted solver's episode of a task."""
        task = self.task(task_set, index)
        turns = chain.scripted_solver(task, random.Random(seed), mistake_rate=DEMONSTRATION_MISTAKE_RATE)
        reward, _, output = chain.verify(task, chain.final_answer(turns))
        return Demonstration(task.id, chain.render(task, turns), reward, output)
