"""The stage driver: runs a job's stages in order by telling the services what to do. One
implementation for both places a job runs: `kiln run` drives it in-process, and the operator
drives every applied RLJob from a daemon thread (`kiln.operator.driving`).

For each stage it evaluates held-out task sets (if the stage asks for it), starts the trainer on
the stage, puts rollout in the matching mode (DEMONSTRATE for SFT, EXPLORE for RL), follows
progress until the trainer reports the stage done, stops rollout, waits for the final weights
to reach rollout, and evaluates again. An RL stage with guard rails (`eval.every`) is also
evaluated at every `every` steps, where the trainer waits for it; the rules (`kiln.control.guard`)
say which checkpoint it ends with and whether a regression ends it early, and the trainer
restores that checkpoint (`restore_checkpoint`), so the stage's export, the next stage and the
weights rollout serves are the selected ones.

Level-triggered: every poll compares what the trainer and rollout report with what the stage
needs and repeats the order when they differ (a restarted service reports no stage), so a
service that crashed and came back, or a driver that restarted itself, picks the stage up where
the trainer's checkpoint has it. Errors of the `transient` kinds (a service unreachable while
it restarts) are waited out up to `unavailable_seconds`.

What is done is kept in a `RunState` (finished stages, evaluations, the checkpoint each guarded
stage ended with) through a `StateStore`: a JSON file for `kiln run` (`state.json`, read by
`--resume`), the RLJob's status in a cluster. Progress goes to a `progress` callback (the
launcher's live line and metrics.jsonl, the operator's log) and an optional tracker; a
held-out evaluation's progress (tasks done) to `say` every few seconds while it runs.

The driver talks to the services through `kiln.control`'s Protocols; it knows nothing of
processes, pods or gRPC.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from kiln.api.spec import RLJob, RLStage, SFTStage
from kiln.control.autoscale import Autoscaler, StepSignals
from kiln.control.guard import Guard, Selection
from kiln.control.records import (BufferControl, ModeRequest, RolloutControl, RolloutMode,
                                  RolloutScaler, RolloutStatus, TrainerControl, TrainerStatus)
from kiln.control.progress import evaluate_reporting, progress_scalars
from kiln.metrics import PASS_AT_K, STATUS, StepMetrics


class StateStore(Protocol):
    def load(self) -> dict[str, Any]: ...

    def save(self, data: dict[str, Any]) -> None: ...


class FileStore:
    """`state.json` in a run directory, replaced atomically."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path)


@dataclass
class RunState:
    store: StateStore
    finished_stages: list[str] = field(default_factory=list)
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyed "stage/before|after/task set", and "stage/step-N/task set" inside a stage."""
    selections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Guarded stages: {stage: {"step", "reason", "stopped"}}, the checkpoint it ended with."""

    @classmethod
    def load(cls, store: StateStore) -> RunState:
        data = store.load()
        return cls(store, list(data.get("finished_stages", [])), dict(data.get("evaluations", {})),
                   dict(data.get("selections", {})))

    def save(self) -> None:
        self.store.save({"finished_stages": self.finished_stages, "evaluations": self.evaluations,
                         "selections": self.selections})


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float | None]) -> None: ...


class Stopped(Exception):
    """`should_stop` turned true (the job was suspended or deleted); nothing is lost: the next
    driver resumes from the state and the trainer's checkpoint."""


def trainer_record(s: TrainerStatus) -> dict[str, Any]:
    """The trainer's part of a progress record (what the report plots): the stage's position and
    the last step's metrics under their names (`kiln.metrics.StepMetrics`)."""
    return {
        **(s.last_step.record() if s.last_step else {}),
        # After the step's own: the trainer's version now (the step's weights may have been
        # published since), not the one the step trained.
        "stage": s.stage, "stage_step": s.stage_step, "policy_version": s.policy_version,
        "stage_done": s.stage_done, "failed": s.stage_failed, "message": s.message,
    }


@dataclass
class Progress:
    """One poll of a running stage, for whoever shows or records it."""

    stage: SFTStage | RLStage
    trainer: TrainerStatus
    rollout: RolloutStatus
    buffer: Any
    elapsed: float

    @property
    def step(self) -> int:
        return self.trainer.stage_step if self.trainer.stage == self.stage.name else 0

    def record(self) -> dict[str, Any]:
        return {"event": "progress", "time": time.time(), "elapsed": self.elapsed,
                "stage": self.stage.name, "step": self.step, "max_steps": self.stage.max_steps,
                "trainer": trainer_record(self.trainer), "rollout": dataclasses.asdict(self.rollout),
                "buffer": dataclasses.asdict(self.buffer)}


