"""A real `kiln-buffer` process under load, killed with SIGKILL mid-run and restarted on the same
run directory, three times: every trajectory a Put acknowledged is trained on and acked exactly
once, by a trainer-like loop that gets, trains, acks and carries on across the restarts.

The kills land (1) wherever the load happens to be, (2) while the trainer holds a trained batch
whose ack has not been sent (it acks after the restart: the lease survived), and (3) the same,
but the trainer forgets the pending ack, as a trainer that crashed would: the batch is served
again under its batch id and the trainer, which remembers the ids it trained on, skips it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.services.buffer.types import Batch
from kiln.services.buffer.client import Backoff, GrpcBufferClient
from kiln.services.buffer.leases import AckStatus
from kiln.services.buffer.synthetic import synthetic_group
from kiln.trajectory import Trajectory

pytestmark = pytest.mark.slow

GROUP = 4
BATCH = 8


class BufferProcess:
    def __init__(self, run_dir: Path, *extra: str) -> None:
        self.port_file = run_dir / "buffer-ports.json"
        self.port_file.unlink(missing_ok=True)
        self.log = open(run_dir / "buffer.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.services.buffer.main", "--address", "127.0.0.1:0",
             "--metrics-port", "0", "--run-dir", str(run_dir), "--port-file", str(self.port_file),
             "--group-size", str(GROUP), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "KILN_LOG_FORMAT": "text"})
        self.target = self._wait_serving(30)

    def _wait_serving(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"buffer did not start (exit {self.proc.poll()})")
            time.sleep(0.05)
        target = f"127.0.0.1:{json.loads(self.port_file.read_text())['port']}"
        with grpc.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service="kiln.v1.Buffer"), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return target
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("buffer never reported SERVING")
                time.sleep(0.05)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(20)
        self.log.close()
        return rc


class Trainer:
    """Trains (records the ids of) each batch once and acks it. It outlives buffer restarts and
    remembers the batch ids it trained on, as a trainer's checkpoint would, so that a batch served
    again after a lost ack is acked without being trained on twice."""

    def __init__(self) -> None:
        self.trained: dict[int, list[str]] = {}
        self.trained_ids: list[str] = []  # every id trained on, in order: repeats would show
        self.unacked: int | None = None  # trained on, ack not yet confirmed
        self.acks: list[tuple[int, AckStatus]] = []
        self.duplicates: list[tuple[int, int]] = []  # (batch_id, delivery) recognised
        self.received: list[Trajectory] = []
        self.errors: list[str] = []
        self.hold = threading.Event()  # train on the next batch but do not ack it
        self.holding = threading.Event()

    def run(self, client: GrpcBufferClient, *,
            drained: Callable[[], bool] | None = None) -> None:
        """Until the buffer goes away, or, given `drained`, until the buffer has nothing left
        and `drained()` says nothing more will come."""
        drain = drained is not None
        try:
            if self.unacked is not None:
                self._ack(client, self.unacked)
            while True:
                batch = client.get_batch(BATCH, 0, timeout=0.5 if drain else 1.0,
                                         allow_partial=drain)
                if not batch.trajectories:
                    if drain and drained():
                        return
                    continue
                self._train(batch)
                if self.hold.is_set():
                    self.holding.set()
                    return
                self._ack(client, batch.batch_id)
        except grpc.RpcError:
            if drain:
                raise
        except AssertionError as exc:
            self.errors.append(repr(exc))

    def _train(self, batch: Batch) -> None:
        ids = [t.id for t in batch.trajectories]
        if batch.batch_id in self.trained:
            assert batch.delivery > 1, (batch.batch_id, batch.delivery)
            assert ids == self.trained[batch.batch_id], batch.batch_id
            self.duplicates.append((batch.batch_id, batch.delivery))
        else:
            self.trained[batch.batch_id] = ids
            self.trained_ids += ids
            self.received += batch.trajectories
        self.unacked = batch.batch_id

    def _ack(self, client: GrpcBufferClient, batch_id: int) -> None:
        r = client.ack_batch(batch_id)
        # ALREADY_ACKED: the buffer stored an ack whose answer the kill cut off.
        assert r.status in (AckStatus.ACKED, AckStatus.ALREADY_ACKED), (batch_id, r)
        self.acks.append((batch_id, r.status))
        self.unacked = None


class Load:
    """A rollout thread putting whole groups and the trainer taking batches, until the buffer
    goes away (their clients give up after a short backoff). The rollout first puts again what
    the last buffer process did not acknowledge (`retry`), as a real one would."""

    def __init__(self, target: str, first_group: int, trainer: Trainer,
                 retry: list[list[Trajectory]]) -> None:
        self.acked: dict[str, Trajectory] = {}
        self.unacked: list[list[Trajectory]] = []
        self.retry = retry
        self.next_group = first_group
        quick = Backoff(initial=0.02, maximum=0.2, max_wait=1.0)
        self._rollout = GrpcBufferClient(target, backoff=quick, rpc_timeout=5)
        self._trainer = GrpcBufferClient(target, backoff=quick, rpc_timeout=5)
        # Daemons: a failing test must not hang on a thread that is still trying.
        self._threads = [threading.Thread(target=self._put_loop, daemon=True),
                         threading.Thread(target=trainer.run, args=(self._trainer,), daemon=True)]
        for t in self._threads:
            t.start()

    def _put_loop(self) -> None:
        for i, trajs in enumerate(self.retry):
            try:
                r = self._rollout.put(trajs)
            except grpc.RpcError:
                self.unacked += self.retry[i:]
                return
            # Copies the killed process had stored count as duplicates.
            assert r.accepted + r.duplicates == len(trajs)
            self.acked.update((t.id, t) for t in trajs)
        while True:
            groups = [synthetic_group(f"g{self.next_group + k}", GROUP, tokens=200,
                                      rewards=[float(j == k % GROUP) for j in range(GROUP)])
                      for k in range(2)]
            self.next_group += 2
            trajs = [t for g in groups for t in g]
            try:
                self._rollout.put(trajs)
            except grpc.RpcError:
                self.unacked.append(trajs)  # a real rollout retries these after the restart
                return
            self.acked.update((t.id, t) for t in trajs)

    def join(self) -> None:
        for t in self._threads:
            t.join(30)
            assert not t.is_alive()
        self._rollout.close()
        self._trainer.close()


def test_kill9_loses_nothing_accepted_and_trains_nothing_twice(tmp_path: Path) -> None:
    acked: dict[str, Trajectory] = {}
    trainer = Trainer()
    held: dict[str, int | None] = {}
    next_group = 0
    unacked: list[list[Trajectory]] = []
    proc = BufferProcess(tmp_path, "--capacity", "64")
    for scenario in ("anywhere", "ack_pending", "trainer_forgot"):
        trained_before = len(trainer.trained_ids)
        load = Load(proc.target, next_group, trainer, unacked)
        deadline = time.monotonic() + 30
        while len(load.acked) < 120 or len(trainer.trained_ids) < trained_before + 48:
            assert time.monotonic() < deadline, "load did not get going"
            time.sleep(0.02)
        if scenario != "anywhere":
            trainer.hold.set()
            assert trainer.holding.wait(30), "trainer did not take a batch"
            held[scenario] = trainer.unacked
        proc.kill9()
        load.join()
        trainer.hold.clear()
        trainer.holding.clear()
        if scenario == "trainer_forgot":
            trainer.unacked = None
        acked.update(load.acked)
        next_group, unacked = load.next_group, load.unacked
        proc = BufferProcess(tmp_path, "--capacity", "64")

    # The rollout puts its last unacknowledged groups while the trainer drains the buffer.
    rollout, client = GrpcBufferClient(proc.target), GrpcBufferClient(proc.target)
    retried = threading.Thread(target=lambda: [rollout.put(t) for t in unacked], daemon=True)
    retried.start()
    trainer.run(client, drained=lambda: not retried.is_alive())
    retried.join()
    acked.update((t.id, t) for trajs in unacked for t in trajs)
    status = client.status()
    client.close()
    rollout.close()
    assert proc.stop() == 0

    assert trainer.errors == []
    ids = trainer.trained_ids
    assert len(ids) == len(set(ids)), "a trajectory was trained on twice"
    assert set(ids) == set(acked), "an accepted trajectory was lost"
    assert (status.served, status.accepted) == (len(acked), len(acked))
    assert (status.depth, status.leased, status.leases) == (0, 0, 0)
    # Every batch id issued was trained on once and acked.
    assert status.batches == status.batches_acked == len(trainer.trained)
    # The held batch's ack, sent after the restart, found its lease intact.
    assert (held["ack_pending"], AckStatus.ACKED) in trainer.acks
    # The forgotten one came back under its id and was recognised.
    assert held["trainer_forgot"] in [b for b, _ in trainer.duplicates]
    assert status.redeliveries >= 1
    # What came back is what went in.
    for t in trainer.received:
        sent = acked[t.id]
        assert t.reward == sent.reward
        assert (t.tokens, t.loss_mask, t.logp_infer, t.version_spans) == (
            sent.tokens, sent.loss_mask, sent.logp_infer, sent.version_spans)


def test_sigterm_restart_keeps_state(tmp_path: Path) -> None:
    proc = BufferProcess(tmp_path, "--tau", "1")
    client = GrpcBufferClient(proc.target)
    client.put(synthetic_group("a", GROUP, version=0) + synthetic_group("b", GROUP, version=1))
    client.put(synthetic_group("c", GROUP, version=1)[:2])
    first = client.get_batch(GROUP, 1, timeout=1)
    assert client.ack_batch(first.batch_id).status == AckStatus.ACKED
    second = client.get_batch(GROUP, 1, timeout=1)  # left unacked
    client.close()
    assert proc.stop() == 0
    proc = BufferProcess(tmp_path, "--tau", "1")
    client = GrpcBufferClient(proc.target)
    st = client.status()
    assert (st.depth, st.groups_pending, st.served, st.leased, st.policy_version, st.tau) == (
        2, 1, 4, GROUP, 1, 1)
    st = client.set_policy_version(3)  # c is now 2 behind: dropped, its late half too
    assert (st.depth, st.dropped_stale, st.leased) == (0, 2, GROUP)  # b is leased: not swept
    r = client.put(synthetic_group("c", GROUP, version=1)[2:])
    assert (r.accepted, r.dropped_stale) == (2, 2)
    # b would be served again, but it is stale now: dropped, and its batch id released.
    assert client.get_batch(GROUP, 3, timeout=0.2).trajectories == []
    assert client.ack_batch(second.batch_id).status == AckStatus.RELEASED
    st = client.status()
    assert (st.dropped_stale, st.leased, st.served) == (8, 0, 4)
    assert [t.group_id for t in first.trajectories] == ["a"] * GROUP
    assert [t.group_id for t in second.trajectories] == ["b"] * GROUP
    client.close()
    assert proc.stop() == 0
