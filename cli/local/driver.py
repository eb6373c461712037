"""The stage driver: runs a job's stages in order by telling the services what to do.

For each stage it evaluates held-out task sets (if the stage asks for it), starts the trainer on
the stage, puts rollout in the matching mode (DEMONSTRATE for SFT, EXPLORE for RL), follows
progress until the trainer reports the stage done, stops rollout, waits for the final weights
to reach rollout, and evaluates again. Progress is printed as a live line and appended to
`metrics.jsonl`; `state.json` records finished stages so `kiln run --resume` skips them.

The driver talks to the services through the small Protocols below, which the trainer's,
rollout's and buffer's clients implement; it knows nothing of processes (`processes.py`) or of
gRPC.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from kiln.api.spec import RLJob, RLStage, SFTStage
from kiln.services.buffer.client import BufferStatus
from kiln.services.common.tracking import Tracker
from kiln.services.rollout.client import Evaluation, ModeRequest, RolloutMode, RolloutStatus
from kiln.services.trainer.client import TrainerStatus


class TrainerControl(Protocol):
    def start_stage(self, name: str) -> TrainerStatus: ...
    def status(self) -> TrainerStatus: ...


class RolloutControl(Protocol):
    def set_mode(self, mode: ModeRequest) -> RolloutStatus: ...
    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation: ...
    def status(self) -> RolloutStatus: ...


class BufferControl(Protocol):
    def status(self) -> BufferStatus: ...


def trainer_record(s: TrainerStatus) -> dict[str, Any]:
    """The trainer's part of a progress record in metrics.jsonl (what the report plots)."""
    m = s.last_metrics
    return {
        "stage": s.stage, "step": s.stage_step, "global_step": s.step,
        "policy_version": s.policy_version, "stage_done": s.stage_done,
        "failed": s.stage_failed, "message": s.message,
        "loss": m.get("loss"), "reward": m.get("reward_mean"), "grad_norm": m.get("grad_norm"),
        "lr": m.get("lr"), "ratio_mask": m.get("ratio_mask_frac"),
        "icepop_mask": m.get("icepop_mask_frac"), "mismatch_abs": m.get("mismatch_abs"),
        "mismatch_kl": m.get("mismatch_kl"), "tokens_per_second": m.get("tokens_per_s"),
        "step_seconds": m.get("step_time_s"),
        "staleness_counts": {str(k): v for k, v in s.staleness_counts().items()},
    }


@dataclass
class RunState:
    path: Path
    finished_stages: list[str] = field(default_factory=list)
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> RunState:
        if path.exists():
            data = json.loads(path.read_text())
            return cls(path, data.get("finished_stages", []), data.get("evaluations", {}))
        return cls(path)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"finished_stages": self.finished_stages,
                                   "evaluations": self.evaluations}, indent=2))
        tmp.replace(self.path)


