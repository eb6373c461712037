"""The trainer's status as it crosses the wire: the domain record and its protobuf converters,
used by the servicer and by the client alike."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.protos.kiln.v1 import trainer_pb2 as pb


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


def status_to_proto(s: TrainerStatus) -> pb.TrainerStatus:
    return pb.TrainerStatus(
        step=s.step, policy_version=s.policy_version, stage=s.stage, last_metrics=s.last_metrics,
        last_checkpoint=s.last_checkpoint, tensor_parallel=s.tensor_parallel,
        model_dir=s.model_dir, stage_step=s.stage_step, stage_max_steps=s.stage_max_steps,
        stage_done=s.stage_done, stage_failed=s.stage_failed, message=s.message)


def status_from_proto(msg: pb.TrainerStatus) -> TrainerStatus:
    return TrainerStatus(
        step=msg.step, policy_version=msg.policy_version, stage=msg.stage,
        last_metrics=dict(msg.last_metrics), last_checkpoint=msg.last_checkpoint,
        tensor_parallel=msg.tensor_parallel, model_dir=msg.model_dir, stage_step=msg.stage_step,
        stage_max_steps=msg.stage_max_steps, stage_done=msg.stage_done,
        stage_failed=msg.stage_failed, message=msg.message)
