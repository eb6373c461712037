"""The weight-sync service's state: the latest committed version, versions being published, and
what every replica last acknowledged.

`WeightStore` is the single place where versions move forward. A publish opens (or joins, for
parallel streams) a `PendingVersion`; each bucket is checked on arrival; when the last one lands
the version is committed, replacing the previous one, and every subscriber waiting in
`wait_newer` wakes up. A version not newer than the latest committed one is refused
(`TransferError("stale")`); a corrupt bucket, or the last stream of a publish closing with
buckets missing, fails that pending version and leaves the latest committed one untouched.
Subscribers do not wait for the commit: `wait_source` hands them a version as soon as its publish
opens, and they forward each bucket once it has passed its checks here (`PendingVersion.bucket`);
if that publish then fails, they end their streams so that replicas drop what they received.

Only the latest version is kept (a subscriber still sending an older one holds its own
reference), and, while the latest is a LoRA adapter (`kiln.models.lora_names`), the last version
of complete weights, the base that adapter applies to: a replica that joins during a LoRA stage
following full-weight stages holds only the job's starting checkpoint, so it is sent that base
before the adapter (`base_for`), or it would refuse every adapter version.

A restarted service holds no base. So a trainer whose adapter sits on weights that earlier
stages trained publishes its adapter versions as needing one (`open_stream(needs_base=True)`):
they are refused ("no-base") while none is held, and the trainer then publishes the base itself
(`open_base`: complete weights at the version they were first published as, kept as the base
and never served as a version of their own) and the adapter again.
Everything here runs on one asyncio loop; nothing is thread-safe.
Not covered: persistence (a restarted service has no version until the trainer publishes again).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kiln.models.lora_names import is_adapter_version
from kiln.services.common.metrics import POLICY_VERSION, SYNC_FAILURES, SYNC_SECONDS
from kiln.services.weight_sync.buckets import Assembly, Bucket, Manifest, TransferError

COMPONENT = "weight-sync"


@dataclass(frozen=True)
class StoredVersion:
    manifest: Manifest
    buckets: list[Bucket]
    committed_at: float  # time.time()

    @property
    def policy_version(self) -> int:
        return self.manifest.policy_version


@dataclass
class PendingVersion:
    assembly: Assembly
    expected_streams: int = 1
    """How many parallel streams carry this version (each announces it)."""
    opened: int = 0
    closed: int = 0
    started_at: float = field(default_factory=time.monotonic)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Resolves to the StoredVersion when committed, or to a TransferError when it fails."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) whenever a verified bucket arrives or the version ends: what
    subscribers forwarding this version while it is published wait on."""

    @property
    def manifest(self) -> Manifest:
        return self.assembly.manifest

    @property
    def policy_version(self) -> int:
        return self.assembly.policy_version

    def _wake(self) -> None:
        event, self.arrived = self.arrived, asyncio.Event()
        event.set()

    async def bucket(self, index: int) -> Bucket:
        """Bucket `index` once it has arrived and passed its checks; the version's TransferError
        if its publish fails first (a subscriber must then drop what it received of it)."""
        while True:
            got = self.assembly.buckets.get(index)
            if got is not None:
                return got
            if self.done.done():
                exc = self.done.exception()
                raise exc if exc is not None else TransferError(
                    "truncated", f"version {self.policy_version}: bucket {index} never arrived")
            await self.arrived.wait()


@dataclass
class ReplicaState:
    replica_id: str
    applied_policy_version: int = 0
    last_policy_version: int = 0
    last_ok: bool = False
    last_error: str = ""
    acks: int = 0
    """How many acknowledgements it sent (a subscriber waits for the next one, `wait_ack`)."""


MAX_PENDING = 4
MAX_REPLICAS = 4096
MAX_ERROR_CHARS = 500


