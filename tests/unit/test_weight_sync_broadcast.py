"""The collective transport on gloo: rank 0 broadcasts versions, two ranks verify and apply them.

Each rank runs on its own thread with its own gloo process group over a real loopback TCP store
(gloo groups need not be a process's default group), so the test stays quick.
"""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import torch

from kiln.services.weight_sync.broadcast import BroadcastReceiver, BroadcastSender, make_group
from kiln.services.weight_sync.buckets import pack
from kiln.services.weight_sync.receiver import ReplicaReceiver


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(16, generator=g)),
            ("lm_head.weight", torch.randn(50, 16, generator=g))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_delivers_exact_versions_and_a_corrupt_bucket_is_refused() -> None:
    address, world = f"127.0.0.1:{_free_port()}", 3
    v1, v2, v3 = (pack(v, _tensors(v), 200) for v in (1, 2, 3))
    bad = bytearray(v2.buckets[2].data)
    bad[0] ^= 0x01
    v2_corrupt = dataclasses.replace(v2, buckets=[*v2.buckets[:2], dataclasses.replace(
        v2.buckets[2], data=bytes(bad)), *v2.buckets[3:]])
    served: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {1: [], 2: []}
    rejected: dict[int, list] = {}
    errors: list[BaseException] = []

    def replica(rank: int) -> None:
        async def main() -> None:
            async def apply(version, tensors) -> None:
                served[rank].append((version, {n: t.clone() for n, t in tensors}))

            receiver = ReplicaReceiver(apply)
            task = asyncio.create_task(receiver.run())
            await BroadcastReceiver(make_group("gloo", address, rank, world, 60)).feed(receiver)
            await asyncio.wait_for(receiver.wait_applied(3), 60)
            task.cancel()
            rejected[rank] = receiver.rejected

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = BroadcastSender(make_group("gloo", address, 0, world, 60), chunk_bytes=500)
    sender.send(v1)
    # Both serve 1 before 3 comes (a replica that has 3 verified skips a 1 not yet applied).
    deadline = time.monotonic() + 120
    while not (served[1] and served[2]) and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    for packed in (v2_corrupt, v3):
        sender.send(packed)
    sender.close()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    for rank in (1, 2):
        assert [v for v, _ in served[rank]] == [1, 3] and rejected[rank] == [(2, "checksum")]
        for (version, got), seed in zip(served[rank], (1, 3)):
            assert all(torch.equal(got[n], t) for n, t in _tensors(seed))
