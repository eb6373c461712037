"""Generated gRPC code is committed; it must match a fresh generation from the .proto files."""
from __future__ import annotations

from kiln.protos.generate import PROTO_DIR, generate_to_temp


def test_generated_code_is_current():
    fresh = generate_to_temp()
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            name = proto.stem + suffix
            committed = PROTO_DIR / name
            assert committed.exists(), f"{name} missing: run python -m kiln.protos.generate"
            assert committed.read_text() == fresh[name], f"{name} is stale: run python -m kiln.protos.generate"
    stray = {p.name for p in PROTO_DIR.glob("*_pb2*.py*")} - set(fresh)
    assert not stray, f"generated files without a .proto: {sorted(stray)}"


def test_trajectory_message_round_trips():
    from kiln.protos.kiln.v1 import trajectory_pb2 as pb

    msg = pb.Trajectory(id="t1", tokens=[1, 2, 3], loss_mask=[0, 1, 1], logp_infer=[0.0, -0.5, -1.25],
                        version_spans=[pb.VersionSpan(start=1, end=3, policy_version=7)])
    msg.reward_parts["answer"] = 1.0
    back = pb.Trajectory.FromString(msg.SerializeToString())
    assert back == msg
    assert list(back.logp_infer) == [0.0, -0.5, -1.25]
    assert back.version_spans[0].policy_version == 7


def test_control_records_match_the_wire():
    """kiln.control's torch-free records and kiln.v1's messages agree: enum values and a round
    trip through the converters every service and the operator use."""
    from dataclasses import fields

    from kiln.control import BufferStatus, ModeRequest, RolloutMode, RolloutStatus, TrainerStatus
    from kiln.control import wire as control
    from kiln.metrics import StepMetrics
    from kiln.protos.kiln.v1 import rollout_pb2 as rpb

    assert {m.name: int(m) for m in RolloutMode} == dict(rpb.RolloutMode.items())
    mode = ModeRequest(RolloutMode.EXPLORE, "rl", ["a", "b"], 8, True, 64, 3)
    assert control.mode_from_proto(control.mode_to_proto(mode)) == mode
    status = TrainerStatus(step=4, policy_version=4, stage="rl",
                           last_step=StepMetrics(step=4, loss=0.5, reward_mean=0.25,
                                                 staleness={0: 6, 2: 2}),
                           stage_step=2, stage_max_steps=10, message="ok")
    assert control.trainer_status_from_proto(control.trainer_status_to_proto(status)) == status
    # Every field set to a value of its own, so a converter that drops or swaps one fails.
    rollout = RolloutStatus(**{f.name: (RolloutMode.EXPLORE if f.name == "mode" else
                                        f"s{i}" if f.type == "str" else
                                        i + 0.5 if f.type == "float" else i)
                               for i, f in enumerate(fields(RolloutStatus), 1)})
    assert control.rollout_status_from_proto(control.rollout_status_to_proto(rollout)) == rollout
    buffer = BufferStatus(**{f.name: (i + 0.5 if f.type == "float" else i)
                             for i, f in enumerate(fields(BufferStatus), 1)})
    assert control.buffer_status_from_proto(control.buffer_status_to_proto(buffer)) == buffer
    buffer.tau = None
    assert control.buffer_status_from_proto(control.buffer_status_to_proto(buffer)) == buffer
