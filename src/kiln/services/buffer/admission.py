"""Which trajectories of a Put the buffer takes: the rules at its door, checked before anything
is written.

All or nothing: every record of a Put is decoded once and validated (`Trajectory.check`, a
group that is not already complete, one group size per group) before any is stored;
`InvalidTrajectory` names the first bad one. Then, in order:
- idempotence: an id seen before (stored, served or dropped) is acknowledged as a duplicate and
  not stored again, so a client may retry any Put;
- backpressure: when the unconsumed count (waiting plus leased) has reached capacity, or their
  bytes with the Put's would pass the byte capacity, a Put that would start a new group is
  refused (`BufferFull`, retryable). Members of groups already started are always taken:
  refusing them could leave the buffer full of incomplete groups that can never be served. A
  Put bigger than the whole byte capacity can never be taken (ValueError);
- freshness on arrival: a stale member condemns its whole group (see groups.py), and a member
  of a group dropped earlier is dropped with it.

The checks here only read the index; `buffer.py` applies the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kiln.freshness import is_stale
from kiln.services.buffer.index import BufferIndex
from kiln.services.buffer.types import BufferFull, InvalidTrajectory
from kiln.services.common import codec
from kiln.trajectory import Trajectory


@dataclass
class Arrival:
    trajectory: Trajectory
    """Decoded once, here; used for validation and the index entry."""
    key: str
    payload: bytes
    """The bytes as they were put: what the store keeps and batches serve."""


@dataclass
class PutPlan:
    keep: list[Arrival] = field(default_factory=list)
    """New, fresh trajectories to store."""
    doomed: dict[str, str] = field(default_factory=dict)
    """Group key -> reason, for groups that arriving members condemn (or that were dropped)."""
    arriving_doomed: list[Arrival] = field(default_factory=list)
    """New trajectories of doomed groups: recorded as dropped, never stored."""
    duplicates: int = 0

    @property
    def new(self) -> int:
        return len(self.keep) + len(self.arriving_doomed)


def decode(item: bytes | Trajectory, position: int) -> tuple[Trajectory, bytes]:
    """A Put item as (domain record, bytes to store). Bytes come from the wire and are kept as
    they are; a domain record (an in-process caller) is encoded once, as a client would."""
    if isinstance(item, Trajectory):
        try:
            return item, codec.to_bytes(item)
        except ValueError as exc:
            raise InvalidTrajectory(item.id, str(exc)) from None
    try:
        return codec.from_bytes(item), bytes(item)
    except ValueError as exc:
        raise InvalidTrajectory(f"<record {position} of the Put>", str(exc)) from None


def plan_put(index: BufferIndex, items: Sequence[bytes | Trajectory], size: int) -> PutPlan:
    """Validate a Put of `items` (group size `size`) against `index`; raises InvalidTrajectory
    or BufferFull, in which case nothing may be stored."""
    if size < 1:
        raise ValueError(f"group_size must be >= 1, got {size}")
    plan = PutPlan()
    arrivals: list[Arrival] = []
    seen: set[str] = set()
    in_put: dict[str, int] = {}
    for position, item in enumerate(items):
        traj, payload = decode(item, position)
        if traj.id in index.known or traj.id in seen:
            plan.duplicates += 1
            continue
        key = _check(index, traj, size, in_put)
        seen.add(traj.id)
        in_put[key] = in_put.get(key, 0) + 1
        arrivals.append(Arrival(traj, key, payload))
    starts_group = any(a.key not in index.pending and a.key not in index.dropped_keys
                       for a in arrivals)
    unconsumed = index.depth + index.leases.trajectories
    if starts_group and unconsumed >= index.config.capacity:
        raise BufferFull(f"buffer holds {unconsumed} unconsumed trajectories ({index.depth} "
                         f"waiting, {index.leases.trajectories} leased), its capacity "
                         f"({index.config.capacity}); retry after the trainer acks a batch")
    if starts_group:
        incoming = sum(len(a.payload) for a in arrivals)
        limit = index.config.capacity_bytes
        if incoming > limit:
            raise ValueError(f"trajectories: this Put holds {incoming} bytes, more than the "
                             f"buffer's whole byte capacity ({limit}, spec.buffer.capacityBytes)")
        held = index.unconsumed_bytes
        if held + incoming > limit:
            raise BufferFull(f"buffer holds {held} bytes of unconsumed trajectories; with this "
                             f"Put's {incoming} it would pass its byte capacity ({limit}); "
                             "retry after the trainer acks a batch")
    for a in arrivals:
        if a.key in index.dropped_keys:
            plan.doomed[a.key] = index.dropped_keys[a.key]
        elif is_stale(index.policy_version, a.trajectory.oldest_version, index.config.tau):
            plan.doomed[a.key] = "stale"
    for a in arrivals:
        (plan.arriving_doomed if a.key in plan.doomed else plan.keep).append(a)
    return plan


def _check(index: BufferIndex, traj: Trajectory, size: int, in_put: dict[str, int]) -> str:
    """The trajectory's group key, if the buffer can take it; else InvalidTrajectory."""
    try:
        traj.check()
    except ValueError as exc:
        raise InvalidTrajectory(traj.id, str(exc)) from None
    key = traj.group_key
    if size > 1 and not traj.group_id:
        raise InvalidTrajectory(traj.id, f"group_id is empty but the group size is {size}")
    if key in index.dropped_keys:
        return key
    if key in index.complete_keys:
        raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} already has all its members")
    pending = index.pending.get(key)
    if pending is not None and pending.size != size:
        raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} was started with group size "
                                         f"{pending.size}, this Put says {size}")
    have = (len(pending.members) if pending else 0) + in_put.get(key, 0)
    if have >= size:
        raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} would get more than its "
                                         f"{size} members")
    return key
