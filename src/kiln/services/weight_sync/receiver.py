"""The rollout replica's side of weight sync: verify incoming versions, apply the newest one.

`ReplicaReceiver` is fed the chunks of one or more subscription streams (manifests and buckets,
already decoded) and never sees gRPC. It assembles each announced version, checking every bucket
as it arrives; a version that fails a check (digest, length, missing buckets when the stream
ends) is rejected and acknowledged as failed, and the replica keeps serving the weights it has.
Verified versions go to an apply loop that calls `apply_fn(version, named_tensors)`:

- versions only move forward: a manifest not newer than what is applied (or already verified
  and waiting) is ignored;
- latest wins: if N+1 (or N+2) is verified while N is being applied, N finishes, then only the
  newest waiting version is applied; a partially received N is abandoned as soon as a newer
  manifest arrives;
- `apply_fn` is only ever called with a fully verified version, one call at a time.

Each bucket is copied into the version's staging buffer as it arrives and passes its checks
(while the next ones are on the way), so a verified version reaches `apply_fn` as views of that
buffer, with no copy left to make; a version cut short is dropped whole.

If `apply_fn` raises, the version is acknowledged as failed and the applied version does not
move; whether the engine still serves the old weights then is the engine's promise (the rollout
engine applies a version all-or-nothing only as far as vLLM's in-place reload does).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from kiln.services.common.metrics import POLICY_VERSION, SYNC_FAILURES
from kiln.services.weight_sync.buckets import Assembly, Bucket, Manifest, TransferError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kiln.weight_sync.receiver")

NamedTensors = list[tuple[str, "torch.Tensor"]]
ApplyFn = Callable[[int, NamedTensors], Awaitable[None]]
AckFn = Callable[[int, bool, str], Awaitable[None]]


async def _no_ack(version: int, ok: bool, error: str) -> None:
    return None


class ReplicaReceiver:
    def __init__(self, apply_fn: ApplyFn, ack_fn: AckFn | None = None, *,
                 applied_policy_version: int = 0, component: str = "rollout") -> None:
        self.apply_fn = apply_fn
        self.ack_fn = ack_fn or _no_ack
        self.component = component
        self.applied_policy_version = applied_policy_version
        self.applied: list[int] = []
        """Every version applied, in order (strictly increasing)."""
        self.rejected: list[tuple[int, str]] = []
        """(version, reason) of every version rejected."""
        self._partial: dict[int, Assembly] = {}
        self._failed: set[int] = set()
        self._ready: tuple[Manifest, Assembly] | None = None
        self._wake = asyncio.Event()
        self._applied_event = asyncio.Condition()

    def _newest_known(self) -> int:
        ready = self._ready[0].policy_version if self._ready else 0
        return max([self.applied_policy_version, ready, *self._partial])

    # --- incoming chunks --------------------------------------------------------------------

    async def on_chunk(self, chunk: Manifest | Bucket) -> None:
        if isinstance(chunk, Manifest):
            await self._on_manifest(chunk)
        else:
            await self._on_bucket(chunk)

    async def _on_manifest(self, m: Manifest) -> None:
        ready = self._ready[0].policy_version if self._ready else 0
        if m.policy_version <= max(self.applied_policy_version, ready) or m.policy_version in self._failed:
            return  # not newer than what we have: never go backwards
        existing = self._partial.get(m.policy_version)
        if existing is not None:
            if existing.manifest != m:
                await self._reject(m.policy_version, TransferError(
                    "manifest", f"version {m.policy_version} announced twice with different manifests"))
            return
        try:
            # Staged: each bucket is copied into the version's buffer as it arrives, so the
            # copy overlaps the transfer and the verified version is handed over without one.
            assembly = Assembly(m, stage=True)
        except TransferError as exc:
            await self._reject(m.policy_version, exc)
            return
        for v in [v for v in self._partial if v < m.policy_version]:
            log.info("abandoning version %d for %d", v, m.policy_version)
            del self._partial[v]
        self._partial[m.policy_version] = assembly

    async def _on_bucket(self, b: Bucket) -> None:
        assembly = self._partial.get(b.policy_version)
        if assembly is None:
            if b.policy_version > self._newest_known() and b.policy_version not in self._failed:
                await self._reject(b.policy_version, TransferError(
                    "manifest", f"bucket {b.index} of version {b.policy_version} arrived before its manifest"))
            return  # an abandoned, rejected or already complete version
        try:
            assembly.add(b)
            if not assembly.complete:
                return
            assembly.finish()
        except TransferError as exc:
            await self._reject(b.policy_version, exc)
            return
        del self._partial[b.policy_version]
        self._ready = (assembly.manifest, assembly)
        self._wake.set()

    async def on_streams_ended(self) -> None:
        """Every subscription stream ended: versions still partial are truncated. The service
        forwards a version while it is published, and ends the streams when that publish fails;
        the same version may then be published again, so a truncated one may come back whole
        (every bucket received of it is dropped here: nothing of it was applied)."""
        for v, a in list(self._partial.items()):
            await self._reject(v, TransferError(
                "truncated", f"version {v}: stream ended with "
                f"{a.manifest.num_buckets - a.received} of {a.manifest.num_buckets} buckets missing"))
            self._failed.discard(v)

    async def _reject(self, version: int, exc: TransferError) -> None:
        log.warning("rejecting version %d (%s): %s; keeping version %d",
                    version, exc.reason, exc, self.applied_policy_version)
        self._partial.pop(version, None)
        self._failed.add(version)
        self.rejected.append((version, exc.reason))
        SYNC_FAILURES.labels(exc.reason).inc()
        await self.ack_fn(version, False, f"{exc.reason}: {exc}")

    # --- applying ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Apply verified versions until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ready, self._ready = self._ready, None
            if ready is None or ready[0].policy_version <= self.applied_policy_version:
                continue
            manifest, assembly = ready
            version = manifest.policy_version
            try:
                tensors = assembly.tensors()
                del assembly, ready
                await self.apply_fn(version, tensors)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine refused the version: report it, keep serving
                log.exception("applying version %d failed", version)
                self._failed.add(version)
                self.rejected.append((version, "apply"))
                SYNC_FAILURES.labels("apply").inc()
                await self.ack_fn(version, False, f"apply: {exc!r}")
                continue
            self.applied_policy_version = version
            self.applied.append(version)
            POLICY_VERSION.labels(self.component).set(version)
            async with self._applied_event:
                self._applied_event.notify_all()
            await self.ack_fn(version, True, "")

    async def wait_applied(self, version: int) -> None:
        """Return once `version` (or a newer one) has been applied."""
        async with self._applied_event:
            await self._applied_event.wait_for(lambda: self.applied_policy_version >= version)
