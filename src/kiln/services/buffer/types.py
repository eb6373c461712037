"""The buffer's configuration, errors and results: what its callers see, with no logic.

Errors say whether retrying helps: `InvalidTrajectory` never does (the record is wrong),
`BufferFull` does after a backoff (the trainer drains the buffer).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kiln.services.common import codec
from kiln.trajectory import Trajectory


class BufferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity: int = Field(4096, ge=1)
    """Unconsumed trajectories (waiting or leased) at which new groups are refused
    (spec.buffer.capacity)."""
    capacity_bytes: int = Field(1 << 30, ge=1)
    """Unconsumed bytes (serialized trajectories, all held in memory) at which new groups are
    refused (spec.buffer.capacityBytes): a count alone lets a few huge records fill the RAM."""
    group_size: int = Field(1, ge=1)
    """Default samples per group (the RL stage's groupSize; 1 for SFT)."""
    tau: int | None = Field(None, ge=0)
    """Freshness bound (the RL stage's tau); None disables freshness control."""
    lease_timeout: float = Field(300.0, gt=0)
    """Seconds a served batch may go unacknowledged before it is served again. Longer than a
    training step, or a slow step sees its batch served twice."""
    segment_bytes: int = Field(64 << 20, ge=1)
    side_log_bytes: int = Field(8 << 20, ge=1)


class InvalidTrajectory(ValueError):
    """A record the buffer will never accept; retrying the same Put does not help."""

    def __init__(self, trajectory_id: str, reason: str) -> None:
        super().__init__(f"trajectory {trajectory_id!r} rejected: {reason}")
        self.trajectory_id = trajectory_id
        self.reason = reason


class BufferFull(Exception):
    """The buffer is at capacity; retry after a backoff (the trainer drains it)."""


@dataclass
class PutResult:
    accepted: int
    duplicates: int
    dropped_stale: int
    depth: int


@dataclass
class Batch:
    """A leased batch of whole groups (never part of one: the trainer takes each group's
    advantages over the batch, `kiln.services.trainer.advantages`). The trajectories stay in
    the form they were put in (`payloads`, serialized `kiln.v1.Trajectory`) until a consumer
    decodes them."""

    payloads: list[bytes]
    batch_id: int
    """1, 2, ... in order of first service; 0 for an empty batch."""
    policy_version: int
    """The trainer version the batch was served at; staleness is measured against it."""
    staleness: list[int] = field(default_factory=list)
    """policy_version minus each trajectory's oldest token version, in order."""
    delivery: int = 0
    """1 on first service of `batch_id`, 2 and up when served again; 0 for an empty batch."""

    @functools.cached_property
    def trajectories(self) -> list[Trajectory]:
        """The decoded trajectories (decoded once, on first access)."""
        return [codec.from_bytes(payload) for payload in self.payloads]

    def __len__(self) -> int:
        return len(self.payloads)


