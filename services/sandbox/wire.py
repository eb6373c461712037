"""Conversions between the sandbox service's domain types and `kiln.v1` protobufs: episodes of
the Environment API (`kiln.episode`) and the Sandbox API's limits. Used by the servicers and by
the client alike."""
from __future__ import annotations

from kiln.episode import Demonstration, EpisodeInfo, StepResult
from kiln.protos.kiln.v1 import env_pb2, sandbox_pb2
from kiln.services.sandbox.config import SandboxLimits


def episode_to_proto(e: EpisodeInfo) -> env_pb2.Episode:
    return env_pb2.Episode(episode_id=e.episode_id, task_id=e.task_id, env=e.env,
                           prompt=e.prompt, stop=e.stop)


def episode_from_proto(msg: env_pb2.Episode) -> EpisodeInfo:
    return EpisodeInfo(msg.episode_id, msg.task_id, msg.env, msg.prompt, list(msg.stop))


def step_to_proto(r: StepResult) -> env_pb2.StepResult:
    return env_pb2.StepResult(observation=r.observation, done=r.done, reward=r.reward,
                              reward_parts=r.reward_parts, verifier_output=r.verifier_output,
                              flags=r.flags, sandbox_image_digest=r.sandbox_image_digest)


def step_from_proto(msg: env_pb2.StepResult) -> StepResult:
    return StepResult(msg.observation, msg.done, msg.reward, dict(msg.reward_parts),
                      msg.verifier_output, list(msg.flags), msg.sandbox_image_digest)


def demonstration_to_proto(d: Demonstration) -> env_pb2.Demonstration:
    return env_pb2.Demonstration(
        task_id=d.task_id, reward=d.reward, verifier_output=d.verifier_output,
        segments=[env_pb2.Segment(text=t, trained=tr) for t, tr in d.segments])


def demonstration_from_proto(msg: env_pb2.Demonstration) -> Demonstration:
    return Demonstration(msg.task_id, [(s.text, s.trained) for s in msg.segments], msg.reward,
                         msg.verifier_output)


def limits_from_proto(msg: sandbox_pb2.Limits, defaults: SandboxLimits) -> SandboxLimits:
    """Requested limits; zero fields keep `defaults`."""
    data = defaults.model_dump()
    for field in ("memory_bytes", "pids", "cpu", "timeout_seconds", "output_limit_bytes"):
        value = getattr(msg, field)
        if value:
            data[field] = value
    data["network"] = msg.network
    return SandboxLimits(**data)
