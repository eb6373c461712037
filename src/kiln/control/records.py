"""The control plane's records: what a stage driver tells rollout and the trainer, and what it
reads back from them and from the buffer. Plain types, no gRPC and no torch: the driver
(`kiln.control.driver`) runs inside `kiln run` and inside the operator alike, and neither side may
depend on the other's transport. Their protobuf form is `kiln.control.wire`; the clients that
carry them are `kiln.control.clients`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from kiln.evaluation import TaskCount, pass_at_ks
from kiln.metrics import StepMetrics


class RolloutMode(enum.IntEnum):
    """What rollout produces; the values are those of `kiln.v1.RolloutMode` (a test checks)."""

    IDLE = 0
    """Nothing new starts; episodes in flight finish and are shipped."""
    DEMONSTRATE = 1
    """SFT stages: the environment's scripted solver acts."""
    EXPLORE = 2
    """RL stages: the policy acts, G samples per task."""


@dataclass
class ModeRequest:
    mode: RolloutMode = RolloutMode.IDLE
    stage: str = ""
    task_sets: list[str] = field(default_factory=list)
    group_size: int = 1
    synchronous: bool = False
    """Produce `batch_size` trajectories per policy version, then wait for the next one."""
    batch_size: int = 0
    seed: int = 0
    tau: int | None = None
    """The stage's freshness bound: an episode whose oldest token is more than tau versions
    behind can no longer be trained, so rollout stops it early. None: no bound (SFT)."""
    min_version: int = 0
    """Start no episode before the engine serves this policy version (the trainer's when the
    order was sent): a replica that just joined takes work only once it has current weights."""


@dataclass
class RolloutStatus:
    mode: RolloutMode = RolloutMode.IDLE
    stage: str = ""
    policy_version: int = 0
    episodes: int = 0
    tokens_generated: int = 0
    tokens_per_second: float = 0.0
    mean_reward: float = 0.0
    """Over the last 256 finished episodes of the current stage."""
    in_flight: int = 0
    engine_fingerprint: str = ""
    shipped: int = 0
    """Trajectories whose Put the buffer acknowledged."""
    stopped_stale: int = 0
    """Episodes stopped early because their group was already beyond the stage's tau."""
    generating: int = 0
    """Generate calls the inference engine has in progress (its occupancy)."""
    teacher_seconds: float = 0.0
    """On-policy distillation: seconds spent waiting for the teachers' scores, in all."""
    teacher_tokens: int = 0
    """On-policy distillation: tokens the teachers scored, in all."""
    eval_tasks_done: int = 0
    """The held-out evaluation in progress: tasks whose every attempt has finished..."""
    eval_tasks: int = 0
    """...of its tasks (both 0 when none runs)."""


def combined_status(replicas: list[RolloutStatus],
                    draining: list[RolloutStatus] = ()) -> RolloutStatus:
    """Several rollout replicas as one, for the stage driver: the mode and stage they all have
    (none, if they differ, so that the driver orders them again), the oldest policy version
    among them (the driver waits for all to have a version), counts summed, the reward averaged
    by episodes. Replicas being drained count only for the episodes they still have in flight."""
    if not replicas:
        return RolloutStatus(in_flight=sum(d.in_flight for d in draining))
    first = replicas[0]
    same = all((r.mode, r.stage) == (first.mode, first.stage) for r in replicas)
    episodes = sum(r.episodes for r in replicas)
    return RolloutStatus(
        mode=first.mode if same else RolloutMode.IDLE, stage=first.stage if same else "",
        policy_version=min(r.policy_version for r in replicas), episodes=episodes,
        tokens_generated=sum(r.tokens_generated for r in replicas),
        tokens_per_second=sum(r.tokens_per_second for r in replicas),
        mean_reward=(sum(r.mean_reward * r.episodes for r in replicas) / episodes if episodes
                     else first.mean_reward),
        in_flight=sum(r.in_flight for r in [*replicas, *draining]),
        engine_fingerprint=first.engine_fingerprint,
        shipped=sum(r.shipped for r in replicas),
        stopped_stale=sum(r.stopped_stale for r in replicas),
        generating=sum(r.generating for r in replicas),
        teacher_seconds=sum(r.teacher_seconds for r in replicas),
        teacher_tokens=sum(r.teacher_tokens for r in replicas),
        eval_tasks_done=sum(r.eval_tasks_done for r in replicas),
        eval_tasks=sum(r.eval_tasks for r in replicas))


