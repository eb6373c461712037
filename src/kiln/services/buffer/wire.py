"""Conversions between the buffer's domain types (`types.py`, `leases.py`) and `kiln.v1`
protobufs: the one place where the buffer's data-plane messages are built or read, by the
servicer and by the client alike. Its status is a control record, converted by
`kiln.control.wire`.

Trajectories cross as bytes (serialized `kiln.v1.Trajectory`): a batch carries the stored bytes
unchanged, and only its consumer decodes them (`Batch.trajectories`).
"""
from __future__ import annotations

from kiln.protos.kiln.v1 import buffer_pb2 as pb
from kiln.services.buffer.leases import AckResult, AckStatus
from kiln.services.buffer.types import Batch, PutResult

def batch_to_proto(b: Batch) -> pb.Batch:
    msg = pb.Batch(batch_id=b.batch_id, policy_version=b.policy_version, delivery=b.delivery)
    msg.trajectories.extend(b.payloads)
    msg.staleness.extend(b.staleness)
    return msg


def batch_from_proto(msg: pb.Batch) -> Batch:
    return Batch(list(msg.trajectories), msg.batch_id, msg.policy_version, list(msg.staleness),
                 msg.delivery)


def put_result_to_proto(r: PutResult) -> pb.PutResponse:
    return pb.PutResponse(accepted=r.accepted, duplicates=r.duplicates,
                          dropped_stale=r.dropped_stale, depth=r.depth)


def put_result_from_proto(msg: pb.PutResponse) -> PutResult:
    return PutResult(msg.accepted, msg.duplicates, msg.dropped_stale, msg.depth)


def ack_to_proto(r: AckResult) -> pb.AckBatchResponse:
    return pb.AckBatchResponse(status=r.status.value, trajectories=r.trajectories, detail=r.detail)


def ack_from_proto(msg: pb.AckBatchResponse) -> AckResult:
    return AckResult(AckStatus(msg.status), msg.trajectories, msg.detail)
