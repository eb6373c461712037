"""The control floor: what a stage driver tells the trainer and rollout and reads back from
them and the buffer (`records`), its protobuf form (`wire`), one client per control-plane
service (`clients`), how channels are opened (`channels`) and what a failed call means
(`retry`). On the ground floor, free of torch, so that `kiln run`, the operator and the services
share it; the records are re-exported here, as `kiln.control.X`.
"""
from kiln.control.records import (BufferControl, BufferStatus, BufferView, Evaluation, ModeRequest,
                                  RolloutControl, RolloutMode, RolloutScaler, RolloutStatus,
                                  TrainerControl, TrainerStatus, combined_status)

__all__ = ["BufferControl", "BufferStatus", "BufferView", "Evaluation", "ModeRequest",
           "RolloutControl", "RolloutMode", "RolloutScaler", "RolloutStatus", "TrainerControl",
           "TrainerStatus", "combined_status"]
