"""Keeps episodes in flight and ships finished trajectories to the buffer.

Modes (set by the stage driver through the Rollout RPC):
- DEMONSTRATE (SFT stages): the environment's scripted solver acts; one trajectory per task.
- EXPLORE (RL stages): the policy acts; G episodes of the same task form a group, shipped
  together (the buffer serves groups whole; the trainer takes their advantages).
- IDLE: nothing new starts; episodes in flight finish and are shipped.

Asynchronous RL keeps up to `maxConcurrentEpisodes` episodes running whatever the trainer does;
weights change underneath them and every token records its version (a partial rollout: an
episode goes on across weight updates). With `targetEngineOccupancy` a new group starts only
while fewer episodes than that occupy the engine (`occupancy.py`: an episode does unless its
environment is stepping), so episodes waiting on slow tools leave room and enough of them are
in flight to keep the engine busy. An episode whose group's oldest token falls more than the
stage's tau behind the engine's version is stopped before its next generation, with its whole
group (the buffer would drop the group on arrival; finishing it only costs the engine). An
order with `min_version` starts nothing before the engine serves that version (a replica
that just joined). Synchronous RL (`async:
false`) produces exactly one batch per policy version and waits for the next version before
starting another, so the trainer and rollout take turns.

A stage's episodes are the agent's (`agent.run_episode`), or its episode extension's
(`extensions.py`) where it has one: the producer knows features only through that interface.
It is built from a `ProducerConfig` (what it does) and its collaborators (engine, environment,
format, buffer, teachers, reward models, extensions).

Also `evaluate`: greedy and sampled success on a task set at the current version.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from kiln.freshness import is_stale
from kiln.episode import Demonstration
from kiln.evaluation import TaskCount
from kiln.services.buffer.client import BufferClient
from kiln.services.common import metrics
from kiln.services.rollout.agent import EpisodeStale, Limits, demonstration_trajectory, run_episode
from kiln.services.rollout.engine import Engine, SamplingOptions
from kiln.services.rollout.extensions import EpisodeContext, EpisodeExtension, Outcome, plain_outcome
from kiln.services.rollout.formats import Format
from kiln.services.rollout.occupancy import EngineTimer, EnvTimer, Occupancy
from kiln.services.rollout.reward_models import RewardModels
from kiln.services.rollout.samples import Samples
from kiln.services.rollout.teachers import Scorer, add_teacher_logprobs
from kiln.control.records import ModeRequest, RolloutMode
from kiln.services.sandbox.client import EnvClient
from kiln.trajectory import Trajectory

log = logging.getLogger(__name__)

IDLE, DEMONSTRATE, EXPLORE = RolloutMode.IDLE, RolloutMode.DEMONSTRATE, RolloutMode.EXPLORE


@dataclass
class Mode:
    """What the producer is doing: a `ModeRequest` with the task sets' sizes resolved."""

    mode: RolloutMode = IDLE
    stage: str = ""
    task_sets: list[tuple[str, int]] = field(default_factory=list)
    """(name, size) of the task sets to draw from."""
    group_size: int = 1
    synchronous: bool = False
    batch_size: int = 0
    seed: int = 0
    tau: int | None = None
    min_version: int = 0

    @classmethod
    def of(cls, request: ModeRequest, sizes: dict[str, int]) -> "Mode":
        return cls(request.mode, request.stage, [(t, sizes[t]) for t in request.task_sets],
                   max(1, request.group_size), request.synchronous, request.batch_size,
                   request.seed, request.tau, request.min_version)


@dataclass(frozen=True)
class ProducerConfig:
    """What the producer does, from the job's rollout and stage settings (`main.build`)."""

    sampling: SamplingOptions
    limits: Limits
    max_concurrent: int
    """At most this many episodes at once (`rollout.maxConcurrentEpisodes`)."""
    target_occupancy: int | None = None
    """`rollout.targetEngineOccupancy` (see the module doc); None: no such bound."""
    samples_path: Path | None = None
    """Where sampled trajectories are kept for reading (`samples.py`); None: nowhere."""
    sample_every: int = 10
    stream: str = ""
    """Which replica's task stream this is ("" for the first): replicas of one job draw
    different tasks from the same seed."""
    opd_stages: frozenset[str] = frozenset()
    """Stages whose trajectories a frozen model scores: on-policy distillation's teacher, or a
    KL-penalised stage's reference (its per-token log-probs go on each trajectory, for the
    trainer's advantage or penalty)."""
    teacher_top_k: Mapping[str, int] = field(default_factory=dict)
    """Stage -> k of its dense distillation (`rl.teacherTopK`; the Scorer's `topk`)."""