class Driver:
    def __init__(self, job: RLJob, run_dir: Path, trainer: TrainerControl, rollout: RolloutControl,
                 buffer: BufferControl, *, poll_seconds: float = 1.0, out=sys.stdout,
                 supervise: Callable[[], list[str]] = lambda: [],
                 tracker: Tracker | None = None) -> None:
        self.job, self.run_dir = job, run_dir
        # Rollout, buffer and evaluation figures (the trainer tracks its own step metrics),
        # against the trainer's global step.
        self.tracker = tracker
        self._global_step = 0
        self.trainer, self.rollout, self.buffer = trainer, rollout, buffer
        self.poll_seconds = poll_seconds
        self.out = out
        # Called every poll; returns the services it found dead and restarted, which then get
        # their orders again (both calls are idempotent and resume where the stage was).
        self.supervise = supervise
        self.state = RunState.load(run_dir / "state.json")
        self.metrics_file = run_dir / "metrics.jsonl"
        self._last_step: int | None = None
        self._last_print = 0.0

    # ------------------------------------------------------------------ stages
    def run(self) -> RunState:
        for stage in self.job.spec.stages:
            if stage.name in self.state.finished_stages:
                self._say(f"stage {stage.name}: already finished, skipping")
                continue
            self._run_stage(stage)
            self.state.finished_stages.append(stage.name)
            self.state.save()
        return self.state

    def _evaluate(self, stage: SFTStage | RLStage, when: str) -> None:
        if not stage.eval:
            return
        for task_set in stage.eval.tasks:
            key = f"{stage.name}/{when}/{task_set}"
            if key in self.state.evaluations:
                continue
            self._say(f"stage {stage.name}: evaluating {task_set} ({when})")
            ev = self.rollout.evaluate(task_set, samples=stage.eval.samples, greedy=True)
            result = dataclasses.asdict(ev)
            self.state.evaluations[key] = result
            self.state.save()
            self._say(f"  {task_set} {when} {stage.name}: greedy {ev.greedy_success:.3f}, "
                      f"sampled {ev.sampled_success:.3f} (version {ev.policy_version}, "
                      f"{ev.tasks} tasks, {ev.seconds:.1f} s)")
            self._record({"event": "eval", "stage": stage.name, "when": when, "task_set": task_set, **result})
            if self.tracker is not None:
                self.tracker.log(self._global_step, {
                    f"eval/{task_set}/greedy_success": ev.greedy_success,
                    f"eval/{task_set}/sampled_success": ev.sampled_success})

    def _run_stage(self, stage: SFTStage | RLStage) -> None:
        self._evaluate(stage, "before")
        rl = isinstance(stage, RLStage)
        self._say(f"stage {stage.name} ({stage.type}): {stage.max_steps} steps")
        def order_trainer() -> None:
            self.trainer.start_stage(stage.name)

        def order_rollout() -> None:
            self.rollout.set_mode(ModeRequest(
                RolloutMode.EXPLORE if rl else RolloutMode.DEMONSTRATE, stage=stage.name,
                task_sets=list(stage.tasks), group_size=stage.rl.group_size if rl else 1,
                synchronous=rl and not stage.rl.asynchronous, batch_size=stage.batch_size,
                seed=self.job.spec.seed))

        order_trainer()
        order_rollout()
        start = time.monotonic()
        while True:
            restarted = self.supervise()
            if restarted:
                self._say(f"\nrestarted {', '.join(restarted)}; resuming stage {stage.name}")
                self._record({"event": "restart", "services": restarted, "stage": stage.name})
            if "trainer" in restarted:
                order_trainer()
            if "rollout" in restarted:
                order_rollout()
            t = self.trainer.status()
            if t.stage_failed:
                raise RuntimeError(f"trainer failed in stage {stage.name}: {t.message}")
            r = self.rollout.status()
            b = self.buffer.status()
            self._progress(stage, t, r, b, time.monotonic() - start)
            if t.stage == stage.name and t.stage_done:
                break
            time.sleep(self.poll_seconds)
        self.rollout.set_mode(ModeRequest(RolloutMode.IDLE))
        self._wait_for_version(t.policy_version)
        self._wait_idle()
        self._line_done()
        self._evaluate(stage, "after")

    def _wait_for_version(self, version: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.rollout.status().policy_version < version:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout did not receive policy version {version} in {timeout:.0f} s")
            time.sleep(0.1)

    def _wait_idle(self, timeout: float = 120.0) -> None:
        """Episodes of the finished stage drain (their puts are abandoned) before the next."""
        deadline = time.monotonic() + timeout
        while self.rollout.status().in_flight > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout still has episodes in flight after {timeout:.0f} s")
            time.sleep(0.1)

    # ------------------------------------------------------------------ output
    def _progress(self, stage, t: TrainerStatus, r: RolloutStatus, b: BufferStatus,
                  elapsed: float) -> None:
        step = t.stage_step if t.stage == stage.name else 0
        eta = elapsed / step * (stage.max_steps - step) if step else float("nan")
        rec = {"event": "progress", "time": time.time(), "elapsed": elapsed, "stage": stage.name,
               "step": step, "max_steps": stage.max_steps, "trainer": trainer_record(t),
               "rollout": dataclasses.asdict(r), "buffer": dataclasses.asdict(b)}
        self._record(rec)
        self._global_step = t.step
        if self.tracker is not None:
            self.tracker.log(t.step, {
                "rollout/pass_rate": r.mean_reward, "rollout/tokens_per_s": r.tokens_per_second,
                "rollout/in_flight": r.in_flight, "rollout/policy_version": r.policy_version,
                "buffer/depth": b.depth, "buffer/dropped_stale": b.dropped_stale,
                "buffer/max_staleness": b.max_staleness if b.max_staleness >= 0 else None})
        reward = t.last_metrics.get("reward_mean")
        line = (f"\r[{stage.name}] step {step}/{stage.max_steps}  v{t.policy_version}"
                f"  reward {reward if reward is None else f'{reward:.3f}'}"
                f"  rollout pass {r.mean_reward:.3f}"
                f"  staleness<={max(0, b.max_staleness)}  dropped {b.dropped_stale}"
                f"  {r.tokens_per_second:.0f} tok/s  ETA {eta:.0f}s   ")
        if self.out.isatty():
            self.out.write(line)
            self.out.flush()
        elif step and step != self._last_step and (
                step == stage.max_steps or time.monotonic() - self._last_print >= 10):
            # Logs (CI, `| tee`) get a line every 10 s rather than a redrawn one.
            self.out.write(line.lstrip("\r").rstrip() + "\n")
            self.out.flush()
            self._last_step, self._last_print = step, time.monotonic()

    def _line_done(self) -> None:
        if self.out.isatty():
            self.out.write("\n")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _record(self, rec: dict) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
