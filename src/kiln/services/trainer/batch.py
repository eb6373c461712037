"""Turn trajectories into padded `[B, S]` tensors for the trainer.

The per-sequence advantages come from `advantages.sequence_advantages` (passed to `collate`);
this module only lays them out. Token `t`'s entries (loss mask, inference log-prob, teacher
log-prob) describe token `t` itself, as in `kiln.trajectory.Trajectory`; the model's log-prob of
token `t` comes from position `t - 1`, which `megatron_model.token_logprobs` lines up. Sequences
are right-padded; padding has loss mask 0 and is never trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.models.megatron_model import ToolChoices
from kiln.routing import RoutedExperts
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
    """[B] float32, the per-sequence advantage every token carries (`advantages.py`'s E_i);
    0 where none was given (SFT)."""
    teacher_logp: torch.Tensor
    """[B, S] float32; meaningful only where has_teacher."""
    has_teacher: torch.Tensor
    """[B] bool: the sequence carries teacher log-probs (on-policy distillation)."""
    lengths: list[int]
    routing: torch.Tensor | None = None
    """MoE: [B, S, layers, topk] int64 expert ids the rollout chose; None when no sequence
    carries routing."""
    routing_valid: torch.Tensor | None = None
    """[B, S] bool: the positions `routing` covers."""
    topk_ids: torch.Tensor | None = None
    """Dense distillation: [B, S, K] int64, the teacher's top k in place of each token; None
    when no sequence carries them."""
    topk_logp: torch.Tensor | None = None
    """[B, S, K] float32, the teacher's log-probs of `topk_ids`."""
    has_topk: torch.Tensor | None = None
    """[B] bool: the sequence carries the teacher's top k."""
    choices: ToolChoices | None = None
    """Where tokens were drawn as tool choices, and among what; None when no sequence has one."""
    shaping_mask: torch.Tensor | None = None
    """[B, S] float32, 1 on the tokens that earned their sequence's shaping reward; None when
    no sequence credits one by turn (`Trajectory.shaping_mask`)."""
    shaping_advantages: torch.Tensor | None = None
    """[B] float32, the shaping reward's advantage, for the `shaping_mask` tokens alone
    (`advantages.py`'s S_i); set whenever `shaping_mask` is."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def select(self, idx: torch.Tensor) -> "TensorBatch":
        """Rows `idx`, trimmed to their longest sequence."""
        lengths = [self.lengths[i] for i in idx.tolist()]
        n = max(lengths)
        return TensorBatch(
            tokens=self.tokens[idx, :n], loss_mask=self.loss_mask[idx, :n], logp_infer=self.logp_infer[idx, :n],
            advantages=self.advantages[idx], teacher_logp=self.teacher_logp[idx, :n],
            has_teacher=self.has_teacher[idx], lengths=lengths,
            routing=self.routing[idx, :n] if self.routing is not None else None,
            routing_valid=self.routing_valid[idx, :n] if self.routing_valid is not None else None,
            topk_ids=self.topk_ids[idx, :n] if self.topk_ids is not None else None,
            topk_logp=self.topk_logp[idx, :n] if self.topk_logp is not None else None,
            has_topk=self.has_topk[idx] if self.has_topk is not None else None,
            choices=self.choices.select(idx, len(self.lengths)) if self.choices is not None else None,
            shaping_mask=self.shaping_mask[idx, :n] if self.shaping_mask is not None else None,
            shaping_advantages=(self.shaping_advantages[idx] if self.shaping_advantages is not None
                                else None),
        )

    def to(self, device: torch.device) -> "TensorBatch":
        return TensorBatch(
            self.tokens.to(device), self.loss_mask.to(device), self.logp_infer.to(device),
            self.advantages.to(device), self.teacher_logp.to(device), self.has_teacher.to(device),
            self.lengths,
            self.routing.to(device) if self.routing is not None else None,
            self.routing_valid.to(device) if self.routing_valid is not None else None,
            *(t.to(device) if t is not None else None
              for t in (self.topk_ids, self.topk_logp, self.has_topk)),
            self.choices.to(device) if self.choices is not None else None,
            *(t.to(device) if t is not None else None
              for t in (self.shaping_mask, self.shaping_advantages)),
        )


def collate(trajs: list[Trajectory], advantages: list[float] | None = None,
            shaping_advantages: list[float] | None = None) -> TensorBatch:
    """Pad `trajs` into tensors, with their per-sequence `advantages` and `shaping_advantages`
    (`advantages.SequenceAdvantages`; zeros where not given). The trajectories were checked
    once, by the buffer when they arrived (`Trajectory.check`); they are not checked again
    here."""
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
    routing, valid = collate_routing([t.routed_experts for t in trajs], s)
    topk_ids = topk_logp = has_topk = None
    k = max(t.teacher_top_k for t in trajs)
    if k:
        topk_ids = torch.zeros(b, s, k, dtype=torch.long)
        topk_logp = torch.zeros(b, s, k)
        for i, t in enumerate(trajs):
            if t.teacher_top_k == k:
                n = len(t.tokens)
                topk_ids[i, :n] = torch.tensor(t.teacher_topk_ids, dtype=torch.long).view(n, k)
                topk_logp[i, :n] = torch.tensor(t.teacher_topk_logp, dtype=torch.float32).view(n, k)
        has_topk = torch.tensor([t.teacher_top_k == k for t in trajs])
    shaping_mask = shaping_adv = None
    if any(t.shaping_mask for t in trajs):
        shaping_mask = torch.zeros(b, s)
        for i, t in enumerate(trajs):
            if t.shaping_mask:
                shaping_mask[i, :len(t.tokens)] = torch.tensor(t.shaping_mask, dtype=torch.float32)
        shaping_adv = torch.tensor(shaping_advantages or [0.0] * b, dtype=torch.float32)
    return TensorBatch(
        shaping_mask=shaping_mask,
        shaping_advantages=shaping_adv,
        choices=collate_choices(trajs),
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        has_topk=has_topk,
        routing=routing,
        routing_valid=valid,
        tokens=tokens,
        loss_mask=mask,
        logp_infer=infer,
        advantages=torch.tensor(advantages or [0.0] * b, dtype=torch.float32),
        teacher_logp=teacher,
        has_teacher=torch.tensor([bool(t.teacher_logp) for t in trajs]),
        lengths=[len(t.tokens) for t in trajs],
    )


def collate_choices(trajs: list[Trajectory]) -> ToolChoices | None:
    """The batch's choices (`kiln.trajectory.ToolChoice`), or None when no sequence has one."""
    entries = [(i, pos, allowed, temp)
               for i, t in enumerate(trajs) if t.tool_choice is not None
               for pos, allowed, temp in zip(t.tool_choice.positions, t.tool_choice.sets(),
                                             t.tool_choice.temperatures)]
    if not entries:
        return None
    a = max(len(allowed) for _, _, allowed, _ in entries)
    return ToolChoices(
        rows=torch.tensor([i for i, _, _, _ in entries], dtype=torch.long),
        cols=torch.tensor([pos for _, pos, _, _ in entries], dtype=torch.long),
        ids=torch.tensor([allowed + allowed[:1] * (a - len(allowed)) for _, _, allowed, _ in entries],
                         dtype=torch.long),
        temperature=torch.tensor([temp for _, _, _, temp in entries], dtype=torch.float32))


def collate_routing(routed: list[RoutedExperts | None], s: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-sequence routed experts as ([B, S, layers, topk] ids, [B, S] covered), or
    (None, None) when none carries any. ValueError when they disagree on the shape."""
    carried = [r for r in routed if r is not None]
    if not carried:
        return None, None
    shape = {(r.layers, r.topk, r.num_experts) for r in carried}
    if len(shape) > 1:
        raise ValueError(f"trajectories carry routed experts of different shapes {sorted(shape)} "
                         "(layers, topk, experts); they come from different models")
    layers, topk, _ = shape.pop()
    # Uncovered positions keep the trainer's own routing (see moe.RouterTap); the ids there
    # are placeholders, distinct per row as a top-k must be.
    routing = torch.arange(topk).expand(len(routed), s, layers, topk).clone()
    valid = torch.zeros(len(routed), s, dtype=torch.bool)
    for i, r in enumerate(routed):
        if r is not None and r.rows:
            routing[i, r.start : r.end] = torch.from_numpy(r.unpack())
            valid[i, r.start : r.end] = True
    return routing, valid


def collate_tokens(sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-pad bare token lists; returns ([B, S] tokens, lengths)."""
    if not sequences or any(not s for s in sequences):
        raise ValueError("sequences must be a non-empty list of non-empty token lists")
    s = max(len(x) for x in sequences)
    tokens = torch.full((len(sequences), s), PAD_ID, dtype=torch.long)
    for i, x in enumerate(sequences):
        tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return tokens, [len(x) for x in sequences]

