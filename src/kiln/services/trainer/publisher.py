"""`WeightPublisher` over the weight-sync service, callable from the stage runner's thread.

The gRPC channel lives on the service's event loop; the training thread hands each publish to
that loop and waits for the commit, so a step never overlaps the publish of its own weights.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

import torch

from kiln.services.common import metrics
from kiln.services.weight_sync.client import PublishError, publish

log = logging.getLogger("kiln.trainer.publisher")


class GrpcWeightPublisher:
    """Retryable failures (weight-sync restarting, a transfer cut) are retried with backoff for
    `retry_seconds`: a weight-sync that is killed comes back on the same address, and the stage
    should wait for it rather than fail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, channel, *, bucket_bytes: int,
                 timeout: float, retry_seconds: float = 300.0) -> None:
        self.loop, self.channel = loop, channel
        self.bucket_bytes, self.timeout, self.retry_seconds = bucket_bytes, timeout, retry_seconds

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = list(named_tensors)
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.5
        while True:
            fut = asyncio.run_coroutine_threadsafe(
                # No snapshot: this thread waits for the commit, so the weights hold still.
                publish(self.channel, version, tensors, self.bucket_bytes, timeout=self.timeout,
                        snapshot=False), self.loop)
            try:
                fut.result(self.timeout + 30)
                metrics.POLICY_VERSION.labels("trainer").set(version)
                return
            except PublishError as exc:
                if not exc.retryable or time.monotonic() + delay > deadline:
                    raise
                log.warning("publishing version %d failed (%s); retrying in %.1f s", version, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
