"""`WeightPublisher` over the weight-sync service, callable from the stage runner's thread.

The gRPC channel lives on the service's event loop; the training thread hands each publish to
that loop and waits for the commit, so a step never overlaps the publish of its own weights.
With `record`, the bytes each committed version carried go to that JSON file
(`bytes_per_version`, `policy_version`: a LoRA job's versions carry the adapter alone), which a
local run's summary reports as `weight_sync_bytes_per_version`.

A LoRA adapter on weights that earlier full-weight stages trained (`adapter_base`) is published
as needing its base: a weight-sync that restarted since that base was published refuses it
("no-base"), and the base is published again first, at its own version (`WeightStore.open_base`),
so replicas that join later still get it before the adapter.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from kiln.services.common import metrics
from kiln.services.weight_sync.client import PublishError, publish

log = logging.getLogger("kiln.trainer.publisher")


class GrpcWeightPublisher:
    """Retryable failures (weight-sync restarting, a transfer cut) are retried with backoff for
    `retry_seconds`: a weight-sync that is killed comes back on the same address, and the stage
    should wait for it rather than fail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, channel, *, bucket_bytes: int,
                 timeout: float, retry_seconds: float = 300.0, record: Path | None = None) -> None:
        self.loop, self.channel, self.record = loop, channel, record
        self.bucket_bytes, self.timeout, self.retry_seconds = bucket_bytes, timeout, retry_seconds
        self.adapter_base: Callable[[], tuple[int, Iterable[tuple[str, torch.Tensor]]] | None] = \
            lambda: None
        """(version, complete weights) of the base the published adapter applies to, when
        earlier stages trained it (the stage runner sets it: `TrainerEngine.adapter_base`)."""

    def _send(self, version: int, tensors: list, role: str) -> None:
        fut = asyncio.run_coroutine_threadsafe(
            # No snapshot: this thread waits for the commit, so the weights hold still.
            publish(self.channel, version, tensors, self.bucket_bytes, timeout=self.timeout,
                    snapshot=False, role=role), self.loop)
        fut.result(self.timeout + 30)

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = list(named_tensors)
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.5
        base = self.adapter_base()
        while True:
            try:
                try:
                    self._send(version, tensors, "needs-base" if base is not None else "version")
                except PublishError as exc:
                    if base is None or "no-base" not in str(exc):
                        raise
                    log.warning("weight-sync holds no base for adapter version %d (it restarted): "
                                "publishing the base, version %d, first", version, base[0])
                    self._send(base[0], list(base[1]), "base")
                    self._send(version, tensors, "needs-base")
                metrics.POLICY_VERSION.labels("trainer").set(version)
                if self.record is not None:
                    record_version_bytes(self.record, version, sum(t.numel() * t.element_size() for _, t in tensors))
                return
            except PublishError as exc:
                if not exc.retryable or time.monotonic() + delay > deadline:
                    raise
                log.warning("publishing version %d failed (%s); retrying in %.1f s", version, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


def record_version_bytes(path: Path, version: int, nbytes: int) -> None:
    """Replace `path` with `{"bytes_per_version": nbytes, "policy_version": version}`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"bytes_per_version": nbytes, "policy_version": version}))
    tmp.replace(path)
