"""Throughput of the buffer service over gRPC: Put, GetBatch and AckBatch of synthetic trajectories.

    python benchmarks/buffer/bench.py [--count 10000] [--tokens 500]

Starts a real `kiln-buffer` process on a temporary run directory (fsync'd segment files) and
measures, from one client process:
1. put:   every trajectory, `--put-batch` per Put call (one fsync each), nothing draining;
2. get:   all of them back in GetBatch calls of `--batch`, each batch acked (AckBatch) before
          the next GetBatch, as a trainer does; the time spent in acks is reported apart;
3. mixed: a rollout thread putting and a trainer thread getting and acking at the same time, on
          a buffer whose capacity (`--capacity`, counting leased batches) makes backpressure
          part of the run.
Put and get run twice, in plain text and with mutual TLS (certificates from `kiln.tls`), side by
side. Trajectory generation happens before the clock starts. Numbers depend on the disk's fsync
cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.services.buffer.client import GrpcBufferClient
from kiln.services.buffer.leases import AckStatus
from kiln.services.buffer.synthetic import synthetic_trajectory
from kiln.services.common import codec
from kiln.tls import TLS_DIR_ENV, issue_all, read_bundle
from kiln.control.channels import channel as tls_channel
from kiln.trajectory import Trajectory


def start_buffer(run_dir: Path, group_size: int, capacity: int,
                 tls: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A buffer process: mutual TLS with the certificates under `tls` (`kiln.tls.issue_all`),
    plain text without."""
    port_file = run_dir / "ports.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.services.buffer.main", "--address", "127.0.0.1:0",
         "--metrics-port", "0", "--run-dir", str(run_dir), "--port-file", str(port_file),
         "--group-size", str(group_size), "--capacity", str(capacity),
         *(["--tls-dir", str(tls / "buffer")] if tls else ["--insecure"])],
        stdout=subprocess.DEVNULL, stderr=open(run_dir / "buffer.log", "wb"))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"buffer did not start; see {run_dir / 'buffer.log'}")
        time.sleep(0.05)
    target = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
    with tls_channel(target, "buffer", bundle=read_bundle(tls / "operator") if tls else None) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status != \
                health_pb2.HealthCheckResponse.SERVING or not _has_buffer(stub):
            time.sleep(0.05)
    return proc, target


def _has_buffer(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service="kiln.v1.Buffer"), timeout=5).status \
            == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def make_trajectories(prefix: str, count: int, tokens: int, group_size: int) -> list[Trajectory]:
    # 64 distinct contents reused under fresh ids: building 10k random ones costs more than the
    # measurement, and the buffer does not look at the tokens.
    templates = [synthetic_trajectory("t", tokens=tokens, seed=k) for k in range(64)]
    return [dataclasses.replace(templates[i % 64], id=f"{prefix}{i}",
                                group_id=f"{prefix}g{i // group_size}", reward=float(i % 2))
            for i in range(count)]


def put_all(client: GrpcBufferClient, trajs: list[Trajectory], per_put: int) -> None:
    for i in range(0, len(trajs), per_put):
        r = client.put(trajs[i:i + per_put])
        assert r.accepted == len(trajs[i:i + per_put]), r


def get_all(client: GrpcBufferClient, count: int, batch: int) -> float:
    """Get and ack `count` trajectories; returns the seconds spent in AckBatch."""
    got, ack_s = 0, 0.0
    while got < count:
        b = client.get_batch(min(batch, count - got), 0, timeout=30)
        if not b.trajectories:
            raise RuntimeError(f"GetBatch timed out after {got} of {count}")
        t = time.perf_counter()
        r = client.ack_batch(b.batch_id)
        ack_s += time.perf_counter() - t
        if r.status != AckStatus.ACKED:
            raise RuntimeError(f"AckBatch({b.batch_id}) answered {r.status.name}: {r.detail}")
        got += len(b.trajectories)
    return ack_s


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--put-batch", type=int, default=64, help="trajectories per Put call")
    p.add_argument("--batch", type=int, default=64, help="trajectories per GetBatch call")
    p.add_argument("--capacity", type=int, default=1024, help="buffer capacity in the mixed run")
    args = p.parse_args(argv)
    if args.count % args.group_size or args.batch % args.group_size or args.put_batch % args.group_size:
        p.error("--count, --batch and --put-batch must be multiples of --group-size")

    t0 = time.perf_counter()
    first = make_trajectories("a", args.count, args.tokens, args.group_size)
    second = make_trajectories("b", args.count, args.tokens, args.group_size)
    wire = len(codec.to_bytes(first[0]))
    print(f"generated 2 x {args.count} trajectories of {args.tokens} tokens "
          f"(~{wire} bytes each on the wire) in {time.perf_counter() - t0:.1f} s")

    with tempfile.TemporaryDirectory(prefix="kiln-buffer-bench-") as tmp:
        certs = Path(tmp) / "tls"
        issue_all(certs, "bench")
        # Plain text first (the baseline), then mutual TLS as `kiln run` and clusters serve it;
        # the same trajectories, a fresh buffer for each.
        for mode in ("plain text", "mutual TLS"):
            tls = certs if mode == "mutual TLS" else None
            run_dir = Path(tmp) / f"sequential-{'tls' if tls else 'plain'}"
            run_dir.mkdir()
            proc, target = start_buffer(run_dir, args.group_size, capacity=args.count, tls=tls)
            # Put as rollout, get and ack as the trainer: the callers the buffer authorizes.
            if tls:
                os.environ[TLS_DIR_ENV] = str(certs / "rollout")
            rollout = GrpcBufferClient(target)
            if tls:
                os.environ[TLS_DIR_ENV] = str(certs / "trainer")
            trainer = GrpcBufferClient(target)
            try:
                t = time.perf_counter()
                put_all(rollout, first, args.put_batch)
                put_s = time.perf_counter() - t
                t = time.perf_counter()
                ack_s = get_all(trainer, args.count, args.batch)
                get_s = time.perf_counter() - t
            finally:
                rollout.close()
                trainer.close()
                stop(proc)
                os.environ.pop(TLS_DIR_ENV, None)
            mb = args.count * wire / 1e6
            print(f"{mode}:")
            print(f"  put:   {args.count / put_s:8.0f} trajectories/s  ({mb / put_s:6.1f} MB/s, "
                  f"{args.put_batch}/call, {put_s:.2f} s)")
            print(f"  get:   {args.count / get_s:8.0f} trajectories/s  ({mb / get_s:6.1f} MB/s, "
                  f"{args.batch}/call, {get_s:.2f} s, of which acks {ack_s:.2f} s: "
                  f"{1000 * ack_s / (args.count // args.batch):.1f} ms per ack)")

        run_dir = Path(tmp) / "mixed"
        run_dir.mkdir()
        proc, target = start_buffer(run_dir, args.group_size, capacity=args.capacity)  # plain text
        rollout, trainer = GrpcBufferClient(target), GrpcBufferClient(target)
        try:
            t = time.perf_counter()
            putter = threading.Thread(target=put_all, args=(rollout, second, args.put_batch))
            putter.start()
            get_all(trainer, args.count, args.batch)
            putter.join()
            mixed_s = time.perf_counter() - t
            status = trainer.status()
        finally:
            rollout.close()
            trainer.close()
            stop(proc)
        print(f"mixed: {args.count / mixed_s:8.0f} trajectories/s  end to end (put, get and ack "
              f"concurrently, capacity {args.capacity}, {mixed_s:.2f} s; served and acked "
              f"{status.served}, {status.redeliveries} served again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
