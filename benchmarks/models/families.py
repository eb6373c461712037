"""The registered model families on tiny random checkpoints: how far the trainer's logits are from
transformers', the trainer's step time of a Qwen3 against a Qwen2 of the same size, and (with
`--vllm`) how far vLLM's CPU log-probs are from the trainer's.

    .venv/bin/python benchmarks/models/families.py [--steps 5] [--batch 8] [--seq 128] [--vllm]

1. logits: every family in `kiln.api.model_families.FAMILIES`, float32, 2 layers, hidden 64,
   MoE 8 experts top-2; max |logit diff| against transformers over 3 x 40 random tokens;
2. step time: a supervised trainer step (`TrainerEngine.sft_step`, forward + backward + AdamW)
   of a Qwen2 and a Qwen3 with the same dimensions (hidden 128, 4 heads of 32, 2 KV heads,
   2 layers), alternating step by step after one warm-up each; median of `--steps`;
3. `--vllm`: vLLM CPU (Kiln's vllm engine, version 0) samples 4 x 32 tokens of each family and
   the trainer scores them; max |log-prob diff|. The MoE families included, though a run serves
   them with the megatron engine (vLLM returns no routed experts on CPUs).

Not measured: bf16, tensor parallelism, weight reloads in vLLM (see `kiln consistency`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.api.model_families import FAMILIES
from kiln.models.tiny import make_tiny_checkpoint

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
SAME_SIZE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                 perturb_norms=False)


def _trainer(model_dir: Path, tmp: Path, batch: int):
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    return TrainerEngine(TrainerConfig(
        model_dir=model_dir, micro_batch_size=batch, optimizer=OptimizerConfig(lr=1e-4, grad_clip=0.0),
        checkpoint_dir=tmp / f"ckpt-{model_dir.name}", seed=0), resume=False)


def logits_diff(model_dir: Path) -> float:
    from transformers import AutoModelForCausalLM

    from kiln.models.hf_io import load_hf_checkpoint
    from kiln.models.megatron_model import forward_logits

    model, _ = load_hf_checkpoint(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens = torch.randint(4, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (forward_logits(model.eval(), tokens) - hf(tokens).logits).abs().max().item()


def step_times(dirs: dict[str, Path], tmp: Path, batch: int, seq: int, steps: int) -> dict[str, list[float]]:
    from kiln.trajectory import Trajectory, VersionSpan

    trainers = {name: _trainer(d, tmp, batch) for name, d in dirs.items()}
    rng = random.Random(0)
    vocab = min(t.spec.vocab_size for t in trainers.values())
    trajs = []
    for i in range(batch):
        tokens = [rng.randrange(4, vocab) for _ in range(seq)]
        trajs.append(Trajectory(id=f"b{i}", task_id="bench", group_id="g", tokens=tokens,
                                loss_mask=[0] * 8 + [1] * (seq - 8), logp_infer=[0.0] * seq,
                                version_spans=[VersionSpan(8, seq, 0)], prompt_len=8))
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for t in trainers.values():
        t.sft_step(trajs)  # warm-up
    for _ in range(steps):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            t.sft_step(trajs)
            times[name].append(time.perf_counter() - t0)
    return times


async def vllm_diff(model_dir: Path, tmp: Path) -> float:
    from transformers import AutoTokenizer

    from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine

    trainer = _trainer(model_dir, tmp, 4)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok.encode(p) for p in ("The weather today is", "def add(a, b):", "Once upon", "17 * 23")]
    engine = await start_engine("vllm", EngineSettings(model=str(model_dir), dtype="float32",
                                                       kv_cache_bytes=64 << 20, seed=0))
    try:
        gens = [await engine.generate(p, SamplingOptions(max_tokens=32, seed=i)) for i, p in enumerate(prompts)]
    finally:
        await engine.close()
    lps = trainer.logprobs([p + g.token_ids for p, g in zip(prompts, gens)])
    return max(abs(a - b) for p, g, lp in zip(prompts, gens, lps) for a, b in zip(g.logprobs, lp[len(p):]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm", action="store_true", help="also compare vLLM CPU's log-probs (~30 s a family)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kiln.models import parallel

    parallel.init_parallel(1)
    summary: dict = {"logits_max_diff": {}, "vllm_max_diff": {}}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tiny = {f.name: make_tiny_checkpoint(tmp / f.name, arch=f.name, seed=3, **TINY,
                                             **(MOE if f.moe else {})) for f in FAMILIES}
        for name, d in tiny.items():
            summary["logits_max_diff"][name] = diff = logits_diff(d)
            print(f"logits  {name:<10} max|diff| vs transformers {diff:.3e}")
        same = {arch: make_tiny_checkpoint(tmp / f"same-{arch}", arch=arch, seed=3, **SAME_SIZE)
                for arch in ("qwen2", "qwen3")}
        times = step_times(same, tmp, args.batch, args.seq, args.steps)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            print(f"step    {name:<10} median {med[name]:.4f} s  runs {[round(t, 4) for t in ts]}")
        summary["step_s"] = med
        summary["step_ratio_qwen3_over_qwen2"] = ratio = med["qwen3"] / med["qwen2"]
        print(f"step    qwen3 / qwen2 = {ratio:.3f} (batch {args.batch} x {args.seq}, {args.threads} thread(s))")
        if args.vllm:
            for name, d in tiny.items():
                summary["vllm_max_diff"][name] = diff = asyncio.run(vllm_diff(d, tmp))
                print(f"vllm    {name:<10} max|log-prob diff| vs trainer {diff:.3e}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
