"""Dense causal attention versus DSA (indexer + top-k + sparse attention), forward only.

CPU (default): the PyTorch paths, queries processed in chunks so that 16k tokens fit in memory;
prints each stage's time and the dense/DSA ratios. The sparse attention itself costs about
L * k * heads * dim, dense attention about L^2 / 2 * heads * dim; the indexer is still quadratic
(L^2 / 2 * indexer_heads * indexer_dim, a small constant) and top-k reads the L^2 / 2 scores, so
the table lists them separately rather than hiding them in a total.

    python benchmarks/dsa/bench.py                      # L = 1k, 4k, 16k; k = 256, 2048
    python benchmarks/dsa/bench.py --lengths 1024 --topk 256

CUDA (`--device cuda`): the Triton kernels compiled for the GPU, timed with CUDA events, with
the achieved memory bandwidth and FLOP/s of each kernel, against torch's fused dense attention.

Not covered: backward passes, and batch > 1 (one sequence shows the scaling).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from kiln.kernels import dsa


def _inputs(length, args, device, dtype):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(
        q=rand(1, length, args.heads, args.dim),
        k=rand(1, length, args.kv_heads, args.dim),
        v=rand(1, length, args.kv_heads, args.dim),
        iq=rand(1, length, args.index_heads, args.index_dim),
        ik=rand(1, length, args.index_dim),
        iw=rand(1, length, args.index_heads).abs(),
    )


# ------------------------------------------------------------------------------------------ cpu


def _dense_chunked(x, chunk):
    """Causal attention, `chunk` queries at a time over the keys they may see."""
    q, k, v = x["q"], x["k"], x["v"]
    rep = q.shape[2] // k.shape[2]
    kt = k.repeat_interleave(rep, dim=2).transpose(1, 2)  # [1, H, L, D]
    vt = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    length = q.shape[1]
    out = torch.empty_like(q)
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        qc = q[:, start:stop].transpose(1, 2)
        mask = torch.ones(stop - start, stop, dtype=torch.bool).tril(start)
        oc = F.scaled_dot_product_attention(qc, kt[:, :, :stop], vt[:, :, :stop], attn_mask=mask)
        out[:, start:stop] = oc.transpose(1, 2)
    return out


def _dsa_chunked(x, topk, chunk, attn_chunk):
    """Indexer, top-k and sparse attention per chunk of queries; seconds spent in each stage."""
    length = x["q"].shape[1]
    spent = {"indexer": 0.0, "topk": 0.0, "sparse": 0.0}
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        t0 = time.perf_counter()
        scores = dsa.indexer_scores(
            x["iq"][:, start:stop], x["ik"][:, :stop], x["iw"][:, start:stop], offset=start, backend="torch"
        )
        t1 = time.perf_counter()
        indices = dsa.topk_indices(scores, topk, backend="torch")
        t2 = time.perf_counter()
        del scores
        for a in range(start, stop, attn_chunk):
            b = min(a + attn_chunk, stop)
            dsa.sparse_attention(x["q"][:, a:b], x["k"], x["v"], indices[:, a - start : b - start], backend="torch")
        t3 = time.perf_counter()
        spent["indexer"] += t1 - t0
        spent["topk"] += t2 - t1
        spent["sparse"] += t3 - t2
    return spent


def run_cpu(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU, PyTorch paths, {torch.get_num_threads()} threads; heads={args.heads} kv_heads={args.kv_heads} "
        f"dim={args.dim}; indexer heads={args.index_heads} dim={args.index_dim}; float32; forward only"
    )
    header = (
        f"{'L':>6} {'k':>5} {'dense s':>8} {'indexer s':>9} {'topk s':>7} {'sparse s':>8} "
        f"{'DSA s':>7} {'dense/DSA':>9} {'dense/sparse':>12} {'L/(2k)':>7}"
    )
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        x = _inputs(length, args, "cpu", torch.float32)
        with torch.no_grad():
            t0 = time.perf_counter()
            _dense_chunked(x, args.chunk)
            dense = time.perf_counter() - t0
            for topk in args.topk:
                spent = _dsa_chunked(x, topk, args.chunk, args.attn_chunk)
                total = sum(spent.values())
                print(
                    f"{length:>6} {topk:>5} {dense:>8.2f} {spent['indexer']:>9.2f} {spent['topk']:>7.2f} "
                    f"{spent['sparse']:>8.2f} {total:>7.2f} {dense / total:>9.2f} "
                    f"{dense / spent['sparse']:>12.2f} {length / (2 * topk):>7.2f}",
                    flush=True,
                )


# ----------------------------------------------------------------------------------------- cuda


def _cuda_time(fn, repeat):
    fn()  # compile and warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def _rate(seconds, nbytes, flops):
    return f"{seconds * 1e3:9.3f} ms {nbytes / seconds / 1e9:8.1f} GB/s {flops / seconds / 1e12:8.2f} TFLOP/s"


def run_cuda(args):
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    dtype = torch.bfloat16
    elt = 2
    print(f"{torch.cuda.get_device_name()}, Triton kernels, bfloat16 inputs (float32 arithmetic), forward only")
    for length in args.lengths:
        x = _inputs(length, args, "cuda", dtype)
        h, kvh, d, ih, idim = args.heads, args.kv_heads, args.dim, args.index_heads, args.index_dim
        rep = h // kvh
        qt = x["q"].transpose(1, 2)
        kt = x["k"].repeat_interleave(rep, dim=2).transpose(1, 2)
        vt = x["v"].repeat_interleave(rep, dim=2).transpose(1, 2)
        sec = _cuda_time(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), args.repeat)
        dense_flops = 4 * h * d * length * length / 2
        print(f"L={length} dense causal (torch SDPA)       {_rate(sec, 4 * length * h * d * elt, dense_flops)}")
        scores = dsa.indexer_scores(x["iq"], x["ik"], x["iw"], backend="triton")
        sec = _cuda_time(lambda: dsa.indexer_scores(x["iq"], x["ik"], x["iw"], backend="triton"), args.repeat)
        nbytes = (length * ih * idim + length * idim + length * ih) * elt + length * length * 4
        print(f"L={length} indexer (all L^2 tiles)          {_rate(sec, nbytes, 2 * length * length * ih * idim)}")
        for topk in args.topk:
            sec = _cuda_time(lambda: dsa.topk_indices(scores, topk, backend="triton"), args.repeat)
            print(f"L={length} k={topk:<5} top-k                   {_rate(sec, length * length * 4 + length * topk * 8, 0)}")
            indices = dsa.topk_indices(scores, topk, backend="triton")
            sec = _cuda_time(lambda: dsa.sparse_attention(x["q"], x["k"], x["v"], indices, backend="triton"), args.repeat)
            selected = int((indices >= 0).sum())
            nbytes = selected * kvh * d * 2 * elt + 2 * length * h * d * elt + indices.numel() * 8
            print(f"L={length} k={topk:<5} sparse attention        {_rate(sec, nbytes, 4 * selected * h * d)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--topk", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--index-dim", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1024, help="queries per indexer/top-k/dense step (CPU)")
    parser.add_argument("--attn-chunk", type=int, default=128, help="queries per sparse-attention step (CPU)")
    # One thread by default: on a shared, loaded machine every multi-threaded op waits for its
    # slowest thread to be scheduled, which swamps what is being measured.
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions per kernel (CUDA)")
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    if args.device == "cuda":
        run_cuda(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
