"""The trajectory codec: domain <-> proto round trips keep every field, and the two types have
the same set of fields (so one cannot grow a field the other silently drops)."""
from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.protos.kiln.v1 import trajectory_pb2
from kiln.services.common import codec
from kiln.routing import RoutedExperts
from kiln.trajectory import ToolChoice, Trajectory, VersionSpan


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _full() -> Trajectory:
    """A trajectory with every field set to a non-default value."""
    return Trajectory(
        id="traj-1",
        task_id="task-7",
        group_id="grp-3",
        tokens=[5, 6, 7, 8, 9, 70000],
        loss_mask=[0, 0, 1, 1, 0, 1],
        logp_infer=[0.0, 0.0, -0.5, -1.25, 0.0, _f32(-3.1)],
        version_spans=[VersionSpan(2, 4, 3), VersionSpan(5, 6, 2**40)],
        prompt_len=2,
        reward=0.75,
        reward_parts={"correct": 1.0, "format": -0.25},
        verifier_output="ok\n",
        flags=["truncated", "exploit"],
        env="chain",
        sandbox_image_digest="sha256:abc",
        engine_fingerprint="vllm-0.32;seed=1",
        index_hashes=[2**63 + 5, 1],
        routed_experts=dataclasses.replace(
            RoutedExperts.pack([[[3, 1]], [[4, 0]], [[7, 2]]], num_experts=8, start=1),
            versions=((1, 2), (3, 2**40))),
        teacher_logp=[0.0, 0.0, -0.75, _f32(-0.1), 0.0, -2.0],
        teacher_top_k=2,
        teacher_topk_ids=[0, 0, 0, 0, 7, 70000, 8, 3, 0, 0, 9, 1],
        teacher_topk_logp=[0.0, 0.0, 0.0, 0.0, -0.5, -1.25, -0.125, -3.0, 0.0, 0.0, -0.25, -2.0],
        tool_choice=ToolChoice(positions=[3, 5], token_ids=[8, 9, 70000, 4], counts=[2, 2],
                               temperatures=[6.0, 1.5]),
        shaping_reward=0.5,
        shaping_mask=[0, 0, 1, 0, 0, 1],
        created_at=1764400000.5,
    )


def test_field_sets_match() -> None:
    domain = {f.name for f in dataclasses.fields(Trajectory)}
    wire = {f.name for f in trajectory_pb2.Trajectory.DESCRIPTOR.fields}
    assert domain == wire


def test_every_field_round_trips() -> None:
    traj = _full()
    msg = codec.to_proto(traj)
    # Every wire field is set (no field forgotten by to_proto).
    for field in trajectory_pb2.Trajectory.DESCRIPTOR.fields:
        assert getattr(msg, field.name), field.name
    back = codec.from_proto(msg)
    assert back == traj
    assert isinstance(back.version_spans[0], VersionSpan)
    assert codec.from_bytes(codec.to_bytes(traj)) == traj


def test_proto_round_trip_is_byte_identical() -> None:
    msg = codec.to_proto(_full())
    again = codec.to_proto(codec.from_proto(msg))
    assert again == msg
    assert again.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)


def test_empty_trajectory_round_trips() -> None:
    traj = Trajectory(id="", task_id="", group_id="", tokens=[], loss_mask=[], logp_infer=[],
                      version_spans=[])
    assert codec.from_proto(codec.to_proto(traj)) == traj


def test_logprobs_travel_as_float32() -> None:
    traj = _full()
    traj.logp_infer[2] = -0.1  # not representable in float32
    back = codec.from_proto(codec.to_proto(traj))
    assert back.logp_infer[2] == _f32(-0.1) != -0.1


def test_negative_unsigned_field_is_an_error() -> None:
    traj = _full()
    traj.tokens[0] = -1
    with pytest.raises(ValueError):
        codec.to_proto(traj)


_u32 = st.integers(0, 2**32 - 1)
_f32s = st.floats(width=32, allow_nan=False)


@st.composite
def _trajectories(draw: st.DrawFn) -> Trajectory:
    n = draw(st.integers(0, 20))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    versions = sorted(draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(cuts), max_size=len(cuts))))
    spans = [VersionSpan(a, b, v) for (a, b), v in zip(zip(cuts, cuts[1:]), versions) if a < b]
    return Trajectory(
        id=draw(st.text()), task_id=draw(st.text()), group_id=draw(st.text()),
        tokens=draw(st.lists(_u32, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        logp_infer=draw(st.lists(_f32s, min_size=n, max_size=n)),
        version_spans=spans,
        prompt_len=draw(_u32),
        reward=draw(st.floats(allow_nan=False)),
        reward_parts=draw(st.dictionaries(st.text(), st.floats(allow_nan=False), max_size=3)),
        verifier_output=draw(st.text()),
        flags=draw(st.lists(st.text(), max_size=3)),
        env=draw(st.text()),
        sandbox_image_digest=draw(st.text()),
        engine_fingerprint=draw(st.text()),
        index_hashes=draw(st.lists(st.integers(0, 2**64 - 1), max_size=4)),
        routed_experts=draw(st.none() | _routed()),
        teacher_logp=draw(st.lists(_f32s, max_size=n)),
        shaping_reward=draw(st.floats(allow_nan=False)),
        shaping_mask=draw(st.lists(st.integers(0, 1), max_size=n)),
        created_at=draw(st.floats(allow_nan=False)),
    )


@st.composite
def _routed(draw) -> RoutedExperts:
    experts = draw(st.integers(1, 300))
    rows, layers, topk = draw(st.integers(0, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ids = draw(st.lists(st.integers(0, experts - 1), min_size=rows * layers * topk,
                        max_size=rows * layers * topk))
    import numpy as np
    return RoutedExperts.pack(np.array(ids, dtype=np.int64).reshape(rows, layers, topk), experts,
                              start=draw(st.integers(0, 9)), version=draw(st.none() | st.integers(0, 2**64 - 1)))


@settings(max_examples=60, deadline=None)
@given(_trajectories())
def test_random_trajectories_round_trip(traj: Trajectory) -> None:
    assert codec.from_bytes(codec.to_bytes(traj)) == traj
