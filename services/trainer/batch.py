"""Turn trajectories into padded `[B, S]` tensors for the trainer.

Token `t`'s entries (loss mask, inference log-prob, teacher log-prob) describe token `t` itself,
as in `kiln.trajectory.Trajectory`; the model's log-prob of token `t` comes from position
`t - 1`, which `megatron_model.token_logprobs` lines up. Sequences are right-padded; padding has
loss mask 0 and is never trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.trajectory import Trajectory

PAD_ID = 0


@dataclass
class TensorBatch:
    tokens: torch.Tensor
    """[B, S] int64, right-padded with PAD_ID."""
    loss_mask: torch.Tensor
    """[B, S] float32, 1 on trainable tokens."""
    logp_infer: torch.Tensor
    """[B, S] float32."""
    advantages: torch.Tensor
    """[B] float32, the per-sequence (group-relative) advantage."""
    teacher_logp: torch.Tensor
    """[B, S] float32; meaningful only where has_teacher."""
    has_teacher: torch.Tensor
    """[B] bool: the sequence carries teacher log-probs (on-policy distillation)."""
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to(self, device: torch.device) -> "TensorBatch":
        return TensorBatch(
            self.tokens.to(device), self.loss_mask.to(device), self.logp_infer.to(device),
            self.advantages.to(device), self.teacher_logp.to(device), self.has_teacher.to(device),
            self.lengths,
        )


def collate(trajs: list[Trajectory]) -> TensorBatch:
    """Pad `trajs` into tensors. The trajectories were checked once, by the buffer when they
    arrived (`Trajectory.check`); they are not checked again here."""
    if not trajs:
        raise ValueError("cannot collate an empty batch")
    b, s = len(trajs), max(len(t.tokens) for t in trajs)
    tokens = torch.full((b, s), PAD_ID, dtype=torch.long)
    mask = torch.zeros(b, s)
    infer = torch.zeros(b, s)
    teacher = torch.zeros(b, s)
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        tokens[i, :n] = torch.tensor(t.tokens, dtype=torch.long)
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        infer[i, :n] = torch.tensor(t.logp_infer, dtype=torch.float32)
        if t.teacher_logp:
            teacher[i, :n] = torch.tensor(t.teacher_logp, dtype=torch.float32)
    return TensorBatch(
        tokens=tokens,
        loss_mask=mask,
        logp_infer=infer,
        advantages=torch.tensor([t.advantage for t in trajs], dtype=torch.float32),
        teacher_logp=teacher,
        has_teacher=torch.tensor([bool(t.teacher_logp) for t in trajs]),
        lengths=[len(t.tokens) for t in trajs],
    )


def collate_tokens(sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-pad bare token lists; returns ([B, S] tokens, lengths)."""
    if not sequences or any(not s for s in sequences):
        raise ValueError("sequences must be a non-empty list of non-empty token lists")
    s = max(len(x) for x in sequences)
    tokens = torch.full((len(sequences), s), PAD_ID, dtype=torch.long)
    for i, x in enumerate(sequences):
        tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return tokens, [len(x) for x in sequences]
