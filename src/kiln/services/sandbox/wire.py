"""Conversions between the sandbox service's domain types and `kiln.v1` protobufs: episodes of
the Environment API (`kiln.episode`, `kiln.env`) and the Sandbox API's limits. Used by the
servicers and by the client alike."""
from __future__ import annotations

import json

from kiln.env import ToolCall, ToolSpec
from kiln.episode import Action, Demonstration, EpisodeInfo, Message, StepResult, ToolOutput, Turn
from kiln.protos.kiln.v1 import env_pb2 as pb
from kiln.protos.kiln.v1 import sandbox_pb2
from kiln.services.sandbox.config import SandboxLimits


def _tool_spec_to(t: ToolSpec) -> pb.ToolSpec:
    return pb.ToolSpec(name=t.name, description=t.description,
                       parameters_json=json.dumps(t.parameters))


def _tool_spec_from(msg: pb.ToolSpec) -> ToolSpec:
    return ToolSpec(msg.name, msg.description, json.loads(msg.parameters_json or "{}"))


def _call_to(c: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json())


def _call_from(msg: pb.ToolCall) -> ToolCall:
    try:
        args = json.loads(msg.arguments_json or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {msg.name!r}: arguments_json is not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {msg.name!r}: arguments_json must be a JSON object")
    return ToolCall(msg.name, args, msg.id)


def _output_to(o: ToolOutput) -> pb.ToolOutput:
    return pb.ToolOutput(tool_call_id=o.tool_call_id, name=o.name, content=o.content)


def _output_from(msg: pb.ToolOutput) -> ToolOutput:
    return ToolOutput(msg.tool_call_id, msg.name, msg.content)


def episode_to_proto(e: EpisodeInfo) -> pb.Episode:
    return pb.Episode(episode_id=e.episode_id, task_id=e.task_id, env=e.env,
                      messages=[pb.Message(role=m.role, content=m.content) for m in e.messages],
                      tools=[_tool_spec_to(t) for t in e.tools])


def episode_from_proto(msg: pb.Episode) -> EpisodeInfo:
    return EpisodeInfo(msg.episode_id, msg.task_id, msg.env,
                       [Message(m.role, m.content) for m in msg.messages],
                       [_tool_spec_from(t) for t in msg.tools])


def action_to_proto(episode_id: str, a: Action) -> pb.StepRequest:
    return pb.StepRequest(episode_id=episode_id, tool_calls=[_call_to(c) for c in a.tool_calls],
                          content=a.content, unparseable=a.unparseable, problem=a.problem)


def action_from_proto(msg: pb.StepRequest) -> Action:
    return Action([_call_from(c) for c in msg.tool_calls], msg.content, msg.unparseable,
                  msg.problem)


def step_to_proto(r: StepResult) -> pb.StepResult:
    return pb.StepResult(outputs=[_output_to(o) for o in r.outputs], done=r.done, reward=r.reward,
                         reward_parts=r.reward_parts, verifier_output=r.verifier_output,
                         flags=r.flags, sandbox_image_digest=r.sandbox_image_digest,
                         answer=r.answer, reference=r.reference,
                         tools=pb.ToolNames(names=r.tools) if r.tools is not None else None)


def step_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult([_output_from(o) for o in msg.outputs], msg.done, msg.reward,
                      dict(msg.reward_parts), msg.verifier_output, list(msg.flags),
                      msg.sandbox_image_digest, msg.answer, msg.reference,
                      list(msg.tools.names) if msg.HasField("tools") else None)


def demonstration_to_proto(d: Demonstration) -> pb.Demonstration:
    return pb.Demonstration(
        task_id=d.task_id, messages=[pb.Message(role=m.role, content=m.content) for m in d.messages],
        tools=[_tool_spec_to(t) for t in d.tools],
        turns=[pb.DemoTurn(content=t.content, tool_calls=[_call_to(c) for c in t.tool_calls],
                           outputs=[_output_to(o) for o in t.outputs]) for t in d.turns],
        reward=d.reward, verifier_output=d.verifier_output)


def demonstration_from_proto(msg: pb.Demonstration) -> Demonstration:
    return Demonstration(
        msg.task_id, [Message(m.role, m.content) for m in msg.messages],
        [_tool_spec_from(t) for t in msg.tools],
        [Turn(t.content, [_call_from(c) for c in t.tool_calls], [_output_from(o) for o in t.outputs])
         for t in msg.turns],
        msg.reward, msg.verifier_output)


def limits_from_proto(msg: sandbox_pb2.Limits, defaults: SandboxLimits) -> SandboxLimits:
    """Requested limits, capped at `defaults` (the job's spec.sandbox: a caller may ask for
    less, never for more); zero fields keep `defaults`. Network only where the job allows it."""
    data = defaults.model_dump()
    for field in ("memory_bytes", "pids", "cpu", "timeout_seconds", "output_limit_bytes",
                  "disk_bytes"):
        value = getattr(msg, field)
        if value:
            data[field] = min(value, data[field])
    data["network"] = msg.network and defaults.network
    return SandboxLimits(**data)