@dataclass(frozen=True)
class ControlPlane:
    """The services a stage driver orders and reads (the control clients, or in-process fakes)."""

    trainer: TrainerControl
    rollout: RolloutControl
    buffer: BufferControl
    scaler: RolloutScaler | None = None
    """Owner of the rollout replicas; with `spec.rollout.autoscale`, asynchronous RL stages
    resize rollout through it."""


@dataclass
class DriverHooks:
    """What the host (`kiln run`, the operator) is told and asked while stages run."""

    say: Callable[[str], None] = print
    on_progress: Callable[[Progress], None] = lambda p: None
    on_event: Callable[[dict[str, Any]], None] = lambda e: None
    supervise: Callable[[], list[str]] = lambda: []
    """Called every poll (`kiln run`: restart services that died, return their names; those
    get their orders again at once)."""
    should_stop: Callable[[], bool] = lambda: False
    tracker: Tracker | None = None


@dataclass(frozen=True)
class DriverOptions:
    poll_seconds: float = 1.0
    transient: tuple[type[BaseException], ...] = ()
    """Errors that mean a service is restarting: waited out, up to `unavailable_seconds`."""
    unavailable_seconds: float = 600.0


class Driver:
    def __init__(self, job: RLJob, plane: ControlPlane, state: RunState,
                 hooks: DriverHooks | None = None, options: DriverOptions | None = None) -> None:
        hooks, options = hooks or DriverHooks(), options or DriverOptions()
        self.job, self.state = job, state
        self.trainer, self.rollout, self.buffer = plane.trainer, plane.rollout, plane.buffer
        self.scaler = plane.scaler
        self.poll_seconds = options.poll_seconds
        self.transient, self.unavailable_seconds = options.transient, options.unavailable_seconds
        self.say, self.on_progress, self.on_event = hooks.say, hooks.on_progress, hooks.on_event
        self.supervise, self.should_stop = hooks.supervise, hooks.should_stop
        self.tracker = hooks.tracker
        self._restarted: list[str] = []  # restarted while a call waited; announced next poll
        self._global_step = 0

    # ------------------------------------------------------------------ stages
    def run(self) -> RunState:
        for stage in self.job.spec.stages:
            if stage.name in self.state.finished_stages:
                self.say(f"stage {stage.name}: already finished, skipping")
                continue
            self._run_stage(stage)
            self.state.finished_stages.append(stage.name)
            self.state.save()
        return self.state

    def _call(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, waiting out transient errors (a service restarting) up to the limit."""
        deadline = time.monotonic() + self.unavailable_seconds
        while True:
            if self.should_stop():
                raise Stopped()
            try:
                return fn()
            except self.transient as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a service stayed unavailable for "
                                       f"{self.unavailable_seconds:.0f} s: {exc}") from exc
                # The service may have died: have it restarted while waiting for it.
                self._restarted += self.supervise()
                time.sleep(self.poll_seconds)

    def _evaluate(self, stage: SFTStage | RLStage, when: str) -> dict[str, dict[str, Any]]:
        """Evaluate the stage's held-out task sets `when` ("before", "after", "step-N"), unless
        recorded already; returns {task set: result}."""
        if not stage.eval or (when == "before" and not stage.eval.before):
            return {}
        out = {}
        for task_set in stage.eval.tasks:
            key = f"{stage.name}/{when}/{task_set}"
            if key in self.state.evaluations:
                out[task_set] = self.state.evaluations[key]
                continue
            ev = self._call(lambda: evaluate_reporting(
                self.rollout, task_set, samples=stage.eval.samples, say=self.say,
                label=f"stage {stage.name}: evaluating {task_set} ({when})", transient=self.transient))
            result = out[task_set] = ev.recorded()
            self.state.evaluations[key] = result
            self.state.save()
            passes = "".join(f", pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items() if k != "1")
            self.say(f"  {task_set} {when} {stage.name}: greedy {ev.greedy_success:.3f}, "
                     f"sampled {ev.sampled_success:.3f}{passes} (version {ev.policy_version}, "
                     f"{ev.tasks} tasks, {ev.seconds:.1f} s)")
            self.on_event({"event": "eval", "stage": stage.name, "when": when,
                           "task_set": task_set, **result})
            if self.tracker is not None:
                self.tracker.log(self._global_step, {
                    **{f"eval/{task_set}/{k}": getattr(ev, k) for k in STATUS["eval"]},
                    **{f"eval/{task_set}/{PASS_AT_K.name}/{k}": v
                       for k, v in result["pass_at_k"].items()}})
        return out

    def _mode(self, stage: SFTStage | RLStage) -> ModeRequest:
        rl = isinstance(stage, RLStage)
        return ModeRequest(
            RolloutMode.EXPLORE if rl else RolloutMode.DEMONSTRATE, stage=stage.name,
            task_sets=list(stage.tasks), group_size=stage.rl.group_size if rl else 1,
            synchronous=rl and not stage.rl.asynchronous, batch_size=stage.batch_size,
            seed=self.job.spec.seed, tau=stage.rl.tau if rl else None)

    def _run_stage(self, stage: SFTStage | RLStage) -> None:
        # A resumed rollout starts from the job's initial weights and the resumed trainer
        # republishes its own at start-up: episodes (and the evaluation) must wait for them, or
        # they are sampled from a model the chain has long left (version 0, within tau of the
        # trainer's after one stage).
        version = self._call(self.trainer.status).policy_version
        self._wait(lambda: self.rollout.status().policy_version >= version,
                   f"rollout did not receive the trainer's policy version {version} before stage {stage.name}")
        guard = self._guard(stage, self._evaluate(stage, "before"))
        self.say(f"stage {stage.name} ({stage.type}): {stage.max_steps} steps")
        mode = self._mode(stage)
        self._call(lambda: self.trainer.start_stage(stage.name))
        self._call(lambda: self.rollout.set_mode(mode))
        autoscaler = self._autoscaler(stage)
        start = time.monotonic()
        while True:
            restarted = list(dict.fromkeys(self._restarted + self.supervise()))
            self._restarted = []
            if restarted:
                self.say(f"\nrestarted {', '.join(restarted)}; resuming stage {stage.name}")
                self.on_event({"event": "restart", "time": time.time(), "services": restarted,
                               "stage": stage.name})
            t = self._call(self.trainer.status)
            if t.stage_failed:
                raise RuntimeError(f"trainer failed in stage {stage.name}: {t.message}")
            if t.stage != stage.name:  # a trainer that restarted knows no stage yet
                t = self._call(lambda: self.trainer.start_stage(stage.name))
            r = self._call(self.rollout.status)
            if (r.stage, r.mode) != (stage.name, mode.mode) and not (t.stage == stage.name and t.stage_done):
                # A replica that restarted or just joined starts once it has current weights.
                order = dataclasses.replace(mode, min_version=t.policy_version)
                r = self._call(lambda: self.rollout.set_mode(order))
            b = self._call(self.buffer.status)
            if autoscaler is not None and t.stage == stage.name and t.stage_step > 0:
                self._autoscale(autoscaler, t, b)
            progress = Progress(stage, t, r, b, time.monotonic() - start)
            self._global_step = t.step
            self.on_progress(progress)
            if self.tracker is not None:
                self.tracker.log(t.step, {
                    **progress_scalars(self.job, stage.name, progress.step),
                    **{f"rollout/{k}": getattr(r, k) for k in STATUS["rollout"]},
                    **{f"buffer/{k}": getattr(b, k) for k in STATUS["buffer"]},
                    # -1: no batch acknowledged yet
                    "buffer/max_staleness": b.max_staleness if b.max_staleness >= 0 else None})
            if guard is not None and t.stage == stage.name and t.stage_eval_step and not t.stage_done:
                t = self._guard_step(stage, guard, t)
            if t.stage == stage.name and t.stage_done:
                break
            time.sleep(self.poll_seconds)
        self._call(lambda: self.rollout.set_mode(ModeRequest(RolloutMode.IDLE)))
        self._wait(lambda: self.rollout.status().policy_version >= t.policy_version,
                   f"rollout did not receive policy version {t.policy_version}")
        # Episodes of the finished stage drain (their puts are abandoned) before the next.
        self._wait(lambda: self.rollout.status().in_flight == 0,
                   "rollout still has episodes in flight")
        after = self._evaluate(stage, "after")
        if guard is None or not guard.selects:
            return
        if t.stage_selected_step is not None:  # ended on a checkpoint, maybe before a restart
            if stage.name not in self.state.selections:
                self._record(stage, Selection(t.stage_selected_step, t.stage_selected_reason,
                                              t.stage_selected_reason.startswith("stopped")))
            return
        # Ran to its end: its last step is a candidate too, and the best one is kept.
        guard.observe(t.stage_step, after)
        sel = guard.selection()
        if sel is not None and sel.step != t.stage_step:
            # The last step's evaluation becomes "step-N"; "after" is of the weights shipped.
            for task_set in after:
                self.state.evaluations[f"{stage.name}/step-{t.stage_step}/{task_set}"] = \
                    self.state.evaluations.pop(f"{stage.name}/after/{task_set}")
        self._select(stage, sel, t)
        self._evaluate(stage, "after")

    def _guard(self, stage: SFTStage | RLStage, before: dict[str, Any]) -> Guard | None:
        """The stage's guard, with the evaluations already recorded (a driver that restarted)."""
        guard = Guard.of(stage)
        if guard is None:
            return None
        if before:
            guard.observe(0, before)
        steps: dict[int, dict[str, Any]] = {}
        for key, result in self.state.evaluations.items():
            name, when, task_set = key.split("/", 2)
            if name == stage.name and when.startswith("step-"):
                steps.setdefault(int(when[5:]), {})[task_set] = result
        for step in sorted(steps):
            if set(steps[step]) >= set(stage.eval.tasks):
                guard.observe(step, steps[step])
        return guard

    def _guard_step(self, stage: RLStage, guard: Guard, t: TrainerStatus) -> TrainerStatus:
        """The trainer waits at an evaluated step: evaluate it (the weights published at it),
        then let the stage go on keeping the best checkpoint, or end it on a regression."""
        step = t.stage_eval_step
        self._wait(lambda: self.rollout.status().policy_version >= t.policy_version,
                   f"rollout did not receive policy version {t.policy_version} for step {step}")
        if not guard.points or guard.points[-1][0] < step:
            stop = guard.observe(step, self._evaluate(stage, f"step-{step}"))
            if stop is not None:
                return self._select(stage, stop, t)
        best = guard.best()
        return self._call(lambda: self.trainer.continue_stage(stage.name, step,
                                                              best[0] if best else step))

    def _select(self, stage: RLStage, sel: Selection | None, t: TrainerStatus) -> TrainerStatus:
        """End the stage on the selected step's checkpoint (restored unless it is the last
        step's weights) and record which and why."""
        if sel is None:
            return t
        if sel.stopped or sel.step != t.stage_step:
            self.say(f"stage {stage.name}: restoring the weights of step {sel.step} ({sel.reason})")
            t = self._call(lambda: self.trainer.restore_checkpoint(stage.name, sel.step, sel.reason))
            self._wait(lambda: self.rollout.status().policy_version >= t.policy_version,
                       f"rollout did not receive the restored weights (version {t.policy_version})")
        self._record(stage, sel)
        return t

    def _record(self, stage: RLStage, sel: Selection) -> None:
        self.say(f"stage {stage.name}: ends with the weights of step {sel.step}: {sel.reason}")
        self.state.selections[stage.name] = sel.record()
        self.state.save()
        self.on_event({"event": "selection", "time": time.time(), "stage": stage.name,
                       **sel.record()})

    def _autoscaler(self, stage: SFTStage | RLStage) -> Autoscaler | None:
        spec = self.job.spec.rollout.autoscale
        if spec is None or self.scaler is None or not isinstance(stage, RLStage) \
                or not stage.rl.asynchronous:
            return None  # a synchronous stage has nothing to overlap: its rollout is sized by hand
        return Autoscaler(spec, tau=stage.rl.tau, batch_size=stage.batch_size)

    def _autoscale(self, autoscaler: Autoscaler, t: TrainerStatus, b: Any) -> None:
        m = t.last_step or StepMetrics()
        staleness = [k for k, n in m.staleness.items() if n > 0]
        signals = StepSignals(t.stage_step, m.wait_seconds, m.step_seconds,
                              max(staleness, default=-1), int(getattr(b, "depth", 0)))
        if not self.scaler.settled():
            # A replica is starting or draining: steps now show neither count's effect.
            autoscaler.hold()
            return
        replicas = self.scaler.replicas()
        decision = autoscaler.observe(signals, replicas)
        if decision is None:
            return
        self.say(f"  rollout: {replicas} -> {decision.replicas} replicas ({decision.reason})")
        self.scaler.scale(decision.replicas)
        self.on_event({"event": "scale", "stage": t.stage, "step": t.stage_step,
                       "from": replicas, "to": decision.replicas, "reason": decision.reason})

    def _wait(self, done: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._call(done):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} after {timeout:.0f} s")
            time.sleep(0.1)
