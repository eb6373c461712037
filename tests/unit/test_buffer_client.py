"""The buffer clients: the gRPC one against a real server on a loopback port (status codes,
acks, retry on a full buffer, wake-up of a waiting GetBatch by a Put or an expiring lease), and
the in-process one running a small asynchronous RL loop (producer thread + trainer loop that
acks) in one test."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from kiln.protos.kiln.v1 import buffer_pb2_grpc
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferConfig, BufferFull
from kiln.services.buffer.client import (
    Backoff,
    BufferClient,
    GrpcBufferClient,
    InProcessBufferClient,
    make_client,
)
from kiln.services.buffer.leases import AckStatus
from kiln.services.buffer.servicer import BufferServicer
from kiln.services.buffer.synthetic import synthetic_group, synthetic_trajectory
from kiln.services.common.server import Registration, create_server


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TrajectoryBuffer, str]]:
    """A Buffer gRPC server on 127.0.0.1, its event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    buf = TrajectoryBuffer.open(tmp_path, BufferConfig(group_size=2, capacity=4, tau=2,
                                                       lease_timeout=0.5))
    servicer = BufferServicer(buf)
    reg = Registration(buffer_pb2_grpc.add_BufferServicer_to_server, servicer, "kiln.v1.Buffer")
    server, port = asyncio.run_coroutine_threadsafe(
        create_server("127.0.0.1:0", [reg]), loop).result(10)
    try:
        yield buf, f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        asyncio.run_coroutine_threadsafe(servicer.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_grpc_round_trip(served: tuple[TrajectoryBuffer, str]) -> None:
    _, target = served
    client: BufferClient = GrpcBufferClient(target)
    g = synthetic_group("g", 2, tokens=64, version=1, rewards=[1.0, 0.0])
    r = client.put(g)
    assert (r.accepted, r.duplicates, r.depth) == (2, 0, 2)
    assert client.put(g).duplicates == 2
    batch = client.get_batch(2, 2, timeout=1)
    assert batch.staleness == [1, 1] and batch.policy_version == 2
    assert (batch.batch_id, batch.delivery) == (1, 1)
    assert batch.trajectories == g  # as they were put, rewards and all
    st = client.status()
    assert (st.leased, st.leases, st.served, st.lease_timeout) == (2, 1, 0, 0.5)
    ack = client.ack_batch(batch.batch_id)
    assert (ack.status, ack.trajectories) == (AckStatus.ACKED, 2)
    again = client.ack_batch(batch.batch_id)
    assert (again.status, again.trajectories) == (AckStatus.ALREADY_ACKED, 0)
    unknown = client.ack_batch(7)
    assert unknown.status == AckStatus.UNKNOWN and "no batch 7" in unknown.detail
    st = client.set_policy_version(3)
    assert (st.policy_version, st.served, st.tau, st.max_staleness) == (3, 2, 2, 1)
    assert (st.leased, st.batches, st.batches_acked) == (0, 1, 1)
    st = client.configure(group_size=4, tau=None)
    assert st.group_size == 4 and st.tau is None
    assert client.status() == st
    client.close()


def test_grpc_invalid_argument_is_not_retried(served: tuple[TrajectoryBuffer, str]) -> None:
    _, target = served
    client = GrpcBufferClient(target, backoff=Backoff(max_wait=30))
    bad = synthetic_trajectory("bad", "g")
    bad.loss_mask = bad.loss_mask[:-1]
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.put([bad, synthetic_trajectory("ok", "g")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'bad'" in err.value.details()
    assert time.monotonic() - start < 30  # not retried for the backoff's 30 s
    client.put(synthetic_group("x", 2))
    # A batch of 1 cannot hold a group of 2: the group is dropped (`oversize`), not an error
    # that would stop every later batch.
    assert client.get_batch(1, 0, timeout=0).trajectories == []
    assert client.status().dropped_other == 2
    client.close()


def test_grpc_put_backs_off_until_the_trainer_drains(served: tuple[TrajectoryBuffer, str]) -> None:
    buf, target = served
    client = GrpcBufferClient(target, backoff=Backoff(initial=0.02, maximum=0.1, max_wait=30))
    client.put(synthetic_group("a", 2) + synthetic_group("b", 2))  # full (capacity 4)
    start = time.monotonic()  # before the timer: the drain comes no sooner than 0.5 s after
    drained = threading.Timer(0.5, lambda: buf.ack_batch(buf.try_get_batch(4, 0).batch_id))
    drained.start()
    r = client.put(synthetic_group("c", 2))
    assert r.accepted == 2 and time.monotonic() - start >= 0.49
    # With no one draining, the client gives up with the retryable code.
    client.put(synthetic_group("d", 2))
    quick = GrpcBufferClient(target, backoff=Backoff(initial=0.02, maximum=0.05, max_wait=0.3))
    with pytest.raises(grpc.RpcError) as err:
        quick.put(synthetic_group("e", 2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    drained.join()
    client.close()
    quick.close()


def test_grpc_get_batch_is_woken_by_put(served: tuple[TrajectoryBuffer, str]) -> None:
    _, target = served
    trainer, rollout = GrpcBufferClient(target), GrpcBufferClient(target)
    start = time.monotonic()  # before the timer: the put comes no sooner than 0.3 s after
    late = threading.Timer(0.3, lambda: rollout.put(synthetic_group("late", 2)))
    late.start()
    batch = trainer.get_batch(2, 0, timeout=120)
    elapsed = time.monotonic() - start
    assert len(batch.trajectories) == 2 and 0.29 <= elapsed < 60  # woken, not timed out
    late.join()
    start = time.monotonic()
    assert trainer.get_batch(2, 0, timeout=0.3).trajectories == []
    assert time.monotonic() - start >= 0.3
    trainer.close()
    rollout.close()


def test_grpc_get_batch_is_woken_by_an_expiring_lease(served: tuple[TrajectoryBuffer, str]) -> None:
    _, target = served
    client = GrpcBufferClient(target)
    client.put(synthetic_group("g", 2))
    start = time.monotonic()  # before the lease: it runs out no sooner than 0.5 s after
    first = client.get_batch(2, 0, timeout=1)
    # No Put comes: only the lease timeout (0.5 s) makes a batch servable again.
    again = client.get_batch(2, 0, timeout=120)
    elapsed = time.monotonic() - start
    assert 0.49 <= elapsed < 60
    assert (again.batch_id, again.delivery) == (first.batch_id, 2)
    assert [t.id for t in again.trajectories] == [t.id for t in first.trajectories]
    assert client.ack_batch(again.batch_id).status == AckStatus.ACKED
    assert client.status().redeliveries == 1
    client.close()


def test_in_process_rl_loop(tmp_path: Path) -> None:
    """Rollout keeps generating at whatever version it last saw; the trainer steps on batches of
    whole groups and advances the version; freshness bounds what it trains on."""
    buffer = TrajectoryBuffer.open(tmp_path, BufferConfig(group_size=4, capacity=16, tau=1))
    client: BufferClient = InProcessBufferClient(buffer, backoff=Backoff(max_wait=0.5))
    version = [0]
    stop = threading.Event()
    produced: list[str] = []

    def rollout() -> None:
        i = 0
        while not stop.is_set():
            v = version[0]
            group = synthetic_group(f"g{i}", 4, version=v, rewards=[1.0, 0.0, 0.0, float(i % 2)])
            while not stop.is_set():
                try:
                    client.put(group)  # backs off while the buffer is full
                    break
                except BufferFull:
                    continue
            else:
                return
            produced.extend(t.id for t in group)
            i += 1
            # Rollout lags behind sometimes, producing stale data.
            time.sleep(0.03 if i % 5 else 0.15)

    thread = threading.Thread(target=rollout)
    thread.start()
    trained: list[str] = []
    try:
        for step in range(8):
            batch = client.get_batch(8, version[0], timeout=20)
            assert len(batch.trajectories) == 8
            assert all(s <= 1 for s in batch.staleness)
            for k in range(0, 8, 4):
                group = batch.trajectories[k:k + 4]
                assert len({t.group_id for t in group}) == 1  # whole groups, in order
            trained += [t.id for t in batch.trajectories]
            assert client.ack_batch(batch.batch_id).status == AckStatus.ACKED
            version[0] = step + 1
            client.set_policy_version(version[0])
    finally:
        stop.set()
        thread.join(30)
    st = client.status()
    assert len(trained) == len(set(trained)) == st.served == 64
    assert st.accepted == len(produced)
    assert st.leased == 0 and st.redeliveries == 0
    assert st.served + st.dropped_stale + st.depth == st.accepted
    client.close()


def test_make_client(tmp_path: Path) -> None:
    local = make_client(f"local:{tmp_path}", BufferConfig(group_size=2))
    assert isinstance(local, InProcessBufferClient) and local.status().group_size == 2
    local.close()
    remote = make_client("127.0.0.1:1")
    assert isinstance(remote, GrpcBufferClient)
    remote.close()


def test_put_async_retries_a_full_buffer_and_gives_up_when_no_longer_wanted(
        served: tuple[TrajectoryBuffer, str]) -> None:
    """The producer's Put: backpressure is waited out while the data is wanted, and abandoned
    (nothing stored) once the stage it belongs to is over."""
    buf, target = served
    client = GrpcBufferClient(target, backoff=Backoff(initial=0.02, maximum=0.05, max_wait=30))
    client.put(synthetic_group("a", 2) + synthetic_group("b", 2))  # capacity 4: full

    async def scenario():
        wanted = [True]
        abandoned = asyncio.ensure_future(client.put_async(
            synthetic_group("late", 2), 2, still_wanted=lambda: wanted[0]))
        stored = asyncio.ensure_future(client.put_async(synthetic_group("c", 2), 2))
        await asyncio.sleep(0.3)
        assert not abandoned.done() and not stored.done()  # both waiting on the full buffer
        wanted[0] = False
        assert await abandoned is None
        batch = await asyncio.to_thread(buf.try_get_batch, 2, 0)
        await asyncio.to_thread(buf.ack_batch, batch.batch_id)  # room for one group
        result = await asyncio.wait_for(stored, 60)
        await client.aclose()
        return result

    result = asyncio.run(scenario())
    client.close()
    assert result.accepted == 2
    assert not any(i.startswith("late/") for i in buf.index.known)
