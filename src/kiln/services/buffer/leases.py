"""Leases on served batches: which batches are out with the trainer, when each may be served
again, and what an acknowledgement of a batch id means.

A served batch is leased, not consumed: its groups leave the ready pool and sit in a `Lease`
under a batch id until the trainer acknowledges it (then `buffer.py` consumes them) or the lease
ends without an ack. A lease is *due* (may be served again) once its deadline has passed: the
lease timeout after its last delivery, or at once for a lease recovered after a restart, since
the process that handed it out, and any answer it was sending, are gone. A due lease is served
again under the same batch id, so a trainer that did train on it can recognise the duplicate,
ack it and skip it.

A batch id leaves the table in one of two ways: acked, or released (its groups were dropped, or
returned to the pool because the batch no longer fit the requested size). Released ids are
remembered with the reason, so that an ack can say which case it met; any other id at or below
the last one issued was acked.

Side-log events about leases: `leased` (batch, version, delivery, group keys; written at every
delivery), `acked` (written by buffer.py with the consumed ids), `released` (batch, reason) and
the `groups` of a `dropped` event, which leave their lease. `LeaseTable.replay` reads them back.

Pure bookkeeping, no I/O and no locking: `buffer.py` holds the lock and writes the events. Not
covered: freshness (groups.py) and what is durable (store.py).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kiln.freshness import staleness
from kiln.services.buffer import groups as G


class AckStatus(enum.Enum):
    """Outcome of an ack; the values are those of `kiln.v1.AckStatus`."""

    ACKED = 1
    """The batch's trajectories are now consumed."""
    ALREADY_ACKED = 2
    """An earlier ack consumed them; nothing changed."""
    UNKNOWN = 3
    """No batch with this id was ever served; nothing changed."""
    RELEASED = 4
    """The lease ended without an ack and the id will not be served again (dropped or returned
    to the pool); nothing changed."""


@dataclass
class AckResult:
    status: AckStatus
    trajectories: int = 0
    """Consumed by this ack (0 unless ACKED)."""
    detail: str = ""


@dataclass
class Lease:
    batch_id: int
    groups: list[G.Group]
    version: int
    """Trainer version the batch was last served at (its staleness is measured against it)."""
    delivery: int
    """1 on first service, 2 and up when served again."""
    deadline: float
    """time.monotonic() after which the batch may be served again; -inf once due."""

    @property
    def entries(self) -> list[G.Entry]:
        return [e for g in self.groups for e in g.members]

    @property
    def count(self) -> int:
        return sum(len(g.members) for g in self.groups)

    def staleness(self) -> list[int]:
        return [staleness(self.version, e.oldest_version) for e in self.entries]


