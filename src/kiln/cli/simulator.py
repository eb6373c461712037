"""A discrete-event simulator of one RL stage: rollout replicas, their episodes and tools, the
buffer's freshness control and the trainer, synchronous or asynchronous, at any scale.

It follows what the services do (rollout's producer, the buffer, the trainer loop), with the
model reduced to its timings:

- An engine replica runs its generations by processor sharing: with n sequences decoding, one
  decode step takes `step_base + step_per_seq * n` seconds and gives each one token. A turn's
  work is its sampled tokens plus its new context tokens at `prefill_cost` decode steps each.
- An episode is `calls + 1` generations with a tool call between two of them; the tool takes a
  drawn latency (`ToolLatency`'s log-normal law) outside the engine.
- Admission is the producer's: groups of G start while a replica has fewer than
  `target_occupancy` episodes not waiting on a tool and at most `max_concurrent` in flight; a
  group whose oldest token is more than tau behind the replica's version is stopped before its
  members' next generation; synchronous RL produces one batch per version.
- The trainer takes `batch` trajectories (whole groups, stale groups dropped as the buffer does)
  and steps for `train_step` seconds; every `sync_interval` steps it publishes, and each replica
  pauses `sync_pause` seconds to load the version and then re-prefills its running sequences
  (vLLM preempts them so their KV cache is recomputed under the new weights).

Its inputs and its result are the records of `simulation.py`. Not modelled: the trainer and
rollout sharing cores (on one machine they slow each other), the buffer's and the sandboxes'
own costs, failures.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque

from kiln.freshness import is_stale
from kiln.cli.simulation import EngineModel, JobModel, Result, Workload

class _Group:
    __slots__ = ("members", "left", "oldest", "stopped", "replica")

    def __init__(self, replica: "_Replica", size: int) -> None:
        self.replica, self.left, self.members = replica, size, size
        self.oldest: int | None = None
        self.stopped = False


class _Episode:
    __slots__ = ("group", "calls", "turn", "context", "new_context", "started")

    def __init__(self, group: _Group, calls: int, prompt: int, started: float) -> None:
        self.group, self.calls, self.turn = group, calls, 0
        self.context = self.new_context = prompt
        self.started = started


class _Replica:
    """Processor sharing in virtual time: `vtime` counts decode steps since the start, each
    running sequence finishes when vtime reaches its mark."""

    def __init__(self, sim: "Simulation", index: int) -> None:
        self.sim, self.index = sim, index
        self.vtime, self.clock = 0.0, 0.0
        self.running: dict[_Episode, float] = {}
        self.marks: list[tuple[float, int, _Episode]] = []
        self.waiting: deque[tuple[_Episode, float]] = deque()
        self.paused_until = 0.0
        self.version = 0
        self.epoch = 0
        self.idle = 0.0
        self.admitted = self.playing = self.in_tools = 0
        """Episodes of unfinished groups (what max_concurrent bounds), episodes not finished
        (what occupies the engine unless in a tool), episodes in a tool call."""

    def _speed(self) -> float:
        n = len(self.running)
        m = self.sim.engine
        return 1.0 / (m.step_base + m.step_per_seq * n) if n else 0.0

    def advance(self, now: float) -> None:
        if now <= self.clock:
            return
        if not self.running:
            self.idle += now - self.clock
        else:
            start = max(self.clock, self.paused_until)
            if now > start:
                self.vtime += (now - start) * self._speed()
        self.clock = now

    def submit(self, ep: _Episode, work: float, now: float) -> None:
        self.advance(now)
        if len(self.running) >= self.sim.engine.max_seqs:
            self.waiting.append((ep, work))
            return
        self._run(ep, work)
        self._schedule(now)

    def _run(self, ep: _Episode, work: float) -> None:
        mark = self.vtime + work
        self.running[ep] = mark
        heapq.heappush(self.marks, (mark, next(self.sim.ids), ep))

    def _schedule(self, now: float) -> None:
        self.epoch += 1
        while self.marks and self.running.get(self.marks[0][2]) != self.marks[0][0]:
            heapq.heappop(self.marks)  # superseded by a re-prefill
        if not self.marks:
            return
        start = max(now, self.paused_until)
        at = start + (self.marks[0][0] - self.vtime) / self._speed()
        self.sim.at(at, self._finish, self.epoch)

    def _finish(self, now: float, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.advance(now)
        done = []
        while self.marks and self.marks[0][0] <= self.vtime + 1e-9:
            mark, _, ep = heapq.heappop(self.marks)
            if self.running.get(ep) == mark:
                del self.running[ep]
                done.append(ep)
        while self.waiting and len(self.running) < self.sim.engine.max_seqs:
            self._run(*self.waiting.popleft())
        self._schedule(now)
        for ep in done:
            self.sim.generated(ep, now)

    def load(self, version: int, now: float) -> None:
        """Pause, take the new version, re-prefill every running sequence."""
        self.advance(now)
        self.paused_until = max(self.paused_until, now) + self.sim.job.sync_pause
        self.sim.at(self.paused_until, self._loaded, version)
        cost = self.sim.engine.prefill_cost
        for ep in list(self.running):
            self.running[ep] += ep.context * cost
            heapq.heappush(self.marks, (self.running[ep], next(self.sim.ids), ep))
        self._schedule(now)

    def _loaded(self, now: float, version: int) -> None:
        self.version = max(self.version, version)
        self.sim.admit(now, self)


class Simulation:
    def __init__(self, workload: Workload, engine: EngineModel, job: JobModel, seed: int = 0) -> None:
        self.workload, self.engine, self.job = workload, engine, job
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.events: list = []
        self.now = 0.0
        self.replicas = [_Replica(self, i) for i in range(job.replicas)]
        self.buffer: deque[_Group] = deque()
        self.buffered = 0
        """Trajectories in `buffer` (its groups' members)."""
        self.version = 0
        self.step = 0
        self.trainer_busy_until: float | None = None
        self.trainer_idle = 0.0
        self.trainer_waiting_since = 0.0
        self.batch_left = job.batch  # synchronous: trajectories still to start this version
        self.result = Result(0.0, 0, 0, 0.0, 0.0)

    # ------------------------------------------------------------------ events
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.ids), fn, args))

    def run(self) -> Result:
        self.admit(0.0)
        while self.events and self.step < self.job.steps:
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(t, *args)
        end = self.now
        for r in self.replicas:
            r.advance(end)
        res = self.result
        res.seconds, res.steps = end, self.step
        res.trainer_idle = self.trainer_idle / end if end else 0.0
        res.engine_idle = sum(r.idle for r in self.replicas) / len(self.replicas) / end if end else 0.0
        return res

    # ------------------------------------------------------------------ rollout
    def admit(self, now: float, only: "_Replica | None" = None) -> None:
        """Start groups where the producer would: round-robin over the replicas (or on `only`,
        after an event of its own) while each has room."""
        replicas = [only] if only is not None else self.replicas
        started = True
        while started:
            started = False
            for r in replicas:
                if self._room(r):
                    self._start_group(r, now)
                    started = True

    def _room(self, r: "_Replica") -> bool:
        job = self.job
        if r.admitted + job.group > job.max_concurrent:
            return False
        if job.target_occupancy and r.playing - r.in_tools >= job.target_occupancy:
            return False
        if not job.asynchronous:
            # One batch per version, split between the replicas; the next one starts once a
            # replica has loaded the next version.
            if self.batch_left <= 0 or r.version < self.version:
                return False
            self.batch_left -= job.group
        return True

    def _start_group(self, r: _Replica, now: float) -> None:
        g = _Group(r, self.job.group)
        r.admitted += self.job.group
        r.playing += self.job.group
        for _ in range(self.job.group):
            ep = _Episode(g, self.workload.calls(self.rng), self.workload.prompt_tokens, now)
            self._turn(ep, now)

    def _turn(self, ep: _Episode, now: float) -> None:
        g, r = ep.group, ep.group.replica
        tau = self.job.tau
        if (not g.stopped and self.job.asynchronous and g.oldest is not None
                and is_stale(r.version, g.oldest, tau)):
            g.stopped = True
            self.result.stopped_stale += g.members
        if g.stopped:
            self._episode_done(ep, now)
            return
        g.oldest = r.version if g.oldest is None else min(g.oldest, r.version)
        work = self.workload.gen_tokens + ep.new_context * self.engine.prefill_cost
        ep.context += self.workload.gen_tokens
        ep.new_context = 0
        r.submit(ep, work, now)

    def generated(self, ep: _Episode, now: float) -> None:
        ep.turn += 1
        if ep.turn > ep.calls:
            self.result.episode_seconds.append(now - ep.started)
            self._episode_done(ep, now)
            return
        r = ep.group.replica
        r.in_tools += 1
        self.admit(now, r)  # it left the engine: room for another group
        self.at(now + self.workload.tool_latency(self.rng), self._tool_done, ep)

    def _tool_done(self, now: float, ep: _Episode) -> None:
        ep.group.replica.in_tools -= 1
        ep.context += self.workload.obs_tokens
        ep.new_context = self.workload.obs_tokens
        self._turn(ep, now)

    def _episode_done(self, ep: _Episode, now: float) -> None:
        g = ep.group
        g.left -= 1
        g.replica.playing -= 1
        if g.left:
            self.admit(now, g.replica)
            return
        g.replica.admitted -= g.members
        if not g.stopped:
            self.result.episodes += g.members
            if self._stale(g):
                self.result.dropped_stale += g.members  # the buffer refuses it on arrival
            else:
                self.buffer.append(g)
                self.buffered += g.members
                self._train(now)
        elif not self.job.asynchronous:
            self.batch_left += g.members
        self.admit(now, None if not self.job.asynchronous else g.replica)

    # ------------------------------------------------------------------ buffer and trainer
    def _stale(self, g: _Group) -> bool:
        return is_stale(self.version, g.oldest, self.job.tau)

    def _drop_stale(self) -> None:
        """What the buffer does when the trainer's version advances: every waiting group
        more than tau behind goes (a group's age changes only then)."""
        kept: deque[_Group] = deque()
        for g in self.buffer:
            if self._stale(g):
                self.buffered -= g.members
                self.result.dropped_stale += g.members
            else:
                kept.append(g)
        self.buffer = kept

    def _train(self, now: float) -> None:
        if self.trainer_busy_until is not None or self.buffered < self.job.batch:
            return
        self.trainer_idle += now - self.trainer_waiting_since
        taken = 0
        while taken < self.job.batch:
            g = self.buffer.popleft()
            self.buffered -= g.members
            taken += g.members
            self.result.staleness[self.version - g.oldest] += g.members
        self.result.trained += taken
        self.trainer_busy_until = now + self.job.train_step
        self.at(self.trainer_busy_until, self._stepped)

    def _stepped(self, now: float) -> None:
        self.step += 1
        self.result.step_times.append(now)
        self.trainer_busy_until = None
        self.trainer_waiting_since = now
        if self.step % self.job.sync_interval == 0:
            self.version += 1
            self._drop_stale()
            if not self.job.asynchronous:
                self.batch_left = self.job.batch
            for r in self.replicas:
                r.load(self.version, now)
        self._train(now)


def simulate(workload: Workload, engine: EngineModel, job: JobModel, seed: int = 0) -> Result:
    return Simulation(workload, engine, job, seed).run()