class Producer:
    def __init__(self, config: ProducerConfig, engine: Engine, env: EnvClient, fmt: Format,
                 buffer: BufferClient, *, teachers: dict[tuple[str, str], Scorer] | None = None,
                 reward_models: dict[str, RewardModels] | None = None,
                 extensions: dict[str, EpisodeExtension] | None = None) -> None:
        self.config = config
        self.occupancy = Occupancy()
        self.engine, self.env = EngineTimer(engine), EnvTimer(env, self.occupancy)
        self.fmt, self.buffer = fmt, buffer
        self.teachers = teachers or {}
        """(stage, task set) -> the frozen model that scores trajectories of the `opd_stages`."""
        self.reward_models = reward_models or {}
        """Task set -> its outcome model and judge: they rescore its RL episodes."""
        self.extensions = extensions or {}
        """Stage -> the extension that plays its episodes (`extensions.py`)."""
        self._stage_start: dict[str, int] = {}
        self.mode = Mode()
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._tasks: set[asyncio.Task] = set()
        self.episodes = 0
        self.shipped = 0
        """Trajectories whose Put the buffer acknowledged."""
        self.tokens = 0
        self.in_flight = 0
        self.stopped_stale = 0
        """Episodes stopped early because their group could no longer be trained."""
        self.teacher_seconds = 0.0
        self.teacher_tokens = 0
        """Time waited for, and tokens of, teachers' scores: the cost of distillation."""
        self.eval_progress = (0, 0)  # (tasks done, tasks) of the evaluation running; 0s: none
        self.recent_rewards: collections.deque[float] = collections.deque(maxlen=256)
        self._token_times: collections.deque[tuple[float, int]] = collections.deque(maxlen=512)
        self._main: asyncio.Task | None = None
        self.samples = Samples(config.samples_path, config.sample_every)
        self._demos: dict[tuple[str, int], Demonstration] = {}

    # ---------------------------------------------------------------- control
    def start(self) -> None:
        self._main = asyncio.ensure_future(self._run())
        self._flusher = asyncio.ensure_future(self._flush_idle())

    async def _flush_idle(self) -> None:
        while True:  # the idle counter advances while the engine is idle, not only after
            self.engine.flush_idle()
            await asyncio.sleep(1.0)

    def set_mode(self, mode: Mode) -> None:
        if mode.stage != self.mode.stage and mode.mode != IDLE:
            self.recent_rewards.clear()  # the pass rate shown is this stage's, not the last one's
            self._stage_start.setdefault(mode.stage, self.engine.policy_version)
        self.mode = mode
        self._changed.set()

    async def drain(self, seconds: float) -> None:
        """Start nothing new and give the episodes in flight up to `seconds` to finish and
        ship (a replica scaled away); those that outlive their tau stop on their own."""
        self.set_mode(Mode())
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self.set_mode(Mode())
        if self._main:
            self._main.cancel()
            self._flusher.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def tokens_per_second(self) -> float:
        if len(self._token_times) < 2:
            return 0.0
        (t0, _), (t1, _) = self._token_times[0], self._token_times[-1]
        n = sum(k for _, k in list(self._token_times)[1:])
        return n / (t1 - t0) if t1 > t0 else 0.0

    # ---------------------------------------------------------------- loop
    async def _run(self) -> None:
        rng_mode, rng = None, random.Random()
        while True:
            mode = self.mode
            if mode.mode == IDLE or not mode.task_sets:
                self._changed.clear()
                await self._changed.wait()
                continue
            if rng_mode is not mode:
                # One task stream per stage, reproducible from the job's seed.
                stream = self.config.stream
                rng_mode, rng = mode, random.Random(
                    f"{mode.seed}/{mode.stage}" + (f"/{stream}" if stream else ""))
            if self.engine.policy_version < mode.min_version:
                # Just joined (or restarted): no episode on weights older than the trainer's.
                await asyncio.sleep(0.05)
                continue
            if mode.synchronous and mode.mode == EXPLORE:
                await self._one_synchronous_batch(mode, rng)
                continue
            group = mode.group_size if mode.mode == EXPLORE else 1
            # Hold a slot per episode of the group before starting it, so at most
            # max_concurrent episodes run at once.
            for _ in range(group):
                await self._slots.acquire()
            if self.config.target_occupancy and mode.mode == EXPLORE:
                await self.occupancy.below(self.config.target_occupancy)
            if self.mode is not mode:
                for _ in range(group):
                    self._slots.release()
                continue
            name, size = rng.choice(mode.task_sets)
            self.occupancy.admit(group)
            task = asyncio.ensure_future(self._group(mode, name, rng.randrange(size), group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one_synchronous_batch(self, mode: Mode, rng: random.Random) -> None:
        """Ship one full batch at the current version, then wait for the next version. Groups
        that fail (an episode error) are replaced, or the trainer would wait forever."""
        version = self.engine.policy_version
        start = self.shipped
        while self.shipped - start < mode.batch_size and self.mode is mode:
            missing = mode.batch_size - (self.shipped - start)
            jobs = []
            for _ in range(-(-missing // mode.group_size)):
                for _ in range(mode.group_size):
                    await self._slots.acquire()
                if self.config.target_occupancy:
                    await self.occupancy.below(self.config.target_occupancy)
                name, size = rng.choice(mode.task_sets)
                self.occupancy.admit(mode.group_size)
                jobs.append(asyncio.ensure_future(
                    self._group(mode, name, rng.randrange(size), mode.group_size)))
            await asyncio.gather(*jobs, return_exceptions=True)
        # Rollout pauses until the trainer has trained on this batch and published.
        while self.engine.policy_version <= version and self.mode is mode:
            await asyncio.sleep(0.05)

    async def _group(self, mode: Mode, task_set: str, index: int, group: int) -> None:
        self.in_flight += group
        playing = [group]  # members that have not finished: they occupy the engine

        async def member(**kwargs):
            try:
                return await self._episode(mode.stage, rescore=True, **kwargs)
            finally:
                playing[0] -= 1
                self.occupancy.finish(1)
        try:
            gid = uuid.uuid4().hex
            if mode.mode == DEMONSTRATE:
                # One fixed demonstration per task (its seed is the task's index): SFT then sees
                # a finite pool it revisits, which a tiny model learns from far faster than
                # from a stream of ever-new demonstrations.
                demo = await self._demonstration(task_set, index)
                trajs = [demonstration_trajectory(demo, self.fmt, version=self.engine.policy_version,
                                                  group_id=gid)]
            else:
                stale = self._staleness_check(mode)
                results = await asyncio.gather(*[
                    member(task_set=task_set, index=index, sampling=self.config.sampling,
                           limits=self.config.limits, group_id=gid, stale=stale)
                    for _ in range(group)], return_exceptions=True)
                trajs = [t for r in results if isinstance(r, list) for t in r]
                errors = [r for r in results if not isinstance(r, list)]
                if any(isinstance(r, EpisodeStale) for r in errors):
                    # Stopped (and the members that finished first) for freshness, not failed.
                    metrics.EPISODES.labels("stale").inc(group)
                    self.stopped_stale += group
                    return
                for err in errors:
                    metrics.EPISODES.labels("error").inc()
                    log.warning("episode of %s[%d] failed: %r", task_set, index, err)
                if errors:
                    return  # a partial group would bias the group-relative baseline
                if mode.stage in self.config.opd_stages:
                    seconds, tokens = await add_teacher_logprobs(
                        trajs, self.teachers.get((mode.stage, task_set)),
                        self.config.teacher_top_k.get(mode.stage, 0))
                    self.teacher_seconds += seconds
                    self.teacher_tokens += tokens
            for t in trajs:
                n = sum(t.loss_mask)
                self.tokens += n
                self._token_times.append((time.monotonic(), n))
                metrics.ROLLOUT_TOKENS.inc(n)
                metrics.EPISODES.labels("ok").inc()
                metrics.EPISODE_REWARD.observe(t.reward)
                self.recent_rewards.append(t.reward)
            self.samples.keep(mode.stage, trajs, self.episodes)
            self.episodes += len(trajs)
            stored = await self.buffer.put_async(trajs, len(trajs),
                                                 still_wanted=lambda: self.mode is mode)
            if stored is not None:
                self.shipped += len(trajs)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("group of %s[%d] failed", task_set, index)
        finally:
            self.in_flight -= group
            self.occupancy.finish(playing[0])
            for _ in range(group):
                self._slots.release()

    async def _episode(self, stage: str, rescore: bool = False, **kwargs) -> list[Trajectory]:
        """One episode of the stage: its extension's where it has one, else the agent's.
        `rescore`: an RL episode, not an evaluation's (reward models rescore the agent's; the
        extension plays a training episode)."""
        extension = self.extensions.get(stage)
        if extension is None:
            score = self.reward_models.get(kwargs["task_set"]) if rescore else None
            return await run_episode(self.engine, self.env, self.fmt, score=score, **kwargs)
        version = self.engine.policy_version
        ctx = EpisodeContext(self.engine, self.env.env, self.fmt,
                             lambda env: EnvTimer(env, self.occupancy),
                             version - self._stage_start.get(stage, version))
        return await extension.play(ctx, training=rescore, **kwargs)

    def _staleness_check(self, mode: Mode):
        """The group's `stale` test for run_episode: a group is as old as its oldest member
        (the buffer judges it so), so the members share one oldest version and all stop once
        it is more than tau behind the version the engine now samples."""
        if mode.tau is None or mode.synchronous:
            return None  # a synchronous batch is trained at the version it was sampled at
        oldest: list[int] = []

        def stale(version: int) -> bool:
            oldest[:] = [min(oldest + [version])]
            return is_stale(self.engine.policy_version, oldest[0], mode.tau)
        return stale

    async def _demonstration(self, task_set: str, index: int) -> Demonstration:
        """The task's fixed demonstration, asked of the environment (which runs its tool calls
        in sandboxes) once and then reused: SFT revisits each task many times, and repeating
        the same sandboxed calls cost as much CPU as the training step they fed."""
        key = (task_set, index)
        demo = self._demos.get(key)
        if demo is None:
            demo = self._demos[key] = await self.env.demonstrate(task_set, index, index)
        return demo

    # ---------------------------------------------------------------- evaluation
    async def evaluate(self, task_set: str, size: int, *, max_tasks: int, samples: int,
                       greedy: bool) -> tuple[int, float, float, float, float, list[TaskCount]]:
        """(tasks, greedy success, sampled success, mean critical-path steps of the episodes as
        their extension measures them or 0, the same over the episodes that answered, each
        task's attempts and successes) at the current policy version."""
        n = min(size, max_tasks) if max_tasks else size
        sem = asyncio.Semaphore(self.config.max_concurrent)
        # A task set a stage's extension trains or evaluates on is played by that extension.
        stage = next((name for name, ext in self.extensions.items() if task_set in ext.task_sets), "")
        outcome = self.extensions[stage].outcome if stage else plain_outcome
        version = self.engine.policy_version  # the version the evaluation reports
        task_ids: dict[int, str] = {}
        # Task by task (greedy, then the samples): tasks finish in turn, the progress moves early.
        temperatures = [0.0] * (1 if greedy else 0) + [self.config.sampling.temperature] * samples
        finished, self.eval_progress = collections.Counter(), (0, n)  # attempts done, by task

        async def one(index: int, temperature: float) -> Outcome:
            async with sem:
                trajs = await self._episode(
                    stage, task_set=task_set, index=index,
                    sampling=dataclasses.replace(self.config.sampling, temperature=temperature,
                                                 seed=None),
                    limits=self.config.limits)
                self.samples.keep_evaluation(task_set, temperature, version, trajs[0])
                task_ids[index] = trajs[0].task_id
                finished[index] += 1
                self.eval_progress = (sum(k == len(temperatures) for k in finished.values()), n)
                return outcome(trajs[0])

        try:
            runs = await asyncio.gather(*[one(i, t) for i in range(n) for t in temperatures])
        finally:
            self.eval_progress = (0, 0)
        greedy_runs = runs[::len(temperatures)] if greedy else []
        sampled = [o for k, o in enumerate(runs) if not (greedy and k % len(temperatures) == 0)]
        g = sum(o.reward >= 1.0 for o in greedy_runs) / len(greedy_runs) if greedy_runs else 0.0
        s = sum(o.reward >= 1.0 for o in sampled) / len(sampled) if sampled else 0.0
        runs = greedy_runs or sampled
        answered = [o for o in runs if o.answered]
        # `sampled` is task-major: task i's attempts are sampled[i * samples:(i + 1) * samples].
        counts = [TaskCount(task_ids[i], samples,
                            sum(o.reward >= 1.0 for o in sampled[i * samples:(i + 1) * samples]),
                            greedy_runs[i].reward >= 1.0 if greedy_runs else None)
                  for i in range(n) if i in task_ids]  # none ran: no samples, no greedy
        return (n, g, s, sum(o.critical_path_steps for o in runs) / len(runs) if runs else 0.0,
                sum(o.critical_path_steps for o in answered) / len(answered) if answered else 0.0,
                counts)
