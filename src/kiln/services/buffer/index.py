"""The buffer's in-memory index: which trajectories are known, waiting, grouped, leased, dropped.

`BufferIndex` holds the state that `TrajectoryBuffer` guards with its lock and that a restart
rebuilds from the store (`replay`): the ids ever seen, incomplete groups, complete groups ready
to serve, the leases on served batches, the keys of dropped groups, the trainer's policy
version and the lifetime counters. Stored trajectories stay serialized (`groups.Entry.payload`).

Every change that must survive a restart is written to the side log first, through the `log`
function the caller passes (`TrajectoryStore.log_event`, which fsyncs), and applied to memory
only once that write returned: a failed write changes nothing.

Not covered: locking, waiting and acceptance rules (`buffer.py`, `admission.py`), the disk
format (`store.py`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from kiln.freshness import is_stale
from kiln.control.records import BufferStatus
from kiln.services.buffer import groups as G
from kiln.services.buffer.leases import LeaseTable
from kiln.services.buffer.store import Recovered
from kiln.services.buffer.types import BufferConfig
from kiln.services.common import codec, metrics

log = logging.getLogger("kiln.buffer")

LogFn = Callable[[dict[str, Any]], None]


def entry_of(payload: bytes) -> G.Entry:
    """The index entry of a stored trajectory (one decode of its bytes)."""
    traj = codec.from_bytes(payload)
    return G.Entry(traj.id, traj.group_key, traj.oldest_version, payload)


class BufferIndex:
    def __init__(self, config: BufferConfig) -> None:
        self.config = config.model_copy()
        self.known: set[str] = set()
        """Every id ever accepted or dropped on arrival: a Put of one is a duplicate."""
        self.pending: dict[str, G.Group] = {}
        self.ready = G.GroupPool()
        self.complete_keys: set[str] = set()
        self.dropped_keys: dict[str, str] = {}
        """Group key -> why the group was dropped; late members are dropped on arrival."""
        self.leases = LeaseTable()
        self.seq = 0
        self.policy_version = 0
        self.served = self.dropped_stale = self.dropped_other = 0
        self.max_staleness = -1
        self.config_set = False
        """True once a Configure call (durable) has overridden the start-up config."""
        self._unconsumed_bytes = 0
        """Bytes of the stored members of every group not consumed, kept as entries are filed,
        dropped and consumed: a scan on every Put cost the buffer most of its CPU once it
        held thousands of trajectories (a full buffer during SFT)."""

    # ----------------------------------------------------------------------------- recovery

    def replay(self, rec: Recovered, where: str) -> None:
        """Rebuild the index from what the store recovered (events, then unconsumed records)."""
        for ev in rec.events:
            self.leases.replay(ev)
            kind = ev["t"]
            if kind == "snapshot":
                self.policy_version = ev["version"]
                if ev.get("config_set"):
                    self.config.group_size, self.config.tau = ev["group_size"], ev["tau"]
                self.served = ev["served"]
                self.dropped_stale, self.dropped_other = ev["dropped_stale"], ev["dropped_other"]
                self.max_staleness = ev["max_staleness"]
                self.complete_keys.update(ev["complete_groups"])
                self.dropped_keys.update(ev["dropped_groups"])
                self.config_set = bool(ev.get("config_set"))
            elif kind == "acked":
                self.served += len(ev["consumed"])
                self.max_staleness = max(self.max_staleness, ev["max_staleness"])
                self.complete_keys.update(ev["groups"])
            elif kind == "dropped":
                if ev["reason"] == "stale":
                    self.dropped_stale += len(ev["consumed"])
                else:
                    self.dropped_other += len(ev["consumed"])
                self.dropped_keys.update(dict.fromkeys(ev["groups"], ev["reason"]))
            elif kind == "version":
                self.policy_version = ev["version"]
            elif kind == "config":
                # A Configure call is newer intent than the job file the process started with.
                self.config.group_size, self.config.tau = ev["group_size"], ev["tau"]
                self.config_set = True
            elif kind not in ("leased", "released"):  # leases only
                raise ValueError(f"{where}: unknown event type {kind!r}")
        self.known = set(rec.consumed)
        for record in rec.records:
            entry = entry_of(record.trajectory)
            self.known.add(entry.id)
            self.add_entry(entry, record.group_size)
        self.leases.attach(self.ready, where)

    # -------------------------------------------------------------------------------- groups

    def add_entry(self, entry: G.Entry, size: int) -> None:
        """File a stored trajectory into its group; a group that completes becomes ready."""
        group = self.pending.get(entry.group_key)
        if group is None:
            self.seq += 1
            group = self.pending[entry.group_key] = G.Group(entry.group_key, size, self.seq)
        group.members.append(entry)
        self._unconsumed_bytes += len(entry.payload)
        if group.complete:
            del self.pending[entry.group_key]
            self.ready[entry.group_key] = group
            self.complete_keys.add(entry.group_key)

    def sweep(self, log_event: LogFn) -> None:
        """Drop every waiting group that is stale at the current policy version. Leased groups
        are left alone (the trainer may be training on them); they are judged again if and
        when they are served again."""
        stale = [g for g in [*self.pending.values(), *self.ready.values()]
                 if is_stale(self.policy_version, g.oldest_version, self.config.tau)]
        if stale:
            self.drop({g.key: "stale" for g in stale}, [], log_event)

    def drop(self, doomed: dict[str, str], arriving: list[tuple[str, str]],
             log_event: LogFn) -> int:
        """Drop every stored member of the `doomed` groups (key -> reason), waiting or leased,
        and the `arriving` (id, key) pairs, which were never stored. A lease left without
        groups is released. Returns how many were dropped as stale."""
        pairs = list(arriving)
        for key in doomed:
            group = self.pending.get(key) or self.ready.get(key) or self.leases.peek_group(key)
            if group is not None:
                pairs.extend((e.id, key) for e in group.members)
                self._unconsumed_bytes -= sum(len(e.payload) for e in group.members)
        stale_n = 0
        for reason in sorted(set(doomed.values())):
            members = [tid for tid, key in pairs if doomed[key] == reason]
            keys = [k for k, r in doomed.items() if r == reason and k not in self.dropped_keys]
            # One event per reason keeps the counters exact on replay.
            log_event({"t": "dropped", "reason": reason, "consumed": members, "groups": keys})
            if reason == "stale":
                self.dropped_stale += len(members)
                stale_n += len(members)
                metrics.DROPPED_STALE.inc(len(members))
            else:
                self.dropped_other += len(members)
        self.known.update(tid for tid, _ in arriving)
        for key, reason in doomed.items():
            self.pending.pop(key, None)
            self.ready.pop(key, None)
            self.dropped_keys.setdefault(key, reason)
            # Replay does the same on reading the event's "groups".
            self.leases.take_group(key, reason)
        return stale_n

    def unserved_groups(self) -> list[G.Group]:
        """Every group not consumed: waiting, ready and leased."""
        held = [g for lease in self.leases.open.values() for g in lease.groups]
        return [*self.pending.values(), *self.ready.values(), *held]

    # ---------------------------------------------------------------------------- bookkeeping

    @property
    def depth(self) -> int:
        """Stored and waiting to be served (not leased, consumed nor dropped)."""
        return sum(len(g.members) for g in self.pending.values()) + self.ready.members

    @property
    def unconsumed_bytes(self) -> int:
        """Bytes of every stored trajectory not consumed (waiting, ready and leased)."""
        return self._unconsumed_bytes

    def consumed(self, entries: list[G.Entry]) -> None:
        """`entries` (an acked lease's) are consumed: they no longer hold capacity."""
        self.served += len(entries)
        self._unconsumed_bytes -= sum(len(e.payload) for e in entries)

    def update_gauges(self) -> None:
        metrics.BUFFER_DEPTH.set(self.depth)
        metrics.BUFFER_BYTES.set(self.unconsumed_bytes)
        metrics.BUFFER_LEASED.set(self.leases.trajectories)
        metrics.POLICY_VERSION.labels("buffer").set(self.policy_version)

    def snapshot_state(self) -> dict[str, Any]:
        """What a side-log snapshot must hold to rebuild this index (with the segments)."""
        return {
            "version": self.policy_version, "config_set": self.config_set,
            "group_size": self.config.group_size, "tau": self.config.tau,
            "served": self.served,
            "dropped_stale": self.dropped_stale, "dropped_other": self.dropped_other,
            "max_staleness": self.max_staleness,
            "complete_groups": sorted(self.complete_keys),
            "dropped_groups": self.dropped_keys,
            **self.leases.to_json(),
        }

    def status(self) -> BufferStatus:
        return BufferStatus(
            depth=self.depth, ready=self.ready.members, groups_pending=len(self.pending),
            groups_ready=len(self.ready), accepted=len(self.known), served=self.served,
            dropped_stale=self.dropped_stale, dropped_other=self.dropped_other,
            batches=self.leases.last_id, max_staleness=self.max_staleness,
            policy_version=self.policy_version, capacity=self.config.capacity,
            unconsumed_bytes=self.unconsumed_bytes, capacity_bytes=self.config.capacity_bytes,
            group_size=self.config.group_size, tau=self.config.tau,
            leased=self.leases.trajectories, leases=len(self.leases.open),
            batches_acked=self.leases.acked, redeliveries=self.leases.redeliveries,
            lease_timeout=self.config.lease_timeout)
