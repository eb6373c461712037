"""The rollout service's control API as it crosses the wire: the mode a driver sets, the status
and evaluation results it reads, and their protobuf converters (used by the servicer and by the
client alike)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kiln.protos.kiln.v1 import rollout_pb2 as pb


class RolloutMode(enum.IntEnum):
    """What rollout produces; the values are those of `kiln.v1.RolloutMode`."""

    IDLE = pb.IDLE
    """Nothing new starts; episodes in flight finish and are shipped."""
    DEMONSTRATE = pb.DEMONSTRATE
    """SFT stages: the environment's scripted solver acts."""
    EXPLORE = pb.EXPLORE
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


def mode_to_proto(m: ModeRequest) -> pb.SetModeRequest:
    return pb.SetModeRequest(mode=int(m.mode), stage=m.stage, task_sets=m.task_sets,
                             group_size=m.group_size, synchronous=m.synchronous,
                             batch_size=m.batch_size, seed=m.seed)


def mode_from_proto(msg: pb.SetModeRequest) -> ModeRequest:
    return ModeRequest(RolloutMode(msg.mode), msg.stage, list(msg.task_sets), msg.group_size,
                       msg.synchronous, msg.batch_size, msg.seed)


def status_to_proto(s: RolloutStatus) -> pb.RolloutStatus:
    return pb.RolloutStatus(
        mode=int(s.mode), stage=s.stage, policy_version=s.policy_version, episodes=s.episodes,
        tokens_generated=s.tokens_generated, tokens_per_second=s.tokens_per_second,
        mean_reward=s.mean_reward, in_flight=s.in_flight,
        engine_fingerprint=s.engine_fingerprint, shipped=s.shipped)


def status_from_proto(msg: pb.RolloutStatus) -> RolloutStatus:
    return RolloutStatus(
        RolloutMode(msg.mode), msg.stage, msg.policy_version, msg.episodes,
        msg.tokens_generated, msg.tokens_per_second, msg.mean_reward, msg.in_flight,
        msg.engine_fingerprint, msg.shipped)


def evaluation_to_proto(e: Evaluation) -> pb.EvaluateResponse:
    return pb.EvaluateResponse(policy_version=e.policy_version, tasks=e.tasks,
                               greedy_success=e.greedy_success,
                               sampled_success=e.sampled_success, seconds=e.seconds)


def evaluation_from_proto(msg: pb.EvaluateResponse) -> Evaluation:
    return Evaluation(msg.policy_version, msg.tasks, msg.greedy_success, msg.sampled_success,
                      msg.seconds)
