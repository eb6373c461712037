"""`WeightPublisher` over the weight-sync service, callable from the stage runner's thread.

The gRPC channel lives on the service's event loop; the training thread hands each publish to
that loop and waits for the commit, so a step never overlaps the publish of its own weights.
"""
from __future__ import annotations

import asyncio
from typing import Iterable

import torch

from kiln.services.common import metrics
from kiln.services.weight_sync.client import PublishError, publish


class GrpcWeightPublisher:
    def __init__(self, loop: asyncio.AbstractEventLoop, channel, *, bucket_bytes: int,
                 timeout: float, attempts: int = 3) -> None:
        self.loop, self.channel = loop, channel
        self.bucket_bytes, self.timeout, self.attempts = bucket_bytes, timeout, attempts

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = list(named_tensors)
        for attempt in range(1, self.attempts + 1):
            fut = asyncio.run_coroutine_threadsafe(
                publish(self.channel, version, tensors, self.bucket_bytes, timeout=self.timeout), self.loop)
            try:
                fut.result(self.timeout + 30)
                metrics.POLICY_VERSION.labels("trainer").set(version)
                return
            except PublishError as exc:
                if not exc.retryable or attempt == self.attempts:
                    raise
