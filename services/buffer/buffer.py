"""The trajectory buffer's logic: acceptance, groups, freshness, leased serving, backpressure.

`TrajectoryBuffer` is what the gRPC servicer and the in-process client both wrap; it knows nothing
of gRPC. It is thread-safe (one lock; a Put holds it through its fsync, which keeps duplicate
detection exact) and `get_batch` blocks on a condition variable.

Rules, in the order a Put meets them:
- all or nothing: every record is validated (`Trajectory.check`, a finite reward, a group that
  is not already complete, one group size per group) before anything is written;
  `InvalidTrajectory` names the first bad id and the reason;
- idempotent: an id seen before (stored, served or dropped) is acknowledged as a duplicate and
  not stored again, so a client may retry any Put;
- backpressure: when the unconsumed count (waiting plus leased) has reached capacity, a Put that
  would start a new group raises `BufferFull` (retryable). Members of groups already started are
  always taken: refusing them could leave the buffer full of incomplete groups that can never be
  served;
- freshness (see groups.py): stale trajectories, and every member of their group, are dropped
  and counted, on arrival, when the trainer's version advances, and before serving;
- a Put's records are fsync'd before it returns.

Serving is lease and acknowledge (the lease life cycle is in leases.py). `get_batch` picks whole
complete groups, oldest policy version first, records them as leased under a new batch id (fsync)
and returns them; they stay stored. Only `ack_batch(batch_id)` consumes them (durably): never
served again, their segment space reclaimed. A batch not acked within `lease_timeout`, or leased
before a restart, is served again before any new batch, under the same batch id, after freshness
control (its stale groups are dropped and counted). A crash anywhere between the lease record and
the trainer therefore loses nothing accepted: delivery is at least once, and a duplicate carries
an id the trainer has seen.

Counters: `served`, `batches_acked` and the staleness histogram count acked batches (each
trajectory once); `batches` counts batch ids issued, `redeliveries` the times one went out again.

Not covered here: the disk format and recovery of torn writes (store.py, records.py).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kiln.protos.kiln.v1 import buffer_pb2, trajectory_pb2
from kiln.services.buffer import groups as G
from kiln.services.buffer import leases as L
from kiln.services.buffer.leases import AckResult, AckStatus, Lease, LeaseTable
from kiln.services.buffer.store import Recovered, TrajectoryStore
from kiln.services.common import codec, metrics
from kiln.trajectory import Trajectory

log = logging.getLogger("kiln.buffer")

_UNSET: Any = object()


class BufferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity: int = Field(4096, ge=1)
    """Unconsumed trajectories (waiting or leased) at which new groups are refused
    (spec.buffer.capacity)."""
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
    trajectories: list[Trajectory]
    batch_id: int
    """1, 2, ... in order of first service; 0 for an empty batch."""
    trainer_version: int
    staleness: list[int] = field(default_factory=list)
    delivery: int = 0
    """1 on first service of `batch_id`, 2 and up when served again; 0 for an empty batch."""


@dataclass
class BufferStatus:
    depth: int
    ready: int
    groups_pending: int
    groups_ready: int
    accepted: int
    served: int
    """Trajectories in acked batches."""
    dropped_stale: int
    dropped_other: int
    batches: int
    """Batch ids issued."""
    max_staleness: int
    """Largest staleness in an acked batch; -1 before the first ack."""
    trainer_version: int
    capacity: int
    group_size: int
    tau: int | None
    leased: int = 0
    """Trajectories in batches served and not yet acked."""
    leases: int = 0
    batches_acked: int = 0
    redeliveries: int = 0
    lease_timeout: float = 0.0


class TrajectoryBuffer:
    def __init__(self, store: TrajectoryStore, recovered: Recovered, config: BufferConfig) -> None:
        """Use `TrajectoryBuffer.open`."""
        self.store = store
        self.config = config.model_copy()
        self._cv = threading.Condition(threading.Lock())
        self._listeners: list[Callable[[], None]] = []
        self._known: set[str] = set()
        self._pending: dict[str, G.Group] = {}
        self._ready = G.GroupPool()
        self._complete_keys: set[str] = set()
        self._dropped_keys: dict[str, str] = {}  # group key -> reason
        self._leases = LeaseTable()
        self._seq = 0
        self._version = 0
        self._served = self._dropped_stale = self._dropped_other = 0
        self._max_staleness = -1
        self._config_set = False
        """True once a Configure call (durable) has overridden the start-up config."""
        self._replay(recovered)

    @classmethod
    def open(cls, directory: Path, config: BufferConfig | None = None) -> TrajectoryBuffer:
        config = config or BufferConfig()
        store, recovered = TrajectoryStore.open(
            directory, segment_bytes=config.segment_bytes, side_log_bytes=config.side_log_bytes)
        return cls(store, recovered, config)

    # ------------------------------------------------------------------------------ recovery

    def _replay(self, rec: Recovered) -> None:
        for ev in rec.events:
            self._leases.replay(ev)
            kind = ev["t"]
            if kind == "snapshot":
                self._version = ev["version"]
                if ev.get("config_set"):
                    self.config.group_size, self.config.tau = ev["group_size"], ev["tau"]
                self._served = ev["served"]
                self._dropped_stale, self._dropped_other = ev["dropped_stale"], ev["dropped_other"]
                self._max_staleness = ev["max_staleness"]
                self._complete_keys.update(ev["complete_groups"])
                self._dropped_keys.update(ev["dropped_groups"])
                self._config_set = bool(ev.get("config_set"))
            elif kind == "acked":
                self._served += len(ev["consumed"])
                self._max_staleness = max(self._max_staleness, ev["max_staleness"])
                self._complete_keys.update(ev["groups"])
            elif kind == "dropped":
                if ev["reason"] == "stale":
                    self._dropped_stale += len(ev["consumed"])
                else:
                    self._dropped_other += len(ev["consumed"])
                self._dropped_keys.update(dict.fromkeys(ev["groups"], ev["reason"]))
            elif kind == "version":
                self._version = ev["version"]
            elif kind == "config":
                # A Configure call is newer intent than the job file the process started with.
                self.config.group_size, self.config.tau = ev["group_size"], ev["tau"]
                self._config_set = True
            elif kind not in ("leased", "released"):  # leases only
                raise ValueError(f"{self.store.side_path}: unknown event type {kind!r}")
        self._known = set(rec.consumed)
        for msg in rec.records:
            self._known.add(msg.trajectory.id)
            self._add_entry(self._entry(msg.trajectory), msg.group_size)
        self._leases.attach(self._ready, str(self.store.side_path))
        with self._cv:
            self._sweep_locked()
            # Members stored after their group was dropped (a crash between the two writes).
            stray = {k: self._dropped_keys[k] for k in self._pending if k in self._dropped_keys}
            if stray:
                self._drop_keys_locked(stray, [])
        self._update_gauges()
        log.info("buffer recovered: %d stored (%d ready), %d in %d leased batches, %d consumed, "
                 "trainer version %d, %d torn bytes truncated", self._depth(), self._ready_count(),
                 self._leases.trajectories, len(self._leases.open), len(rec.consumed),
                 self._version, rec.truncated_bytes)

    # ----------------------------------------------------------------------------------- put

    def put(self, trajectories: Sequence[Trajectory], group_size: int | None = None) -> PutResult:
        """Store `trajectories` durably. Raises InvalidTrajectory, BufferFull, ValueError."""
        with self._cv:
            result = self._put_locked(trajectories, group_size)
            self._cv.notify_all()
        self._notify()
        return result

    def _put_locked(self, trajectories: Sequence[Trajectory], group_size: int | None) -> PutResult:
        size = group_size or self.config.group_size
        if size < 1:
            raise ValueError(f"group_size must be >= 1, got {size}")
        new: list[tuple[Trajectory, str, bytes]] = []
        seen: set[str] = set()
        in_batch: dict[str, int] = {}
        duplicates = 0
        for traj in trajectories:
            if traj.id in self._known or traj.id in seen:
                duplicates += 1
                continue
            key, payload = self._validate(traj, size, in_batch)
            seen.add(traj.id)
            in_batch[key] = in_batch.get(key, 0) + 1
            new.append((traj, key, payload))
        starts_group = any(k not in self._pending and k not in self._dropped_keys for _, k, _ in new)
        depth, leased = self._depth(), self._leases.trajectories
        if starts_group and depth + leased >= self.config.capacity:
            raise BufferFull(f"buffer holds {depth + leased} unconsumed trajectories ({depth} "
                             f"waiting, {leased} leased), its capacity ({self.config.capacity}); "
                             "retry after the trainer acks a batch")
        # Freshness on arrival: a stale member condemns its whole group (see groups.py).
        doomed: dict[str, str] = {}
        for traj, key, _ in new:
            if key in self._dropped_keys:
                doomed[key] = self._dropped_keys[key]
            elif G.is_stale(self._version, traj.oldest_version, self.config.tau):
                doomed[key] = "stale"
        keep = [(t, k, p) for t, k, p in new if k not in doomed]
        self.store.append([
            buffer_pb2.BufferRecord(trajectory=trajectory_pb2.Trajectory.FromString(p),
                                    group_size=size)
            for _, _, p in keep
        ])
        self._known.update(t.id for t, _, _ in keep)
        if doomed:
            arriving = [(t.id, k) for t, k, _ in new if k in doomed]
            stale_n = self._drop_keys_locked(doomed, arriving)
        else:
            stale_n = 0
        for traj, key, payload in keep:
            self._add_entry(G.Entry(traj.id, key, traj.oldest_version, traj.reward, payload), size)
        metrics.ACCEPTED.inc(len(new))
        self._update_gauges()
        return PutResult(len(new), duplicates, stale_n, self._depth())

    def _validate(self, traj: Trajectory, size: int, in_batch: dict[str, int]) -> tuple[str, bytes]:
        if not traj.id:
            raise InvalidTrajectory(traj.id, "id is empty")
        try:
            traj.check()
            payload = codec.to_bytes(traj)
        except ValueError as exc:
            raise InvalidTrajectory(traj.id, str(exc)) from None
        if not math.isfinite(traj.reward):
            raise InvalidTrajectory(traj.id, f"reward is {traj.reward}")
        key = G.group_key(traj.group_id, traj.id)
        if size > 1 and not traj.group_id:
            raise InvalidTrajectory(traj.id, f"group_id is empty but the group size is {size}")
        if key in self._dropped_keys:
            return key, payload
        if key in self._complete_keys:
            raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} already has all its members")
        pending = self._pending.get(key)
        if pending is not None and pending.size != size:
            raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} was started with group size "
                                             f"{pending.size}, this Put says {size}")
        have = (len(pending.members) if pending else 0) + in_batch.get(key, 0)
        if have >= size:
            raise InvalidTrajectory(traj.id, f"group {traj.group_id!r} would get more than its "
                                             f"{size} members")
        return key, payload

    def _entry(self, msg: trajectory_pb2.Trajectory) -> G.Entry:
        oldest = min((s.version for s in msg.version_spans), default=0)
        return G.Entry(msg.id, G.group_key(msg.group_id, msg.id), oldest, msg.reward,
                       msg.SerializeToString())

    def _add_entry(self, entry: G.Entry, size: int) -> None:
        group = self._pending.get(entry.group_key)
        if group is None:
            self._seq += 1
            group = self._pending[entry.group_key] = G.Group(entry.group_key, size, self._seq)
        group.members.append(entry)
        if group.complete:
            for member, adv in zip(group.members,
                                   G.group_advantages([m.reward for m in group.members])):
                member.advantage = adv
            del self._pending[entry.group_key]
            self._ready[entry.group_key] = group
            self._complete_keys.add(entry.group_key)

    # ------------------------------------------------------------------------------- serving

    def get_batch(self, size: int, trainer_version: int, timeout: float = 0.0,
                  allow_partial: bool = False) -> Batch:
        """Lease `size` trajectories of whole groups, waiting up to `timeout` seconds for them.

        A batch due to be served again comes first, as it is. On timeout: an empty batch, or with
        `allow_partial` the whole groups that are ready.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                batch, due_in = self._take_locked(size, trainer_version, False)
                remaining = deadline - time.monotonic()
                if batch.trajectories or remaining <= 0:
                    break
                # Nothing signals a lease running out: wake up for it.
                self._cv.wait(remaining if due_in is None else min(remaining, due_in + 0.001))
            if not batch.trajectories and allow_partial:
                batch, _ = self._take_locked(size, trainer_version, True)
        return batch

    def try_get_batch(self, size: int, trainer_version: int, allow_partial: bool = False) -> Batch:
        """`get_batch` without waiting."""
        return self.poll_batch(size, trainer_version, allow_partial)[0]

    def poll_batch(self, size: int, trainer_version: int,
                   allow_partial: bool = False) -> tuple[Batch, float | None]:
        """`try_get_batch`, plus the seconds until an open lease falls due (None if there is no
        open lease), so that a caller waiting for a batch knows when to look again."""
        with self._cv:
            return self._take_locked(size, trainer_version, allow_partial)

    def _take_locked(self, size: int, version: int,
                     allow_partial: bool) -> tuple[Batch, float | None]:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._advance_locked(version)
        now = time.monotonic()
        for lease in self._leases.due(now):
            batch = self._reserve_locked(lease, size, version, now)
            if batch is not None:
                return batch, self._leases.seconds_to_next_due(now)
        too_big = [g for g in self._ready.values() if g.size > size]
        if too_big:
            raise ValueError(f"size ({size}) is smaller than group {too_big[0].key!r} "
                             f"({too_big[0].size} members); a batch holds whole groups")
        picked = G.pick_groups(list(self._ready.values()), size)
        count = sum(len(g.members) for g in picked)
        if count == 0 or (count < size and not allow_partial):
            return Batch([], 0, version), self._leases.seconds_to_next_due(now)
        lease = Lease(self._leases.last_id + 1, picked, version, 1,
                      now + self.config.lease_timeout)
        self._log_lease(lease)
        for g in picked:
            del self._ready[g.key]
        self._leases.add(lease)
        self._update_gauges()
        self._maybe_snapshot_locked()
        return self._batch_of(lease), self._leases.seconds_to_next_due(now)

    def _reserve_locked(self, lease: Lease, size: int, version: int, now: float) -> Batch | None:
        """Serve a due lease again, under its batch id; None if it was released instead."""
        stale = {g.key: "stale" for g in lease.groups
                 if G.is_stale(version, g.oldest_version, self.config.tau)}
        if stale:
            self._drop_keys_locked(stale, [])  # releases the lease if nothing is left
            if lease.batch_id not in self._leases.open:
                return None
        if lease.count > size:
            # Served again it must stay the same batch, which no longer fits: its groups go
            # back to the pool, and its id is retired.
            self.store.log_event({"t": "released", "batch": lease.batch_id, "reason": "resized"})
            self._leases.end(lease.batch_id, released="resized")
            for g in lease.groups:
                self._ready[g.key] = g
            self._update_gauges()
            return None
        lease.version, lease.delivery = version, lease.delivery + 1
        lease.deadline = now + self.config.lease_timeout
        self._log_lease(lease)
        self._leases.redeliveries += 1
        L.REDELIVERED.inc()
        log.info("serving batch %d again (delivery %d, %d trajectories)", lease.batch_id,
                 lease.delivery, lease.count)
        self._maybe_snapshot_locked()
        return self._batch_of(lease)

    def _log_lease(self, lease: Lease) -> None:
        self.store.log_event(LeaseTable.leased_event(lease))

    def _batch_of(self, lease: Lease) -> Batch:
        out = []
        for e in lease.entries:
            traj = codec.from_bytes(e.payload)
            traj.advantage = e.advantage
            out.append(traj)
        return Batch(out, lease.batch_id, lease.version, lease.staleness(), lease.delivery)

    def ack_batch(self, batch_id: int) -> AckResult:
        """The trainer is done with `batch_id`: consume its trajectories (durably). Acking an id
        that is not leased changes nothing; the result says why."""
        with self._cv:
            lease = self._leases.open.get(batch_id)
            if lease is None:
                return self._leases.status_of_closed(batch_id)
            entries, stal = lease.entries, lease.staleness()
            self.store.log_event({
                "t": "acked", "batch": batch_id, "consumed": [e.id for e in entries],
                "groups": [g.key for g in lease.groups], "max_staleness": max(stal),
            })
            self._leases.end(batch_id)
            self._served += len(entries)
            self._max_staleness = max(self._max_staleness, max(stal))
            metrics.SERVED.inc(len(entries))
            for v in stal:
                metrics.STALENESS.observe(v)
            self._update_gauges()
            self._maybe_snapshot_locked()
        self._notify()  # capacity was freed
        return AckResult(AckStatus.ACKED, len(entries))

    # ------------------------------------------------------------------------ version, config

    def set_trainer_version(self, version: int) -> BufferStatus:
        with self._cv:
            self._advance_locked(version)
            return self._status_locked()

    def _advance_locked(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"trainer_version must be >= 0, got {version}")
        if version != self._version:
            # Not required for correctness (the trainer passes its version with every request),
            # but it lets a restarted buffer apply freshness before the trainer calls again.
            self.store.log_event({"t": "version", "version": version})
            self._version = version
            self._sweep_locked()
        metrics.POLICY_VERSION.labels("buffer").set(self._version)

    def configure(self, group_size: int | None = None, tau: int | None = _UNSET,
                  drop_unserved: bool = False) -> BufferStatus:
        """Change the default group size and/or tau (durably); optionally drop everything not
        consumed: waiting trajectories and unacked batches (whose ids are then released)."""
        with self._cv:
            new = BufferConfig.model_validate({
                **self.config.model_dump(),
                "group_size": group_size or self.config.group_size,
                "tau": self.config.tau if tau is _UNSET else tau,
            })
            self.store.log_event({"t": "config", "group_size": new.group_size, "tau": new.tau})
            self.config, self._config_set = new, True
            if drop_unserved:
                # Leased batches too: served again after a stage change, they would train the
                # new stage on the old one's data.
                held = [g for le in self._leases.open.values() for g in le.groups]
                self._drop_locked([*self._pending.values(), *self._ready.values(), *held],
                                  "discarded")
            self._sweep_locked()
            self._update_gauges()
            return self._status_locked()

    # --------------------------------------------------------------------------------- drops

    def _sweep_locked(self) -> None:
        # Leased groups are left alone: the trainer may be training on them. They are checked
        # if and when they are served again.
        stale = [g for g in [*self._pending.values(), *self._ready.values()]
                 if G.is_stale(self._version, g.oldest_version, self.config.tau)]
        if stale:
            self._drop_locked(stale, "stale")

    def _drop_locked(self, groups: list[G.Group], reason: str) -> None:
        self._drop_keys_locked({g.key: reason for g in groups}, [])

    def _drop_keys_locked(self, doomed: dict[str, str], arriving: list[tuple[str, str]]) -> int:
        """Drop every stored member of the `doomed` groups (key -> reason), waiting or leased,
        and the `arriving` (id, key) pairs, which were never stored. A lease left without groups
        is released. Returns how many were dropped as stale."""
        pairs = list(arriving)
        for key in doomed:
            group = (self._pending.pop(key, None) or self._ready.pop(key, None)
                     or self._leases.peek_group(key))
            if group is not None:
                pairs.extend((e.id, key) for e in group.members)
        stale_n = 0
        for reason in sorted(set(doomed.values())):
            members = [tid for tid, key in pairs if doomed[key] == reason]
            keys = [k for k, r in doomed.items() if r == reason and k not in self._dropped_keys]
            # One event per reason keeps the counters exact on replay.
            self.store.log_event({"t": "dropped", "reason": reason, "consumed": members,
                                  "groups": keys})
            if reason == "stale":
                self._dropped_stale += len(members)
                stale_n += len(members)
                metrics.DROPPED_STALE.inc(len(members))
            else:
                self._dropped_other += len(members)
        self._known.update(tid for tid, _ in arriving)
        for key, reason in doomed.items():
            self._dropped_keys.setdefault(key, reason)
            # Replay does the same on reading the event's "groups".
            self._leases.take_group(key, reason)
        self._update_gauges()
        self._maybe_snapshot_locked()
        return stale_n

    # ---------------------------------------------------------------------------- bookkeeping

    def _depth(self) -> int:
        return sum(len(g.members) for g in self._pending.values()) + self._ready_count()

    def _ready_count(self) -> int:
        return self._ready.members

    def _update_gauges(self) -> None:
        metrics.BUFFER_DEPTH.set(self._depth())
        L.LEASED.set(self._leases.trajectories)
        metrics.POLICY_VERSION.labels("buffer").set(self._version)

    def _maybe_snapshot_locked(self) -> None:
        if not self.store.needs_snapshot():
            return
        self.store.snapshot({
            "version": self._version, "config_set": self._config_set,
            "group_size": self.config.group_size, "tau": self.config.tau,
            "served": self._served,
            "dropped_stale": self._dropped_stale, "dropped_other": self._dropped_other,
            "max_staleness": self._max_staleness,
            "complete_groups": sorted(self._complete_keys),
            "dropped_groups": self._dropped_keys,
            **self._leases.to_json(),
        })

    def status(self) -> BufferStatus:
        with self._cv:
            return self._status_locked()

    def _status_locked(self) -> BufferStatus:
        return BufferStatus(
            depth=self._depth(), ready=self._ready_count(), groups_pending=len(self._pending),
            groups_ready=len(self._ready), accepted=len(self._known), served=self._served,
            dropped_stale=self._dropped_stale, dropped_other=self._dropped_other,
            batches=self._leases.last_id, max_staleness=self._max_staleness,
            trainer_version=self._version, capacity=self.config.capacity,
            group_size=self.config.group_size, tau=self.config.tau,
            leased=self._leases.trajectories, leases=len(self._leases.open),
            batches_acked=self._leases.acked, redeliveries=self._leases.redeliveries,
            lease_timeout=self.config.lease_timeout)

    # ------------------------------------------------------------------------------ plumbing

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the changing thread, without the lock) after every Put and ack, so
        an asyncio server can wake waiting GetBatch calls without blocking a thread each."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.remove(fn)

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:
                # The change is already durable; a failing listener must not turn it into an
                # error for the caller, who would retry a Put that succeeded.
                log.exception("buffer change listener %r failed", fn)

    def close(self) -> None:
        with self._cv:
            self.store.close()
