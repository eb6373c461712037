"""The control plane's records: what a stage driver tells rollout and the trainer, and what it
reads back from them. Plain types, no gRPC and no torch: the driver (`kiln.driver`) runs inside
`kiln run` and inside the operator alike, and neither side may depend on the other's transport.
Their protobuf form is `kiln.protos.control`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


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


@dataclass
class Evaluation:
    policy_version: int
    tasks: int
    greedy_success: float
    sampled_success: float
    seconds: float


@dataclass
class TrainerStatus:
    step: int = 0
    """Optimizer steps taken, all stages together."""
    policy_version: int = 0
    stage: str = ""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics (`TrainerEngine.step`)."""
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

    def metric(self, name: str) -> float | None:
        return self.last_metrics.get(name)

    def staleness_counts(self) -> dict[int, float]:
        """Trajectories of the last step by staleness (versions behind the trainer)."""
        return {int(k.removeprefix("staleness_")): v for k, v in self.last_metrics.items()
                if k.startswith("staleness_")}



class BufferView(Protocol):
    """What the driver reads of the buffer's status (`kiln.services.buffer.types.BufferStatus`
    is one, a dataclass)."""

    depth: int
    dropped_stale: int
    max_staleness: int
    """Largest staleness in an acked batch; -1 before the first ack."""


class TrainerControl(Protocol):
    def start_stage(self, name: str) -> TrainerStatus:
        """Start (or continue) stage `name`; idempotent, returns at once."""

    def status(self) -> TrainerStatus: ...


class RolloutControl(Protocol):
    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        """Idempotent."""

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation: ...

    def status(self) -> RolloutStatus: ...


class BufferControl(Protocol):
    def status(self) -> Any:
        """A `BufferView` (a dataclass, recorded whole in progress records)."""