@dataclass
class Evaluation:
    policy_version: int
    tasks: int
    greedy_success: float
    sampled_success: float
    seconds: float
    critical_path_steps: float = 0.0
    """Swarm task sets: mean critical-path steps per episode (greedy ones, when run)."""
    critical_path_steps_answered: float = 0.0
    """The same over the episodes that answered only: one that ran out of turns or budget
    unanswered has a short path, so a collapse must not read as a speed-up."""
    task_counts: list[TaskCount] = field(default_factory=list)
    """Each task's attempts and successes, in task order (pass@k is computed from them)."""

    def recorded(self) -> dict[str, Any]:
        """As run state, summary.json and the RLJob's status keep it: the figures, with the
        per-task counts folded into `pass_at_k` ({str(k): pass@k}, `kiln.evaluation`)."""
        kept = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "task_counts"}
        return {**kept, "pass_at_k": pass_at_ks(self.task_counts)}


@dataclass
class TrainerStatus:
    step: int = 0
    """Optimizer steps taken, all stages together."""
    policy_version: int = 0
    stage: str = ""
    last_step: StepMetrics | None = None
    """The last step's metrics (`TrainerEngine.step`); None before the stage's first step."""
    last_checkpoint: str = ""
    tensor_parallel: int = 1
    model_dir: str = ""
    stage_step: int = 0
    """Steps taken in `stage` (the one RunStage started)."""
    stage_max_steps: int = 0
    stage_done: bool = False
    stage_failed: bool = False
    message: str = ""
    """Why the stage failed."""
    stage_eval_step: int = 0
    """The stage step whose weights wait for a held-out evaluation (`continue_stage`); 0: none."""
    stage_selected_step: int | None = None
    """The stage ended with the weights of this stage step (`restore_checkpoint`)."""
    stage_selected_reason: str = ""


@dataclass
class BufferStatus:
    """The buffer's counters, as its GetStatus (and every control call) answers them."""

    depth: int
    ready: int
    groups_pending: int
    groups_ready: int
    accepted: int
    served: int
    """Trajectories in acked batches."""
    dropped_stale: int
    dropped_other: int
    batches: int
    """Batch ids issued."""
    max_staleness: int
    """Largest staleness in an acked batch; -1 before the first ack."""
    policy_version: int
    capacity: int
    group_size: int
    tau: int | None
    unconsumed_bytes: int = 0
    """Bytes of the waiting and leased trajectories (what the byte capacity bounds)."""
    capacity_bytes: int = 0
    leased: int = 0
    """Trajectories in batches served and not yet acked."""
    leases: int = 0
    batches_acked: int = 0
    redeliveries: int = 0
    lease_timeout: float = 0.0


class BufferView(Protocol):
    """What the driver reads of the buffer's status (a `BufferStatus` is one; tests use
    smaller dataclasses)."""

    depth: int
    dropped_stale: int
    max_staleness: int
    """Largest staleness in an acked batch; -1 before the first ack."""


class TrainerControl(Protocol):
    def start_stage(self, name: str) -> TrainerStatus:
        """Start (or continue) stage `name`; idempotent, returns at once."""

    def status(self) -> TrainerStatus: ...

    def continue_stage(self, name: str, step: int, keep_step: int) -> TrainerStatus:
        """Let a stage waiting at `step` for its evaluation go on, keeping the checkpoint of
        `keep_step` (the best so far). Only stages with `eval.every` wait."""

    def restore_checkpoint(self, name: str, step: int, reason: str) -> TrainerStatus:
        """End stage `name` with the weights of its evaluated stage step `step`, published
        as a new version and exported as the stage's."""


class RolloutControl(Protocol):
    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        """Idempotent."""

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation: ...

    def status(self) -> RolloutStatus: ...


class RolloutScaler(Protocol):
    """Whatever owns the rollout replicas: `kiln run`'s worker processes, the operator's
    `spec.rollout.replicas`. Autoscaling (`kiln.control.autoscale`) asks it for a new count."""

    def replicas(self) -> int:
        """The count asked for last (serving or on its way)."""

    def settled(self) -> bool:
        """Every replica asked for serves, and none is still leaving: what the trainer sees
        now is the effect of the current count."""

    def scale(self, replicas: int) -> None:
        """Start or stop replicas until there are `replicas`; returns at once (a new replica
        takes work once it serves the current policy version)."""


class BufferControl(Protocol):
    def status(self) -> Any:
        """A `BufferView` (a dataclass, recorded whole in progress records)."""