class WeightStore:
    def __init__(self, max_version_step: int | None = None, abandon_after_s: float = 300.0) -> None:
        self.max_version_step = max_version_step
        self.abandon_after_s = abandon_after_s
        """A pending version not committed this long after it opened is dropped (its publisher
        gave up or died, or announced streams that never came)."""
        """Refuse a version more than this ahead of the latest committed one (None: any)."""
        self.latest: StoredVersion | None = None
        self.base: StoredVersion | None = None
        """The latest committed version of complete weights (`latest` itself unless that is a
        LoRA adapter)."""
        self._pending: dict[int, PendingVersion] = {}
        self._base_pending: PendingVersion | None = None
        """A base being published (`open_base`): apart, as subscribers never see it."""
        self._changed = asyncio.Condition()
        self._commit_times: dict[int, float] = {}
        self.replicas: dict[str, ReplicaState] = {}

    @property
    def policy_version(self) -> int:
        return self.latest.policy_version if self.latest else 0

    # --- publishing -------------------------------------------------------------------------

    def open_stream(self, manifest: Manifest, expected_streams: int = 1, *,
                    needs_base: bool = False) -> PendingVersion:
        """A publish stream announced `manifest`; returns the version's pending state (shared by
        the `expected_streams` parallel streams of the same version). `needs_base`: an adapter
        on weights earlier stages trained, refused ("no-base") while no base is held."""
        if needs_base and self.base is None:
            SYNC_FAILURES.labels("no-base").inc()
            raise TransferError(
                "no-base", f"version {manifest.policy_version} is an adapter on trained weights this "
                "service does not hold (it restarted since they were published): publish them "
                "as the base first")
        if manifest.policy_version <= self.policy_version:
            SYNC_FAILURES.labels("stale").inc()
            raise TransferError(
                "stale", f"version {manifest.policy_version} is not newer than the latest committed "
                f"version {self.policy_version}; versions only move forward")
        step = self.max_version_step
        if step is not None and self.latest is not None and manifest.policy_version > self.policy_version + step:
            # A trainer publishes the next version (or, after a restart, the one it resumed at);
            # a leap would make every later publish stale.
            SYNC_FAILURES.labels("jump").inc()
            raise TransferError(
                "jump", f"version {manifest.policy_version} is more than {step} ahead of the latest "
                f"committed version {self.policy_version} (spec.weightSync.maxVersionStep)")
        now = time.monotonic()
        for stale in [p for p in self._pending.values() if now - p.started_at > self.abandon_after_s]:
            self._fail(stale, TransferError("truncated", f"version {stale.assembly.policy_version} "
                                            f"abandoned after {self.abandon_after_s:.0f} s"))
        pending = self._pending.get(manifest.policy_version)
        if pending is None and len(self._pending) >= MAX_PENDING:
            # Each pending version holds its received buckets: half-finished publishes must not
            # pile up (a trainer publishes one version at a time).
            SYNC_FAILURES.labels("busy").inc()
            raise TransferError("busy", f"{len(self._pending)} versions are being published already "
                                f"({sorted(self._pending)}); retry when one is committed or abandoned")
        if pending is None:
            pending = PendingVersion(Assembly(manifest), expected_streams)
            self._pending[manifest.policy_version] = pending
        elif pending.assembly.manifest != manifest or pending.expected_streams != expected_streams:
            raise TransferError(
                "manifest", f"version {manifest.policy_version} is already being published with a "
                "different manifest or stream count")
        elif pending.opened >= expected_streams:
            raise TransferError(
                "manifest", f"version {manifest.policy_version}: more than {expected_streams} publish streams")
        pending.opened += 1
        if pending.opened == 1:
            # Subscribers start forwarding it now: each bucket is verified here on arrival and
            # again by every replica, which applies nothing before the whole version checks out.
            asyncio.get_running_loop().create_task(self._notify())
        return pending

    def open_base(self, manifest: Manifest, expected_streams: int = 1) -> PendingVersion:
        """A publish stream announced the complete weights later adapter versions apply to, at
        the version they were first published as: kept as `base` when whole, not as a version
        (no subscriber gets it but before an adapter, `base_for`)."""
        if is_adapter_version(t.name for t in manifest.tensors):
            raise TransferError("manifest", f"version {manifest.policy_version}: a base must be "
                                            "complete weights, not an adapter")
        if self.base is not None and manifest.policy_version < self.base.policy_version:
            raise TransferError("stale", f"base version {manifest.policy_version} is older than the "
                                         f"base held, version {self.base.policy_version}")
        pending = self._base_pending
        if pending is None or pending.done.done() or pending.manifest != manifest:
            if pending is not None:
                self._fail(pending, TransferError("stale", "replaced by another base"))
            pending = self._base_pending = PendingVersion(Assembly(manifest), expected_streams)
        pending.opened += 1
        return pending

    def add_bucket(self, pending: PendingVersion, bucket: Bucket) -> None:
        """Check and keep one bucket; commits the version when it was the last one."""
        if pending.done.done():
            # Another stream of the same version already failed (or it was superseded).
            raise TransferError("manifest", f"version {pending.assembly.policy_version} is no longer "
                                            "being published")
        try:
            pending.assembly.add(bucket)
        except TransferError as exc:
            self._fail(pending, exc)
            raise
        pending._wake()
        if pending.assembly.complete:
            self._commit(pending)

    def close_stream(self, pending: PendingVersion) -> None:
        """A publish stream ended (normally or not). When every expected stream has ended and
        buckets are still missing, the version failed as truncated."""
        pending.closed += 1
        if pending.closed >= pending.expected_streams and not pending.done.done():
            a = pending.assembly
            self._fail(pending, TransferError(
                "truncated", f"version {a.policy_version}: publish ended with "
                f"{a.manifest.num_buckets - a.received} of {a.manifest.num_buckets} buckets missing"))

    def _fail(self, pending: PendingVersion, exc: TransferError) -> None:
        if pending.done.done():
            return
        SYNC_FAILURES.labels(exc.reason).inc()
        pending.done.set_exception(exc)
        pending.done.exception()  # mark retrieved: streams that already left need not see it
        if pending is self._base_pending:
            self._base_pending = None
        elif self._pending.get(pending.assembly.policy_version) is pending:
            del self._pending[pending.assembly.policy_version]
        pending._wake()

    def _commit(self, pending: PendingVersion) -> None:
        version = pending.assembly.policy_version
        try:
            buckets = pending.assembly.finish()
        except TransferError as exc:
            self._fail(pending, exc)
            raise
        if pending is self._base_pending:  # kept as the base only: nobody is told
            self.base = StoredVersion(pending.assembly.manifest, buckets, time.time())
            self._base_pending = None
            pending.done.set_result(self.base)
            return
        if version <= self.policy_version:
            # A newer version was committed while this one was in flight.
            exc = TransferError("stale", f"version {version} was overtaken by {self.policy_version}")
            self._fail(pending, exc)
            raise exc
        stored = StoredVersion(pending.assembly.manifest, buckets, time.time())
        self.latest = stored
        if not is_adapter_version(t.name for t in stored.manifest.tensors):
            self.base = stored
        self._commit_times[version] = stored.committed_at
        for old in [v for v in self._commit_times if v < version - 64]:
            del self._commit_times[old]
        self._pending.pop(version, None)
        for v, other in list(self._pending.items()):
            if v < version:
                self._fail(other, TransferError("stale", f"version {v} was overtaken by {version}"))
        POLICY_VERSION.labels(COMPONENT).set(version)
        pending.done.set_result(stored)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- subscribing ------------------------------------------------------------------------

    async def wait_newer(self, than: int) -> StoredVersion:
        """The latest committed version once it is newer than `than`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.policy_version > than)
            assert self.latest is not None
            return self.latest

    @property
    def newest_version(self) -> int:
        """The newest version committed or being published."""
        return max([self.policy_version, *self._pending])

    def _newest_source(self, than: int) -> StoredVersion | PendingVersion | None:
        pending = [p for v, p in self._pending.items() if v > max(than, self.policy_version)]
        if pending:
            return max(pending, key=lambda p: p.policy_version)
        return self.latest if self.policy_version > than else None

    def base_for(self, source: StoredVersion | PendingVersion, sent: int) -> StoredVersion | None:
        """The version of complete weights a subscriber that has been sent `sent` must get
        before `source`, an adapter that applies to it; None when `source` is complete weights
        or the subscriber has been sent that base already."""
        if self.base is None or self.base.policy_version <= sent:
            return None
        return self.base if is_adapter_version(t.name for t in source.manifest.tensors) else None

    async def wait_ack(self, replica_id: str, acks: int, version: int) -> None:
        """Return once `replica_id` has acknowledged `version` or a newer one in an ack after
        its first `acks` (applied or refused: either way it is done with it)."""
        state = self.replicas[replica_id]
        async with self._changed:
            await self._changed.wait_for(lambda: state.acks > acks and state.last_policy_version >= version)

    async def wait_source(self, than: int) -> StoredVersion | PendingVersion:
        """The newest version newer than `than`, committed or still being published (cut-through:
        a subscriber forwards buckets as they arrive instead of after the commit, so the time to
        reach every replica is one transfer, not two)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._newest_source(than) is not None)
            source = self._newest_source(than)
            assert source is not None
            return source

    def record_ack(self, replica_id: str, version: int, ok: bool, error: str) -> ReplicaState:
        """Record a replica's answer. ValueError for a replica that never subscribed (or beyond
        MAX_REPLICAS): what Status reports stays bounded whoever sends Acks."""
        state = self.replicas.get(replica_id)
        if state is None:
            raise ValueError(f"replica_id {replica_id[:80]!r} has not subscribed")
        # The error text of a replica is shown in Status: keep it to a line.
        error = error[:MAX_ERROR_CHARS]
        state.last_policy_version, state.last_ok, state.last_error = version, ok, error
        state.acks += 1
        asyncio.get_running_loop().create_task(self._notify())
        if ok:
            state.applied_policy_version = max(state.applied_policy_version, version)
            committed = self._commit_times.get(version)
            if committed is not None:
                SYNC_SECONDS.observe(max(time.time() - committed, 0.0))
        return state

    def add_replica(self, replica_id: str) -> ReplicaState:
        """A subscribing replica (again, after a reconnect: its state is kept). ValueError past
        MAX_REPLICAS distinct ones."""
        state = self.replicas.get(replica_id)
        if state is None:
            if len(self.replicas) >= MAX_REPLICAS:
                raise ValueError(f"{len(self.replicas)} replicas are known already (at most {MAX_REPLICAS})")
            state = self.replicas[replica_id] = ReplicaState(replica_id)
        return state
