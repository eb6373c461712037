"""The trainer's status as it crosses the wire: the record (`kiln.control`) and its protobuf
converters (`kiln.protos.control`, shared with the operator), used by the servicer and by the
client alike."""
from __future__ import annotations

from kiln.control import TrainerStatus
from kiln.protos.control import trainer_status_from_proto as status_from_proto
from kiln.protos.control import trainer_status_to_proto as status_to_proto

__all__ = ["TrainerStatus", "status_from_proto", "status_to_proto"]
