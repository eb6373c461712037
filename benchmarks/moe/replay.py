"""Routing replay on tiny Qwen2-MoE models: rollout vs trainer log-prob mismatch with and without
replay, the routing-flip rate, and the dense model of the same size as the baseline.

Each row is one `kiln consistency` run (two policy versions, a weight sync between them). The
rollout engine is `torch` (transformers with a KV cache: an implementation independent of the
trainer's Megatron MoE layers, as vLLM is in production) or `megatron` (the trainer's own code).
The dense baseline has the same attention and a dense MLP as wide as the MoE layer's active
width (top-k experts + the shared expert).

    .venv/bin/python benchmarks/moe/replay.py [--samples 16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.models.tiny import make_tiny_checkpoint

SHAPES = {
    # name: (MoE kwargs, dense intermediate size of the same active width)
    "small (2 layers, top-2 of 8)": (dict(num_layers=2, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=64), 128),
    "wider (4 layers, top-4 of 32)": (dict(num_layers=4, num_experts=32, num_experts_per_tok=4,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=64), 128),
}
COMMON = dict(hidden_size=64, num_heads=2, num_kv_heads=1, seed=3)


def consistency(model: Path, engine: str, dtype: str, samples: int, max_tokens: int) -> dict:
    """One run: the verdict rows (with replay, for MoE), the rows without replay, the flips."""
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "consistency", "--model", str(model), "--engine", engine,
         "--dtype", dtype, "--samples", str(samples), "--max-tokens", str(max_tokens)],
        capture_output=True, text=True, timeout=900)
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", proc.stdout, re.M)
    if not rows:
        raise RuntimeError(proc.stdout + proc.stderr)
    out = {"max": max(float(r[2]) for r in rows), "mean": sum(float(r[3]) for r in rows) / len(rows)}
    own = re.findall(r"without replay: max\|diff\| (\S+), mean\|diff\| (\S+)", proc.stdout)
    if own:
        out["own_max"] = max(float(a) for a, _ in own)
        out["own_mean"] = sum(float(b) for _, b in own) / len(own)
    flips = re.search(r"routing-flip rate (\S+)%: (\d+) of (\d+)", proc.stdout)
    if flips:
        out["flips"] = f"{flips.group(1)}% ({flips.group(2)}/{flips.group(3)})"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    print(f"{'model':<34} {'engine':<9} {'dtype':<9} {'replay':<7} {'max|diff|':>10} {'mean|diff|':>10}  "
          "routing flips without replay")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (moe_kwargs, dense_width) in SHAPES.items():
            moe = make_tiny_checkpoint(Path(tmp) / f"moe-{len(name)}", arch="qwen2_moe",
                                       intermediate_size=128, **COMMON, **moe_kwargs)
            dense = make_tiny_checkpoint(Path(tmp) / f"dense-{len(name)}", arch="qwen2",
                                         num_layers=moe_kwargs["num_layers"], intermediate_size=dense_width,
                                         **COMMON)
            for dtype in args.dtypes.split(","):
                for label, model, engine in [("MoE " + name, moe, "torch"), ("MoE " + name, moe, "megatron"),
                                             ("dense, same active width", dense, "torch")]:
                    r = consistency(model, engine, dtype, args.samples, args.max_tokens)
                    rows = [("on", r["max"], r["mean"]), ("off", r["own_max"], r["own_mean"])] if "own_max" in r \
                        else [("-", r["max"], r["mean"])]
                    for replay, mx, mean in rows:
                        print(f"{label:<34} {engine:<9} {dtype:<9} {replay:<7} {mx:>10.3e} {mean:>10.3e}  "
                              f"{r.get('flips', '-') if replay != 'on' else ''}", flush=True)


if __name__ == "__main__":
    main()
