"""Conversion between the domain trajectory (`kiln.trajectory`) and its wire form (`kiln.v1`).

Every service that sends or receives trajectories goes through these two functions, so the
domain type and the proto cannot drift apart silently: the round-trip test in
tests/unit/test_codec.py fills every field of both.

Precision: the proto stores per-token log-probs (`logp_infer`, `teacher_logp`) as 32-bit floats,
the precision inference engines produce them in. A domain value that is not a float32 comes back
rounded to the nearest float32; every other field, and any float32 log-prob, round-trips exactly.
Integers the proto holds unsigned (tokens, mask, span bounds, versions) must be non-negative;
protobuf raises ValueError otherwise, naming the value, and retrying does not help.

Not covered here: validation of the record's internal consistency (that is `Trajectory.check`).
"""
from __future__ import annotations

from google.protobuf import message

from kiln.protos.kiln.v1 import trajectory_pb2
from kiln.routing import RoutedExperts
from kiln.trajectory import ToolChoice, Trajectory, VersionSpan


def span_to_proto(span: VersionSpan) -> trajectory_pb2.VersionSpan:
    return trajectory_pb2.VersionSpan(start=span.start, end=span.end,
                                     policy_version=span.policy_version)


def span_from_proto(msg: trajectory_pb2.VersionSpan) -> VersionSpan:
    return VersionSpan(start=msg.start, end=msg.end, policy_version=msg.policy_version)


def to_proto(traj: Trajectory) -> trajectory_pb2.Trajectory:
    """The wire form of `traj`. Raises ValueError for negative unsigned fields."""
    msg = trajectory_pb2.Trajectory(
        id=traj.id,
        task_id=traj.task_id,
        group_id=traj.group_id,
        env=traj.env,
        prompt_len=traj.prompt_len,
        reward=traj.reward,
        verifier_output=traj.verifier_output,
        shaping_reward=traj.shaping_reward,
        sandbox_image_digest=traj.sandbox_image_digest,
        engine_fingerprint=traj.engine_fingerprint,
        created_at=traj.created_at,
    )
    # extend() on repeated scalar fields copies in C; building Python lists of messages would
    # dominate the cost for long trajectories.
    msg.tokens.extend(traj.tokens)
    msg.loss_mask.extend(traj.loss_mask)
    msg.logp_infer.extend(traj.logp_infer)
    msg.shaping_mask.extend(traj.shaping_mask)
    msg.teacher_logp.extend(traj.teacher_logp)
    msg.teacher_top_k = traj.teacher_top_k
    msg.teacher_topk_ids.extend(traj.teacher_topk_ids)
    msg.teacher_topk_logp.extend(traj.teacher_topk_logp)
    msg.version_spans.extend(span_to_proto(s) for s in traj.version_spans)
    msg.reward_parts.update(traj.reward_parts)
    msg.flags.extend(traj.flags)
    msg.index_hashes.extend(traj.index_hashes)
    if traj.routed_experts is not None:
        r = traj.routed_experts
        msg.routed_experts.CopyFrom(trajectory_pb2.RoutedExperts(
            layers=r.layers, topk=r.topk, num_experts=r.num_experts, start=r.start, rows=r.rows,
            packed=r.packed, version_starts=[a for a, _ in r.versions], versions=[v for _, v in r.versions]))
    if traj.tool_choice is not None:
        c = traj.tool_choice
        msg.tool_choice.CopyFrom(trajectory_pb2.ToolChoice(
            positions=c.positions, token_ids=c.token_ids, counts=c.counts,
            temperatures=c.temperatures))
    return msg


def from_proto(msg: trajectory_pb2.Trajectory) -> Trajectory:
    """The domain form of `msg`. Does not validate it; call `.check()` where that matters."""
    # Slicing a repeated field copies it into a list in C, several times faster than list().
    return Trajectory(
        id=msg.id,
        task_id=msg.task_id,
        group_id=msg.group_id,
        tokens=msg.tokens[:],
        loss_mask=msg.loss_mask[:],
        logp_infer=msg.logp_infer[:],
        version_spans=[span_from_proto(s) for s in msg.version_spans],
        prompt_len=msg.prompt_len,
        reward=msg.reward,
        reward_parts=dict(msg.reward_parts),
        verifier_output=msg.verifier_output,
        flags=msg.flags[:],
        env=msg.env,
        sandbox_image_digest=msg.sandbox_image_digest,
        engine_fingerprint=msg.engine_fingerprint,
        index_hashes=msg.index_hashes[:],
        routed_experts=_routed_from_proto(msg),
        tool_choice=(ToolChoice(msg.tool_choice.positions[:], msg.tool_choice.token_ids[:],
                                msg.tool_choice.counts[:], msg.tool_choice.temperatures[:])
                     if msg.HasField("tool_choice") else None),
        teacher_logp=msg.teacher_logp[:],
        teacher_top_k=msg.teacher_top_k,
        teacher_topk_ids=msg.teacher_topk_ids[:],
        teacher_topk_logp=msg.teacher_topk_logp[:],
        shaping_reward=msg.shaping_reward,
        shaping_mask=msg.shaping_mask[:],
        created_at=msg.created_at,
    )


def _routed_from_proto(msg: trajectory_pb2.Trajectory) -> RoutedExperts | None:
    if not msg.HasField("routed_experts"):
        return None
    r = msg.routed_experts
    if len(r.version_starts) != len(r.versions):
        raise ValueError(f"routed experts: {len(r.version_starts)} version starts but "
                         f"{len(r.versions)} versions")
    return RoutedExperts(layers=r.layers, topk=r.topk, num_experts=r.num_experts, start=r.start,
                         rows=r.rows, packed=r.packed,
                         versions=tuple(zip(r.version_starts, r.versions)))


def to_bytes(traj: Trajectory) -> bytes:
    """The serialized wire form: what a buffer Put carries and stores for each trajectory."""
    return to_proto(traj).SerializeToString()


def from_bytes(data: bytes) -> Trajectory:
    """Decode a serialized `kiln.v1.Trajectory`; ValueError for bytes that are not one
    (protobuf's own DecodeError is not a ValueError)."""
    try:
        msg = trajectory_pb2.Trajectory.FromString(data)
    except message.DecodeError as exc:
        raise ValueError(f"not a serialized kiln.v1.Trajectory: {exc}") from None
    return from_proto(msg)
