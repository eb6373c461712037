"""The rollout service's control API as it crosses the wire: the mode a driver sets, the status
and evaluation results it reads (`kiln.control`), and their protobuf converters
(`kiln.protos.control`, shared with the operator, which drives stages too), used by the servicer
and by the client alike."""
from __future__ import annotations

from kiln.control import Evaluation, ModeRequest, RolloutMode, RolloutStatus
from kiln.protos.control import (evaluation_from_proto, evaluation_to_proto, mode_from_proto,
                                 mode_to_proto)
from kiln.protos.control import rollout_status_from_proto as status_from_proto
from kiln.protos.control import rollout_status_to_proto as status_to_proto

__all__ = ["Evaluation", "ModeRequest", "RolloutMode", "RolloutStatus", "evaluation_from_proto",
           "evaluation_to_proto", "mode_from_proto", "mode_to_proto", "status_from_proto",
           "status_to_proto"]
