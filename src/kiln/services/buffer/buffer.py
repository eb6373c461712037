"""The trajectory buffer: durable acceptance, freshness, leased serving and acknowledgement.

`TrajectoryBuffer` is what the gRPC servicer and the in-process client both wrap; it knows
nothing of gRPC. It is thread-safe (one lock; a Put holds it through its fsync, which keeps
duplicate detection exact) and `get_batch` blocks on a condition variable. The state it guards
is a `BufferIndex` (index.py); what a Put may store is decided by `admission.plan_put`.

Trajectories stay in the bytes they were put in: a Put's records are decoded once to be
checked, stored as received, and served as stored.

Serving is lease and acknowledge (the lease life cycle is in leases.py). `get_batch` picks whole
complete groups that fill the batch exactly, oldest policy version first where there is a
choice (`groups.pick_groups`: groups of any size, none at the head can wedge it; a group larger
than the batch is dropped, reason `oversize`), records them as leased under a new batch id (fsync)
and returns them; they stay stored. Only `ack_batch(batch_id)` consumes them (durably): never
served again, their segment space reclaimed. A batch not acked within `lease_timeout`, or leased
before a restart, is served again before any new batch, under the same batch id, after freshness
control (its stale groups are dropped and counted). A crash anywhere between the lease record and
the trainer therefore loses nothing accepted: delivery is at least once, and a duplicate carries
an id the trainer has seen.

Freshness (groups.py): stale trajectories, and every member of their group, are dropped and
counted on arrival, when the trainer's policy version advances, and before serving. Staleness
is computed here, once, and handed to the trainer with each batch.

Counters: `served`, `batches_acked` and the staleness histogram count acked batches (each
trajectory once); `batches` counts batch ids issued, `redeliveries` the times one went out again.

Not covered here: the disk format and recovery of torn writes (store.py, records.py).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from kiln.freshness import is_stale
from kiln.control.records import BufferStatus
from kiln.services.buffer import groups as G
from kiln.services.buffer.admission import plan_put
from kiln.services.buffer.index import BufferIndex
from kiln.services.buffer.leases import AckResult, AckStatus, Lease, LeaseTable
from kiln.services.buffer.store import TrajectoryStore
from kiln.services.buffer.types import Batch, BufferConfig, PutResult
from kiln.services.common import metrics
from kiln.trajectory import Trajectory

log = logging.getLogger("kiln.buffer")


class TrajectoryBuffer:
    def __init__(self, store: TrajectoryStore, index: BufferIndex) -> None:
        """Use `TrajectoryBuffer.open`."""
        self.store = store
        self.index = index
        self._cv = threading.Condition(threading.Lock())
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    def open(cls, directory: Path, config: BufferConfig | None = None) -> TrajectoryBuffer:
        config = config or BufferConfig()
        store, recovered = TrajectoryStore.open(
            directory, segment_bytes=config.segment_bytes, side_log_bytes=config.side_log_bytes)
        index = BufferIndex(config)
        index.replay(recovered, str(store.side_path))
        buffer = cls(store, index)
        with buffer._cv:
            index.sweep(store.log_event)
            # Members stored after their group was dropped (a crash between the two writes).
            stray = {k: index.dropped_keys[k] for k in index.pending if k in index.dropped_keys}
            if stray:
                index.drop(stray, [], store.log_event)
            index.update_gauges()
        log.info("buffer recovered: %d stored (%d ready), %d in %d leased batches, %d consumed, "
                 "policy version %d, %d torn bytes truncated", index.depth, index.ready.members,
                 index.leases.trajectories, len(index.leases.open), len(recovered.consumed),
                 index.policy_version, recovered.truncated_bytes)
        return buffer

    @property
    def config(self) -> BufferConfig:
        return self.index.config

    # ----------------------------------------------------------------------------------- put

    def put(self, items: Sequence[bytes | Trajectory], group_size: int | None = None) -> PutResult:
        """Store `items` durably: serialized trajectories as they came over the wire, or domain
        records (encoded once). Raises InvalidTrajectory, BufferFull, ValueError, OSError."""
        size = group_size or self.index.config.group_size
        if size > self.index.config.capacity:
            # Its members would be admitted past the capacity, and the group never completes.
            raise ValueError(f"group_size {size} is larger than the buffer's capacity "
                             f"{self.index.config.capacity}")
        with self._cv:
            result = self._put_locked(items, size)
            self._cv.notify_all()
        self._notify()
        return result

    def _put_locked(self, items: Sequence[bytes | Trajectory], size: int) -> PutResult:
        index = self.index
        plan = plan_put(index, items, size)
        self.store.append([(a.trajectory.id, a.payload, size) for a in plan.keep])
        index.known.update(a.trajectory.id for a in plan.keep)
        stale_n = 0
        if plan.doomed:
            arriving = [(a.trajectory.id, a.key) for a in plan.arriving_doomed]
            stale_n = index.drop(plan.doomed, arriving, self.store.log_event)
        for a in plan.keep:
            t = a.trajectory
            index.add_entry(G.Entry(t.id, a.key, t.oldest_version, a.payload), size)
        metrics.ACCEPTED.inc(plan.new)
        self._changed_locked()
        return PutResult(plan.new, plan.duplicates, stale_n, index.depth)

    # ------------------------------------------------------------------------------- serving

    def get_batch(self, size: int, policy_version: int, timeout: float = 0.0,
                  allow_partial: bool = False) -> Batch:
        """Lease `size` trajectories of whole groups, waiting up to `timeout` seconds for them.

        A batch due to be served again comes first, as it is. On timeout: an empty batch, or with
        `allow_partial` the whole groups that are ready.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                batch, due_in = self._take_locked(size, policy_version, False)
                remaining = deadline - time.monotonic()
                if batch.payloads or remaining <= 0:
                    break
                # Nothing signals a lease running out: wake up for it.
                self._cv.wait(remaining if due_in is None else min(remaining, due_in + 0.001))
            if not batch.payloads and allow_partial:
                batch, _ = self._take_locked(size, policy_version, True)
        return batch

    def try_get_batch(self, size: int, policy_version: int, allow_partial: bool = False) -> Batch:
        """`get_batch` without waiting."""
        return self.poll_batch(size, policy_version, allow_partial)[0]

    def poll_batch(self, size: int, policy_version: int,
                   allow_partial: bool = False) -> tuple[Batch, float | None]:
        """`try_get_batch`, plus the seconds until an open lease falls due (None if there is no
        open lease), so that a caller waiting for a batch knows when to look again."""
        with self._cv:
            return self._take_locked(size, policy_version, allow_partial)

    def _take_locked(self, size: int, version: int,
                     allow_partial: bool) -> tuple[Batch, float | None]:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        index = self.index
        self._advance_locked(version)
        now = time.monotonic()
        for lease in index.leases.due(now):
            batch = self._serve_again_locked(lease, size, version, now)
            if batch is not None:
                return batch, index.leases.seconds_to_next_due(now)
        too_big = {g.key: "oversize" for g in index.ready.values() if g.size > size}
        if too_big:
            # A batch holds whole groups: one bigger than the batch could never be served, and
            # must not stop the ones behind it.
            log.warning("dropping %d groups larger than a batch of %d (%s, ...)", len(too_big),
                        size, next(iter(too_big)))
            index.drop(too_big, [], self.store.log_event)
            self._changed_locked()
        picked = G.pick_groups(list(index.ready.values()), size)
        count = sum(len(g.members) for g in picked)
        if count == 0 or (count < size and not allow_partial):
            return Batch([], 0, version), index.leases.seconds_to_next_due(now)
        lease = Lease(index.leases.last_id + 1, picked, version, 1,
                      now + index.config.lease_timeout)
        self.store.log_event(LeaseTable.leased_event(lease))
        for g in picked:
            del index.ready[g.key]
        index.leases.add(lease)
        self._changed_locked()
        return _batch_of(lease), index.leases.seconds_to_next_due(now)

    def _serve_again_locked(self, lease: Lease, size: int, version: int,
                            now: float) -> Batch | None:
        """Serve a due lease again, under its batch id; None if it was released instead."""
        index = self.index
        stale = {g.key: "stale" for g in lease.groups
                 if is_stale(version, g.oldest_version, index.config.tau)}
        if stale:
            index.drop(stale, [], self.store.log_event)  # releases the lease if nothing is left
            self._changed_locked()
            if lease.batch_id not in index.leases.open:
                return None
        if lease.count > size:
            # Served again it must stay the same batch, which no longer fits: its groups go
            # back to the pool, and its id is retired.
            self.store.log_event({"t": "released", "batch": lease.batch_id, "reason": "resized"})
            index.leases.end(lease.batch_id, released="resized")
            for g in lease.groups:
                index.ready[g.key] = g
            self._changed_locked()
            return None
        served_again = Lease(lease.batch_id, lease.groups, version, lease.delivery + 1,
                             now + index.config.lease_timeout)
        self.store.log_event(LeaseTable.leased_event(served_again))
        lease.version, lease.delivery, lease.deadline = (
            served_again.version, served_again.delivery, served_again.deadline)
        index.leases.redeliveries += 1
        metrics.BATCHES_REDELIVERED.inc()
        log.info("serving batch %d again (delivery %d, %d trajectories)", lease.batch_id,
                 lease.delivery, lease.count)
        self._changed_locked()
        return _batch_of(lease)

    def ack_batch(self, batch_id: int) -> AckResult:
        """The trainer is done with `batch_id`: consume its trajectories (durably). Acking an id
        that is not leased changes nothing; the result says why."""
        with self._cv:
            index = self.index
            lease = index.leases.open.get(batch_id)
            if lease is None:
                return index.leases.status_of_closed(batch_id)
            entries, stal = lease.entries, lease.staleness()
            self.store.log_event({
                "t": "acked", "batch": batch_id, "consumed": [e.id for e in entries],
                "groups": [g.key for g in lease.groups], "max_staleness": max(stal),
            })
            index.leases.end(batch_id)
            index.consumed(entries)
            index.max_staleness = max(index.max_staleness, max(stal))
            metrics.SERVED.inc(len(entries))
            for v in stal:
                metrics.STALENESS.observe(v)
            self._changed_locked()
        self._notify()  # capacity was freed
        return AckResult(AckStatus.ACKED, len(entries))

    # ------------------------------------------------------------------------ version, config

    def set_policy_version(self, version: int) -> BufferStatus:
        with self._cv:
            self._advance_locked(version)
            return self.index.status()

    def _advance_locked(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"policy_version must be >= 0, got {version}")
        index = self.index
        if version != index.policy_version:
            # Not required for correctness (the trainer passes its version with every request),
            # but it lets a restarted buffer apply freshness before the trainer calls again.
            self.store.log_event({"t": "version", "version": version})
            index.policy_version = version
            index.sweep(self.store.log_event)
            self._changed_locked()

    def configure(self, *, tau: int | None, group_size: int | None = None,
                  drop_unserved: bool = False) -> BufferStatus:
        """Set tau, the freshness bound from now on (None: no bound, as for SFT data), and
        optionally the default group size (None keeps it), durably; optionally drop everything
        not consumed: waiting trajectories and unacked batches (whose ids are then released)."""
        with self._cv:
            index = self.index
            new = BufferConfig.model_validate({
                **index.config.model_dump(),
                "group_size": group_size or index.config.group_size,
                "tau": tau,
            })
            self.store.log_event({"t": "config", "group_size": new.group_size, "tau": new.tau})
            index.config, index.config_set = new, True
            if drop_unserved:
                # Leased batches too: served again after a stage change, they would train the
                # new stage on the old one's data.
                groups = index.unserved_groups()
                if groups:
                    index.drop({g.key: "discarded" for g in groups}, [], self.store.log_event)
            index.sweep(self.store.log_event)
            self._changed_locked()
            return index.status()

    def status(self) -> BufferStatus:
        with self._cv:
            return self.index.status()

    # ------------------------------------------------------------------------------ plumbing

    def _changed_locked(self) -> None:
        """After any change: gauges, and a side-log snapshot once the log has grown enough."""
        self.index.update_gauges()
        if self.store.needs_snapshot():
            self.store.snapshot(self.index.snapshot_state())

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


def _batch_of(lease: Lease) -> Batch:
    entries = lease.entries
    return Batch([e.payload for e in entries], lease.batch_id, lease.version, lease.staleness(),
                 lease.delivery)
