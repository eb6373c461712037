"""One RL training step of a ~10 M-parameter model: Kiln's Megatron-core trainer against a plain
PyTorch step (transformers model, the same policy loss, AdamW), in the same run.

    python benchmarks/trainer/bench.py [--threads 1] [--batch 8] [--seq 256] [--steps 3]

Both sides start from the same randomly initialised Qwen2 checkpoint, train on the same batch
with the same loss settings and report the median wall time of `--steps` steps after one warm-up
step; the two sides alternate step by step so that machine load affects both alike. Prints one line per side, the ratio, and a JSON summary on the last line.

Not measured: tensor parallelism, bf16, data loading, weight publishing.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.api.loss import MaskedLoss
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.advantages import sequence_advantages
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.loss import policy_loss
from kiln.trajectory import Trajectory, VersionSpan

MODEL = dict(arch="qwen2", hidden_size=320, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1024,
             max_position_embeddings=1024)
LOSS = MaskedLoss(eps_low=0.2, eps_high=0.28)
LR = 1e-4


def make_batch(n: int, seq: int, vocab: int, prompt: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = [rng.randrange(4, vocab) for _ in range(seq)]
        out.append(Trajectory(
            id=f"b{i}", task_id="bench", group_id=f"g{i // 4}", tokens=tokens,
            loss_mask=[0] * prompt + [1] * (seq - prompt), logp_infer=[0.0] * seq,
            version_spans=[VersionSpan(prompt, seq, 0)], reward=1.0 if i % 2 else -1.0,
        ))
    return out


def set_on_policy(batch: list[Trajectory], logps: list[list[float]]) -> None:
    for t, lp in zip(batch, logps):
        t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]


class PlainStep:
    """The reference: a transformers model, log-probs by log_softmax + gather, the same loss."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens).logits[:, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        return torch.nn.functional.pad(lp, (1, 0))

    def step(self, batch: list[Trajectory]) -> float:
        tokens = torch.tensor([t.tokens for t in batch])
        mask = torch.tensor([t.loss_mask for t in batch], dtype=torch.float32)
        infer = torch.tensor([t.logp_infer for t in batch])
        adv = torch.tensor(sequence_advantages(batch).task)  # +-1: each group's mean is 0
        self.opt.zero_grad(set_to_none=True)
        logp = self.logprobs(tokens)
        loss, _ = policy_loss(logp, infer, mask, adv, LOSS, logp_train_old=logp.detach())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


def timed_pair(a, b, steps: int) -> tuple[list[float], list[float]]:
    """Alternate `a` and `b` so that load from other processes hits both sides alike."""
    a()  # warm-up: allocator, first-call overheads
    b()
    ta, tb = [], []
    for _ in range(steps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "m", **MODEL)
        engine = TrainerEngine(TrainerConfig(
            model_dir=model_dir, micro_batch_size=args.batch, loss=LOSS,
            optimizer=OptimizerConfig(lr=LR, grad_clip=1.0),
        ))
        params = sum(p.numel() for p in engine.model.parameters())
        batch = make_batch(args.batch, args.seq, engine.spec.vocab_size, prompt=args.seq // 4)
        set_on_policy(batch, engine.logprobs([t.tokens for t in batch]))
        plain = PlainStep(model_dir)

        kiln_all, plain_all = timed_pair(lambda: engine.step(batch), lambda: plain.step(batch), args.steps)
        kiln_s, plain_s = statistics.median(kiln_all), statistics.median(plain_all)

    tokens = args.batch * args.seq
    print(f"model: qwen2, {params / 1e6:.1f} M parameters; batch {args.batch} x {args.seq} tokens; "
          f"{args.threads} thread(s)")
    print(f"kiln megatron step : {kiln_s:.3f} s  ({tokens / kiln_s:,.0f} tok/s)  runs {[round(t, 3) for t in kiln_all]}")
    print(f"plain pytorch step : {plain_s:.3f} s  ({tokens / plain_s:,.0f} tok/s)  runs {[round(t, 3) for t in plain_all]}")
    print(f"ratio kiln / plain : {kiln_s / plain_s:.2f}")
    print(json.dumps({"params": params, "batch": args.batch, "seq": args.seq, "threads": args.threads,
                      "kiln_step_s": kiln_s, "plain_step_s": plain_s, "ratio": kiln_s / plain_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
