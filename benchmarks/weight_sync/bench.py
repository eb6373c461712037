"""Weight-sync throughput on loopback, against the ceiling of a raw TCP socket, and vLLM apply time.

    python benchmarks/weight_sync/bench.py            # ~2-3 min on 2 cores
    python benchmarks/weight_sync/bench.py --no-vllm  # transport only, ~1 min

What it measures, in one run:
1. raw TCP: one loopback socket moving the version's bytes from this process to a receiver
   process (sendall of the bucket buffers, recv_into one preallocated buffer) -- the ceiling;
2. publish: the trainer-side `publish_packed` of the same bytes to a `kiln-weight-sync` process,
   checksummed buckets, for several bucket sizes and numbers of parallel streams; the time runs
   from the first byte to the service's commit (every bucket verified); in plain text and
   again with mutual TLS (the way `kiln run` and clusters serve it), side by side;
3. subscribe: a replica joining late receives, verifies and assembles the version into tensors;
4. vLLM: `VllmEngine.apply_weights` for a tiny model and a ~100 M-parameter one.
Packing (the trainer's one copy of its weights) is reported separately, not in the transfer.
Random weights, bf16, shaped like a small Qwen2; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import torch

from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync.buckets import pack

GiB = 1 << 30


def model_tensors(params: int, dtype: torch.dtype = torch.bfloat16, hidden: int = 1024):
    """Random tensors shaped like a Qwen2 decoder with about `params` parameters."""
    inter = int(hidden * 2.75)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    vocab = 32768
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                (p + "self_attn.k_proj.weight", (hidden // 2, hidden)),
                (p + "self_attn.v_proj.weight", (hidden // 2, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return [(n, torch.randn(s, generator=g).to(dtype)) for n, s in out]


# --- raw TCP ceiling ---------------------------------------------------------------------------


def receive_exactly(conn: socket.socket, total: int) -> None:
    """Read `total` bytes from `conn` into one buffer, as a receiver that keeps them would."""
    view = memoryview(bytearray(total))
    got = 0
    while got < total:
        n = conn.recv_into(view[got:], min(total - got, 4 << 20))
        if n == 0:
            raise RuntimeError("sender closed early")
        got += n


def _tcp_receiver(port_q, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    receive_exactly(conn, total)
    conn.sendall(b"k")
    conn.close()
    srv.close()


def raw_tcp_seconds(buckets) -> float:
    total = sum(len(b.data) for b in buckets)
    ctx = get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_tcp_receiver, args=(q, total))
    proc.start()
    port = q.get(timeout=60)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for b in buckets:
        s.sendall(b.data)
    if s.recv(1) != b"k":
        raise RuntimeError("receiver did not confirm")
    dt = time.perf_counter() - t0
    s.close()
    proc.join()
    return dt


# --- gRPC --------------------------------------------------------------------------------------


def start_service(tmp: Path, tls: Path | None = None) -> tuple[subprocess.Popen, int]:
    """A weight-sync process: mutual TLS with the certificates under `tls`, plain text without."""
    port_file = tmp / "ports.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.services.weight_sync.main", "--address", "127.0.0.1:0",
         "--metrics-port", "0", "--port-file", str(port_file), "--run-dir", str(tmp),
         *(["--tls-dir", str(tls / "weight-sync")] if tls else ["--insecure"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("kiln-weight-sync did not start")
        time.sleep(0.05)
    return proc, json.loads(port_file.read_text())["port"]


async def grpc_runs(port: int, tensors, configs, repeats: int, total: int,
                    tls: Path | None = None) -> tuple[list[dict], dict]:
    from kiln.control.channels import aio_channel
    from kiln.tls import read_bundle

    results = []
    version = 0
    target = f"127.0.0.1:{port}"
    # Publish as the trainer, subscribe as rollout: the callers weight-sync authorizes.
    trainer = read_bundle(tls / "trainer") if tls else None
    rollout = read_bundle(tls / "rollout") if tls else None
    async with aio_channel(target, "weight-sync", bundle=trainer) as ch, \
            aio_channel(target, "weight-sync", bundle=rollout) as sub_ch:
        for bucket_bytes, streams in configs:
            t0 = time.perf_counter()
            packed = pack(version + 1, tensors, bucket_bytes)
            pack_s = time.perf_counter() - t0
            best = math.inf
            for _ in range(repeats):
                version += 1
                packed = pack(version, tensors, bucket_bytes) if version != packed.manifest.policy_version else packed
                r = await ws.publish_packed(ch, packed, streams=streams)
                best = min(best, r.seconds)
            results.append(dict(bucket_bytes=bucket_bytes, streams=streams, seconds=best,
                                pack_seconds=pack_s))
        # Subscribe: a replica joining late gets the latest version, verified and assembled.
        sub = {}
        for streams in (1, 2):
            done = asyncio.get_running_loop().create_future()

            async def apply(v, named, done=done):
                done.set_result(time.perf_counter())

            t0 = time.perf_counter()
            task = asyncio.create_task(ws.subscribe_and_apply(sub_ch, f"bench-{streams}", apply,
                                                              streams=streams))
            t1 = await asyncio.wait_for(done, 120)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub[streams] = t1 - t0
    return results, sub


# --- vLLM apply --------------------------------------------------------------------------------


async def vllm_apply(model_dir: Path, tensors, dtype: str) -> tuple[float, float]:
    from kiln.services.rollout.engine import EngineSettings, SamplingOptions
    from kiln.services.rollout.vllm_engine import VllmEngine

    t0 = time.perf_counter()
    engine = await VllmEngine.start(EngineSettings(model=str(model_dir), dtype=dtype,
                                                      kv_cache_bytes=64 << 20, max_model_len=256))
    start_s = time.perf_counter() - t0
    try:
        await engine.generate([1, 2, 3], SamplingOptions(max_tokens=4))
        t0 = time.perf_counter()
        await engine.apply_weights(1, tensors)
        apply_s = time.perf_counter() - t0
        gen = await engine.generate([1, 2, 3], SamplingOptions(max_tokens=4))
        assert gen.versions == [1] * len(gen.token_ids)
    finally:
        await engine.close()
    return start_s, apply_s


def make_model_dir(root: Path, hidden: int, layers: int, heads: int, inter: int, dtype: str) -> Path:
    from kiln.models.tiny import make_tiny_model, train_tokenizer

    tok = root / "tok"
    if not tok.exists():
        train_tokenizer([f"sample text {i} for the tokenizer" for i in range(200)], tok, vocab_size=300)
    return make_tiny_model(root / f"m{hidden}x{layers}", tok, hidden_size=hidden, num_layers=layers,
                           num_heads=heads, num_kv_heads=heads // 2, intermediate_size=inter,
                           dtype=dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=110e6, help="parameters of the synthetic model")
    ap.add_argument("--repeats", type=int, default=3, help="publishes per configuration (best kept)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM apply measurement")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tensors = model_tensors(int(args.params))
    n_params = sum(t.numel() for _, t in tensors)
    total = sum(t.nbytes for _, t in tensors)
    print(f"model: {n_params / 1e6:.1f} M params, bf16, {total / 2**20:.0f} MiB in {len(tensors)} tensors")

    # The raw socket is measured before and after the gRPC runs and the best time is kept, so a
    # busy machine lowers the ratio rather than flattering it.
    ref = pack(1, tensors, 1 << 20)
    raw_times = [raw_tcp_seconds(ref.buckets) for _ in range(2)]

    configs = [(512 << 10, 1), (1 << 20, 1), (1 << 20, 2), (1 << 20, 4), (512 << 10, 4)]
    from kiln.tls import issue_all

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        issue_all(Path(tmp) / "tls", "bench")
        # Plain text (the baseline) and mutual TLS, as `kiln run` and clusters serve it.
        for mode, tls in (("plain", None), ("mTLS", Path(tmp) / "tls")):
            run = Path(tmp) / mode
            run.mkdir()
            proc, port = start_service(run, tls)
            try:
                runs[mode] = asyncio.run(grpc_runs(port, tensors, configs, args.repeats, total, tls))
            finally:
                proc.terminate()
                proc.wait(10)
    results, sub = runs["plain"]
    raw_times += [raw_tcp_seconds(ref.buckets) for _ in range(2)]
    del ref
    raw = min(raw_times)
    ceiling = total / raw
    print(f"raw TCP socket (ceiling, best of {len(raw_times)}): {raw:.3f} s = {ceiling / GiB:.2f} GiB/s"
          f" (all: {', '.join(f'{t:.3f}' for t in raw_times)} s)")
    print("\npublish over gRPC (trainer -> kiln-weight-sync, verified and committed):")
    print(f"{'bucket':>8} {'streams':>7} {'seconds':>8} {'GiB/s':>6} {'vs raw':>7}")
    best = max(results, key=lambda r: total / r["seconds"])
    for r in results:
        rate = total / r["seconds"]
        print(f"{r['bucket_bytes'] >> 10:>6}Ki {r['streams']:>7} {r['seconds']:>8.3f} "
              f"{rate / GiB:>6.2f} {rate / ceiling:>6.0%}")
    tls_results, tls_sub = runs["mTLS"]
    print("\nthe same with mutual TLS (trainer and rollout certificates):")
    print(f"{'bucket':>8} {'streams':>7} {'seconds':>8} {'GiB/s':>6} {'vs plain':>8}")
    for r, plain in zip(tls_results, results):
        print(f"{r['bucket_bytes'] >> 10:>6}Ki {r['streams']:>7} {r['seconds']:>8.3f} "
              f"{total / r['seconds'] / GiB:>6.2f} {plain['seconds'] / r['seconds']:>7.0%}")
    tls_best = max(tls_results, key=lambda r: total / r["seconds"])
    print(f"BEST publish with mTLS: {total / tls_best['seconds'] / GiB:.2f} GiB/s, "
          f"{best['seconds'] / tls_best['seconds']:.0%} of plain text's best (target >= 90%)")
    print(f"packing (one copy + digests): {best['pack_seconds']:.3f} s")
    print(f"BEST publish: {best['bucket_bytes'] >> 10} KiB buckets x {best['streams']} streams = "
          f"{total / best['seconds'] / ceiling:.0%} of the raw socket (target >= 60%)")
    for streams, secs in tls_sub.items():
        print(f"subscribe with mTLS ({streams} stream(s)): {secs:.3f} s = {total / secs / GiB:.2f} GiB/s")
    for streams, secs in sub.items():
        print(f"subscribe (late joiner, {streams} stream(s), receive+verify+assemble): {secs:.3f} s "
              f"= {total / secs / GiB:.2f} GiB/s ({total / secs / ceiling:.0%} of raw)")

    if not args.no_vllm:
        from safetensors.torch import load_file
        print("\nvLLM VllmEngine.apply_weights (in place, running engine):")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for hidden, layers, heads, inter, dtype in ((128, 2, 4, 256, "float32"),
                                                        (1024, 8, 16, 2816, "bfloat16")):
                mdir = make_model_dir(root, hidden, layers, heads, inter, dtype)
                w = list(load_file(str(mdir / "model.safetensors")).items())
                w = [(n, t * 1.01 if t.is_floating_point() else t) for n, t in w]
                count = sum(t.numel() for _, t in w)
                start_s, apply_s = asyncio.run(vllm_apply(mdir, w, dtype))
                print(f"  {count / 1e6:7.1f} M params {dtype:>8}: apply {apply_s:.3f} s "
                      f"(engine start {start_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
