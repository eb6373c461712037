"""Weight sync end to end: from the trainer's publish to every replica serving the new version.

    nice python benchmarks/weight_sync/e2e.py                 # 1 and 4 replicas, ~3-5 min on 2 cores
    nice python benchmarks/weight_sync/e2e.py --replicas 1 2 4 --versions 5
    nice python benchmarks/weight_sync/e2e.py --plain          # what mutual TLS costs (not the figure)

What one run measures, on loopback with mutual TLS (the way `kiln run` and clusters serve it):

- end to end: the trainer's `publish` (packing its tensors included: digests read from the
  tensors, bytes cut as each bucket is sent, as `GrpcWeightPublisher` does) to a `kiln-weight-sync`
  process, which forwards each verified bucket to every subscribed replica while the publish is
  still arriving; each replica is its own process running the rollout side's real path
  (`subscribe_and_apply`: receive, verify every bucket and the manifest digest, apply) into a
  real engine, and the time stops when the last replica's engine reports the new version
  (`engine.policy_version` right after its `apply_weights` returned). The engine is the torch
  engine (`TorchEngine`, transformers on the CPU: in-place copy of every weight under the lock
  that orders weight updates with decoding steps); four vLLM engines do not fit two cores
  (`--engine vllm --replicas 1` measures vLLM's in-place reload instead);
- raw: the same bytes over plain loopback sockets from this process to R receiver processes at
  once (one socket each, `sendall` of the buckets, `recv_into` one preallocated buffer), the
  ceiling of moving the version to R replicas with no framing, checks or engine.

Both are measured in the same run, interleaved, best of `--versions` each (the raw one once more
after the last), so a busy machine lowers the ratio rather than flattering it. Each row also
splits the best run: packing, the commit at the service, the last replica's verification (with
cut-through it trails the commit by the last buckets' trip) and its engine's apply. The model is a tiny-architecture Qwen2 checkpoint
(`kiln.models.tiny`) of about 105 M parameters in bf16, written to a temporary folder.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
import tempfile
import threading
import time
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import make_model_dir, receive_exactly, start_service  # noqa: E402  (the sibling benchmark's helpers)

from kiln.services.weight_sync import client as ws  # noqa: E402
from kiln.services.weight_sync.buckets import DEFAULT_BUCKET_BYTES, pack  # noqa: E402

GiB = 1 << 30


# --- raw sockets -------------------------------------------------------------------------------


def _raw_receiver(port_q, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        if conn.recv(1) == b"q":
            break
        receive_exactly(conn, total)
        conn.sendall(b"k")
        conn.close()
    srv.close()


class RawFanout:
    """R receiver processes, each taking the whole version over its own loopback socket."""

    def __init__(self, replicas: int, total: int) -> None:
        ctx = get_context("spawn")
        q = ctx.Queue()
        self.procs = [ctx.Process(target=_raw_receiver, args=(q, total)) for _ in range(replicas)]
        for p in self.procs:
            p.start()
        self.ports = [q.get(timeout=120) for _ in self.procs]

    def seconds(self, buckets) -> float:
        socks = [socket.create_connection(("127.0.0.1", port)) for port in self.ports]
        for s in socks:
            s.sendall(b"v")

        def send(s: socket.socket) -> None:
            for b in buckets:
                s.sendall(b.data)
            if s.recv(1) != b"k":
                raise RuntimeError("receiver did not confirm")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=send, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        for s in socks:
            s.close()
        return dt

    def close(self) -> None:
        for port in self.ports:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"q")
        for p in self.procs:
            p.join(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- replicas ----------------------------------------------------------------------------------


def _replica(name: str, model_dir: str, tls_dir: str, port: int, reports, stop,
             group: tuple[str, int, int] | None, engine_kind: str) -> None:
    """A rollout replica: the real engine, the real subscription (and, with `group`, a rank of
    the collective feeding the same receiver); reports each version its engine serves, with the
    (system-wide monotonic) time it started serving it."""
    torch.set_num_threads(1)

    async def main() -> None:
        from kiln.control.channels import aio_channel
        from kiln.services.rollout.engine import EngineSettings
        from kiln.services.rollout.torch_engine import TorchEngine
        from kiln.tls import read_bundle

        if engine_kind == "vllm":
            from kiln.services.rollout.vllm_engine import VllmEngine
            engine = await VllmEngine.start(EngineSettings(
                model=model_dir, dtype="bfloat16", kv_cache_bytes=64 << 20, max_model_len=256))
        else:
            engine = await TorchEngine.start(EngineSettings(model=model_dir, dtype="bfloat16"))
        plain = os.environ.get("KILN_INSECURE") == "1"

        async def apply(version, tensors) -> None:
            verified = time.monotonic()  # every bucket and the manifest digest checked
            await engine.apply_weights(version, tensors)
            reports.put((name, engine.policy_version, time.monotonic(), verified))

        async with aio_channel(f"127.0.0.1:{port}", "weight-sync",
                               bundle=None if plain else read_bundle(Path(tls_dir) / "rollout")) as ch:
            receiver = ws.make_receiver(ch, name, apply)
            tasks = [asyncio.create_task(ws.subscribe_and_apply(ch, name, apply, receiver=receiver))]
            if group is not None:
                from kiln.services.weight_sync.broadcast import BroadcastReceiver, make_group
                pg = await asyncio.to_thread(make_group, "gloo", *group)
                tasks.append(asyncio.create_task(BroadcastReceiver(pg).feed(receiver)))
            reports.put((name, engine.policy_version, time.monotonic(), time.monotonic()))
            await asyncio.to_thread(stop.wait)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await engine.close()

    asyncio.run(main())


class Replicas:
    def __init__(self, count: int, model_dir: Path, tls: Path, port: int, tag: str,
                 group_address: str | None = None, engine: str = "torch") -> None:
        ctx = get_context("spawn")
        self.reports, self.stop = ctx.Queue(), ctx.Event()
        self.names = [f"{tag}-{i}" for i in range(count)]
        self.procs = [ctx.Process(target=_replica, args=(
            n, str(model_dir), str(tls), port, self.reports, self.stop,
            (group_address, i + 1, count + 1) if group_address else None, engine))
            for i, n in enumerate(self.names)]
        for p in self.procs:
            p.start()
        self.version = {n: -1 for n in self.names}
        self.served_at: dict[tuple[str, int], float] = {}
        self.verified_at: dict[tuple[str, int], float] = {}

    def wait_all(self, version: int, timeout: float = 600.0) -> tuple[float, float]:
        """The times the last replica had `version` verified and started serving it."""
        deadline = time.monotonic() + timeout
        while min(self.version.values()) < version:
            left = deadline - time.monotonic()
            if left <= 0 or not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"replicas did not all reach version {version}: {self.version}")
            try:
                name, v, at, verified = self.reports.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: check the deadline and the processes again
                continue
            self.version[name] = max(self.version[name], v)
            self.served_at[(name, v)], self.verified_at[(name, v)] = at, verified
        return (max(self.verified_at.get((n, version), math.inf) for n in self.names),
                max(self.served_at.get((n, version), math.inf) for n in self.names))

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


# --- driver ------------------------------------------------------------------------------------


async def publish(port: int, tls: Path, version: int, tensors, bucket_bytes: int) -> tuple[float, float, float]:
    """Publish as the trainer does; (start time, packing seconds, commit time)."""
    from kiln.control.channels import aio_channel
    from kiln.tls import read_bundle

    bundle = None if os.environ.get("KILN_INSECURE") == "1" else read_bundle(tls / "trainer")
    async with aio_channel(f"127.0.0.1:{port}", "weight-sync", bundle=bundle) as ch:
        await ch.channel_ready()
        t0 = time.monotonic()
        # As the trainer's publisher does: its thread waits for the commit, so no snapshot.
        r = await ws.publish(ch, version, tensors, bucket_bytes, snapshot=False)
        committed = time.monotonic()
    return t0, r.pack_seconds, committed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--versions", type=int, default=3, help="versions published per replica count (best kept)")
    ap.add_argument("--layers", type=int, default=9, help="decoder layers (9: ~105 M parameters)")
    ap.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    ap.add_argument("--plain", action="store_true",
                    help="plain text instead of mutual TLS (to see what TLS costs; not the figure)")
    ap.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                    help="the replicas' engine (vLLM: one or two replicas fit 2 cores)")
    ap.add_argument("--broadcast", action="store_true",
                    help="also publish every other version over the gloo collective (broadcast.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from kiln.tls import INSECURE_ENV, issue_all

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root, 1024, args.layers, 16, 2816, "bfloat16")
        base = list(load_file(str(model_dir / "model.safetensors")).items())
        n_params = sum(t.numel() for _, t in base)
        total = sum(t.nbytes for _, t in base)
        print(f"model: {n_params / 1e6:.1f} M params, bf16, {total / 2**20:.0f} MiB in {len(base)} tensors; "
              f"{args.bucket_bytes >> 10} KiB buckets; {args.engine} engine; {'plain text' if args.plain else 'mTLS'}; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} cores", flush=True)
        # Two distinct versions of the weights, alternated.
        variants = [[(n, (t * s).to(t.dtype)) for n, t in base] for s in (1.01, 0.99)]
        ref = pack(1, base, args.bucket_bytes)
        issue_all(root / "tls", "bench")
        run = root / "svc"
        run.mkdir()
        if args.plain:
            os.environ[INSECURE_ENV] = "1"  # the replicas inherit it
        svc, port = start_service(run, None if args.plain else root / "tls")
        version = 0
        results, collective = [], []
        try:
            for count in args.replicas:
                raw = RawFanout(count, total)
                group = f"127.0.0.1:{_free_port()}" if args.broadcast else None
                reps = Replicas(count, model_dir, root / "tls", port, f"r{count}", group, args.engine)
                sender = None
                try:
                    if group:
                        from kiln.services.weight_sync.broadcast import BroadcastSender, make_group
                        sender = BroadcastSender(make_group("gloo", group, 0, count + 1))
                    reps.wait_all(version)  # engines up, subscribed, on the latest version
                    e2e_s, raw_s, parts, bcast_s = [], [], [], []
                    for i in range(args.versions):
                        if sender is not None:
                            # Rank 0 of the collective, no TLS (as NCCL on a cluster's own fabric).
                            version += 1
                            t0 = time.monotonic()
                            sender.send(pack(version, variants[version % 2], args.bucket_bytes,
                                             snapshot=False))
                            bcast_s.append(reps.wait_all(version)[1] - t0)
                        raw_s.append(raw.seconds(ref.buckets))
                        version += 1
                        t0, pack_s, committed = asyncio.run(publish(
                            port, root / "tls", version, variants[version % 2], args.bucket_bytes))
                        verified, served = reps.wait_all(version)
                        e2e_s.append(served - t0)
                        parts.append((pack_s, committed - t0, verified - t0, served - verified))
                    raw_s.append(raw.seconds(ref.buckets))
                    if sender is not None:
                        sender.close()
                finally:
                    reps.close()
                    raw.close()
                best_e2e, best_raw = min(e2e_s), min(raw_s)
                pack_s, commit_s, verified_s, apply_s = parts[e2e_s.index(best_e2e)]
                print(f"{count} replica(s): end to end {best_e2e:.3f} s (all: "
                      f"{', '.join(f'{t:.2f}' for t in e2e_s)}), raw sockets {best_raw:.3f} s (all: "
                      f"{', '.join(f'{t:.2f}' for t in raw_s)}) = {count * total / best_raw / GiB:.2f} "
                      f"GiB/s delivered", flush=True)
                print(f"  best run, from the publish call: packed {pack_s:.2f} s, committed at the "
                      f"service {commit_s:.2f} s, verified on the last replica {verified_s:.2f} s, "
                      f"then its engine's apply {apply_s:.2f} s", flush=True)
                results.append((count, best_raw / best_e2e))
                if bcast_s:
                    print(f"  collective (gloo broadcast, plain TCP): {min(bcast_s):.3f} s (all: "
                          f"{', '.join(f'{t:.2f}' for t in bcast_s)})", flush=True)
                    collective.append((count, best_raw / min(bcast_s)))
        finally:
            svc.terminate()
            svc.wait(10)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for count, ratio in collective:
        print(f"broadcast/raw: {ratio:.0%} ({count} replicas)")
    for count, ratio in results:
        print(f"end-to-end/raw: {ratio:.0%} ({count} replicas)")
    return 0 if all(math.isfinite(r) for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