@dataclass
class LeaseTable:
    open: dict[int, Lease] = field(default_factory=dict)
    released: dict[int, str] = field(default_factory=dict)
    """Batch id -> why its lease ended without an ack."""
    last_id: int = 0
    """Highest batch id ever issued (durable through the `leased` events and snapshots)."""
    acked: int = 0
    redeliveries: int = 0
    _holder: dict[str, int] = field(default_factory=dict)
    """Group key -> batch id of the open lease holding it."""
    _replayed: dict[int, tuple[int, int, list[str]]] = field(default_factory=dict)
    """During recovery, open leases by batch id: (version, delivery, group keys)."""

    # ---------------------------------------------------------------------------------- recovery

    def replay(self, ev: dict) -> None:
        """Apply one side-log event (of any type) during recovery; `attach` ends it."""
        kind = ev["t"]
        if kind == "snapshot":
            self.last_id, self.acked = ev["last_batch"], ev["batches_acked"]
            self.redeliveries = ev["redeliveries"]
            self.released.update((int(k), v) for k, v in ev["released"].items())
            self._replayed = {s["batch"]: (s["version"], s["delivery"], list(s["groups"]))
                              for s in ev["leases"]}
        elif kind == "leased":
            self._replayed[ev["batch"]] = (ev["version"], ev["delivery"], list(ev["groups"]))
            self.last_id = max(self.last_id, ev["batch"])
            self.redeliveries += ev["delivery"] > 1
        elif kind == "acked":
            self._replayed.pop(ev["batch"], None)
            self.acked += 1
        elif kind == "released":
            self._replayed.pop(ev["batch"], None)
            self.released[ev["batch"]] = ev["reason"]
        elif kind == "dropped":
            gone = set(ev["groups"])
            for batch, (_, _, keys) in list(self._replayed.items()):
                keys[:] = [k for k in keys if k not in gone]
                if not keys:
                    del self._replayed[batch]
                    self.released[batch] = ev["reason"]

    def attach(self, ready: dict[str, G.Group], where: str) -> None:
        """End recovery: move each open lease's groups out of `ready` (the complete groups the
        segments rebuilt) into it. They are all due at once: whoever held them went away with
        the old process."""
        for batch in sorted(self._replayed):
            version, delivery, keys = self._replayed[batch]
            missing = [k for k in keys if k not in ready]
            if missing:
                raise ValueError(
                    f"{where}: batch {batch} is leased but its group {missing[0]!r} is not "
                    "stored complete; the side log and the segments disagree (restarting will "
                    "not help)")
            self.add(Lease(batch, [ready.pop(k) for k in keys], version, delivery, -math.inf))
        self._replayed = {}

    # -------------------------------------------------------------------------------- operation

    def add(self, lease: Lease) -> None:
        assert lease.batch_id not in self.open and lease.groups
        self.open[lease.batch_id] = lease
        self.last_id = max(self.last_id, lease.batch_id)
        for g in lease.groups:
            self._holder[g.key] = lease.batch_id

    def peek_group(self, key: str) -> G.Group | None:
        """The leased group `key`, left where it is (None if no lease holds it)."""
        batch_id = self._holder.get(key)
        if batch_id is None:
            return None
        return next(g for g in self.open[batch_id].groups if g.key == key)

    def take_group(self, key: str, reason: str) -> G.Group | None:
        """Remove group `key` from the lease holding it (None if none does). A lease left without
        groups is released with `reason`."""
        batch_id = self._holder.pop(key, None)
        if batch_id is None:
            return None
        lease = self.open[batch_id]
        group = next(g for g in lease.groups if g.key == key)
        lease.groups.remove(group)
        if not lease.groups:
            del self.open[batch_id]
            self.released[batch_id] = reason
        return group

    def end(self, batch_id: int, released: str | None = None) -> Lease:
        """Close an open lease: acked (`released` None) or released for that reason."""
        lease = self.open.pop(batch_id)
        for g in lease.groups:
            del self._holder[g.key]
        if released is None:
            self.acked += 1
        else:
            self.released[batch_id] = released
        return lease

    def due(self, now: float) -> list[Lease]:
        """Open leases that may be served again, oldest batch first."""
        return sorted((le for le in self.open.values() if le.deadline <= now),
                      key=lambda le: le.batch_id)

    def seconds_to_next_due(self, now: float) -> float | None:
        """Until the earliest open lease falls due (0 if one is due); None with no open lease."""
        if not self.open:
            return None
        return max(0.0, min(le.deadline for le in self.open.values()) - now)

    def status_of_closed(self, batch_id: int) -> AckResult:
        """What an ack of `batch_id`, which has no open lease, finds."""
        assert batch_id not in self.open
        if batch_id in self.released:
            why = self.released[batch_id]
            return AckResult(AckStatus.RELEASED, 0, f"batch {batch_id} was released without an "
                             f"ack ({why}); its trajectories are not consumed by this ack")
        if 1 <= batch_id <= self.last_id:
            return AckResult(AckStatus.ALREADY_ACKED, 0, f"batch {batch_id} was already acked")
        return AckResult(AckStatus.UNKNOWN, 0, f"no batch {batch_id} was ever served "
                         f"(batch ids so far: 1..{self.last_id})")

    @property
    def trajectories(self) -> int:
        return sum(le.count for le in self.open.values())

    @staticmethod
    def leased_event(lease: Lease) -> dict:
        return {"t": "leased", "batch": lease.batch_id, "version": lease.version,
                "delivery": lease.delivery, "groups": [g.key for g in lease.groups]}

    def to_json(self) -> dict:
        """The table as it goes into a side-log snapshot (deadlines are not kept: after a
        restart every lease is due)."""
        return {
            "last_batch": self.last_id, "batches_acked": self.acked,
            "redeliveries": self.redeliveries,
            "released": {str(k): v for k, v in self.released.items()},
            "leases": [{"batch": le.batch_id, "version": le.version, "delivery": le.delivery,
                        "groups": [g.key for g in le.groups]}
                       for le in sorted(self.open.values(), key=lambda le: le.batch_id)],
        }
