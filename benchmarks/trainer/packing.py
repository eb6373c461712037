"""Packed against padded micro-batches: the same RL steps on the same long-tailed batches, in one
run, alternating step by step so that machine load falls on both alike.

    python benchmarks/trainer/packing.py [--threads 2] [--batch 32] [--steps 4] [--budget 2048]

Lengths: log-normal with median 64 tokens and sigma ln(20)/2.326 = 1.288, so that p99 is twenty
times the median (1,280), clipped to [8, 2048]; each step's batch is drawn afresh (one seed per
step, the same for both sides). Padded: micro-batches of `--micro` sequences, each padded to its
longest; packed: micro-batches of at most `--budget` tokens, concatenated
(`trainer.maxTokensPerMicroBatch`). Both start from the same ~10 M-parameter Qwen2 checkpoint.

Reported per side: the median tokens per second (real tokens, the same count for both) over
the steps after one warm-up step; the token slots its forward passes held in all (padding
included) and in the largest one, which activation memory grows with; and the peak of the
process's resident memory during a step above what it was just before (sampled every 5 ms; once
warm the allocator reuses what earlier steps freed, so this reads near 0 for whichever side
runs second: the largest forward pass is the steadier memory figure). The last line: `packed/padded tokens per second: R.RRx`.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kiln.api.loss import MaskedLoss
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer import microbatches
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

MODEL = dict(arch="qwen2", hidden_size=320, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1024,
             max_position_embeddings=2048)
MEDIAN, SIGMA = 64, math.log(20) / 2.326


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(2048, max(8, round(MEDIAN * math.exp(rng.gauss(0.0, SIGMA))))) for _ in range(n)]


def batch(sizes: list[int], vocab: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(sizes):
        prompt = max(1, n // 4)
        out.append(Trajectory(
            id=f"t{i}", task_id="x", group_id=f"g{i // 4}", tokens=[rng.randrange(4, vocab) for _ in range(n)],
            loss_mask=[0] * prompt + [1] * (n - prompt), logp_infer=[0.0] * prompt + [-5.0] * (n - prompt),
            version_spans=[VersionSpan(prompt, n, 0)], reward=float(rng.random() < 0.5)))
    return out


class PeakRSS:
    """The process's resident memory, sampled every 5 ms while active; `peak` above the start."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4, help="padded: sequences per micro-batch")
    ap.add_argument("--budget", type=int, default=2048, help="packed: tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "m", seed=0, **MODEL)
    sides = {"padded": None, "packed": args.budget}
    engines = {name: TrainerEngine(TrainerConfig(
        model_dir=model_dir, micro_batch_size=args.micro, max_tokens_per_micro_batch=budget,
        optimizer=OptimizerConfig(lr=1e-5), loss=MaskedLoss()), resume=False) for name, budget in sides.items()}
    vocab = engines["padded"].spec.vocab_size
    slots = {name: 0 for name in sides}
    largest = {name: 0 for name in sides}
    counting = {"side": None}
    forward = microbatches.logprobs

    def counted(model, mb, *a, **kw):  # token slots a forward pass holds, padding included
        rows = 1 if a[1] is not None else len(mb.lengths)
        held = rows * (sum(mb.lengths) if a[1] is not None else max(mb.lengths))
        slots[counting["side"]] += held
        largest[counting["side"]] = max(largest[counting["side"]], held)
        return forward(model, mb, *a, **kw)

    microbatches.logprobs = counted
    speed: dict[str, list[float]] = {name: [] for name in sides}
    memory: dict[str, list[int]] = {name: [] for name in sides}
    real = 0
    for step in range(args.steps + 1):
        sizes = lengths(args.batch, seed=step)
        for name in (sides if step % 2 == 0 else reversed(list(sides))):
            counting["side"] = name
            trajs = batch(sizes, vocab, seed=step)
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                engines[name].step(trajs)
                seconds = time.perf_counter() - t0
            if step:  # the first is a warm-up
                speed[name].append(sum(sizes) / seconds)
                memory[name].append(rss.grown)
        if step:
            real += sum(sizes)
    p = sorted(lengths(100_000, seed=12345))
    print(f"lengths: log-normal median {MEDIAN}, sigma {SIGMA:.3f}; measured median {p[50_000]}, "
          f"p99 {p[99_000]}, clipped to [8, 2048]; batch {args.batch}, {args.steps} steps after a warm-up, "
          f"{args.threads} threads")
    for name in sides:
        print(f"{name:>6}: {statistics.median(speed[name]):8.0f} tokens/s   token slots {slots[name]:>9,} "
              f"(real {real + sum(lengths(args.batch, 0)):,}), largest pass {largest[name]:,}   RSS above start "
              f"{statistics.median(memory[name]) / 2**20:7.1f} MiB (median of steps)")
    ratio = statistics.median(speed["packed"]) / statistics.median(speed["padded"])
    print(f"packed/padded tokens per second: {ratio:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
