"""Synthetic trajectories of a given shape, for the buffer's tests and benchmark.

They pass `Trajectory.check()`: a prompt, then alternating generated and observation turns, every
generated token covered by a version span. The content means nothing.
"""
from __future__ import annotations

import random
import struct

from kiln.trajectory import Trajectory, VersionSpan


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def synthetic_trajectory(tid: str, group_id: str = "", *, tokens: int = 16, version: int = 0,
                         reward: float = 0.0, seed: int | None = None,
                         prompt_len: int | None = None) -> Trajectory:
    """A valid trajectory of `tokens` tokens, all generated tokens at policy `version`."""
    rng = random.Random(seed if seed is not None else tid)
    prompt = min(tokens, prompt_len if prompt_len is not None else max(1, tokens // 8))
    ids = [rng.randrange(32000) for _ in range(tokens)]
    mask = [0] * prompt
    # Generated turns of 1..24 tokens separated by observations of 1..12 tokens.
    while len(mask) < tokens:
        mask += [1] * min(rng.randint(1, 24), tokens - len(mask))
        mask += [0] * min(rng.randint(1, 12), tokens - len(mask))
    # float32 values, as engines produce and the wire carries them.
    logp = [_f32(-rng.random() * 4) if m else 0.0 for m in mask]
    spans = []
    start = None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(VersionSpan(start, i, version))
            start = None
    return Trajectory(id=tid, task_id=f"task-{group_id or tid}", group_id=group_id, tokens=ids,
                      loss_mask=mask, logp_infer=logp, version_spans=spans, prompt_len=prompt,
                      reward=reward, env="chain")


def synthetic_group(group_id: str, size: int, *, tokens: int = 16, version: int = 0,
                    rewards: list[float] | None = None) -> list[Trajectory]:
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    return [synthetic_trajectory(f"{group_id}/{i}", group_id, tokens=tokens, version=version,
                                 reward=rewards[i]) for i in range(size)]
