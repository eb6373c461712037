"""Dense on-policy distillation (`rl.teacherTopK`): the loss term that pulls the student towards
the teacher's k most likely tokens at every trained position (the student's log-probs of them
come from the same forward pass as its sampled tokens': `megatron_model.token_and_topk_logprobs`).

Why it exists: the sampled-token advantage of on-policy distillation (teacher minus student
log-prob of the token the student sampled) moves only tokens the student samples. A student
collapsed onto a wrong token (p near 1) gets a gradient scaled by 1 - p there, about nothing,
and the token the teacher wants, never sampled, is never raised. The teacher's top k at each
trained position names that token, and a cross-entropy to it reaches it directly.

The term per trained token t: `sum_j q_j (log q_j - log pi_theta(i_j | <t))`, with `i_1..i_k`
the teacher's top k and `q` their probabilities renormalised over the k (a forward KL on the
teacher's top k; at least 0, since the student's mass on the k is at most 1).

Not covered: tensor parallelism (the full vocabulary's log-softmax is taken on one rank; the
trainer refuses `teacherTopK` with `tensorParallel` > 1).
"""
from __future__ import annotations

import torch


def dense_kl(student_BSK: torch.Tensor, teacher_BSK: torch.Tensor, on_BS: torch.Tensor) -> torch.Tensor:
    """Per-token `sum_j q_j (log q_j - student_j)`, `q = softmax(teacher)` over the k; 0 where
    `on` is False. Differentiable in `student`."""
    log_q = torch.log_softmax(teacher_BSK.detach().float(), dim=-1)
    per = (log_q.exp() * (log_q - student_BSK.float())).sum(-1)
    return torch.where(on_BS, per, torch.zeros_like(per)).to(student_BSK.dtype)
