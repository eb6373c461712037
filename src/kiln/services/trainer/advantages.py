"""Advantages: the one place rewards (and a teacher's log-probs) become what the policy loss
weighs each token by.

Where: in the trainer's RL step (`TrainerEngine.step`), in two passes of this module only:
`sequence_advantages` once over the step's whole batch (it needs each group's rewards), and
`token_advantages` on every micro-batch just before `loss.policy_loss` (the distillation term
needs the trainer's own log-probs of the micro-batch). Nothing upstream computes any: the buffer
serves whole groups, never part of one (`buffer.groups.pick_groups`), so the batch holds every
reward each group's statistics need; an in-process source (`loop.ListBatchSource`) must hand
over whole groups too.

Groups: the trajectories that share `Trajectory.group_key` (their group id; a trajectory
without one is a group of its own, whose advantage is 0). For sequence i of group g, with
reward r_i:

- mean (`rl.advantageNorm: mean`, Dr. GRPO; DESIGN.md "Group-relative advantage"):
      A_i = r_i - mean_{j in g} r_j
- mean-std (`rl.advantageNorm: mean-std`, GRPO as first published):
      A_i = (r_i - mean_{j in g} r_j) / (std_g + 1e-6)
  with std_g the sample standard deviation of the group's rewards (divided by |g| - 1:
  `statistics.stdev`, as `torch.std` in verl and slime); a group whose rewards are all equal
  keeps 0, and so does a group of one (no baseline to compare with: verl would give it r_i).
- shaping split (a trajectory with a `shaping_mask`: the part s_i of its reward earned by the
  marked tokens, `Trajectory.shaping_reward`; any feature may fill that channel):
      S_i = s_i - mean_{j in g} s_j   for a masked sequence, 0 for one without a mask
      E_i = A_i - S_i                 the episode's part, for every token
  and the task advantage of token t is `E_i + m_{i,t} S_i` (m: the shaping mask), so that on a
  sequence whose every generated token is marked the two add up to A_i. mean-std divides E_i
  and S_i by the std of the total rewards r (as above). A batch with no mask at all keeps one
  advantage per sequence (`[B]`, broadcast by the loss).
- on-policy distillation (a sequence carrying a teacher's log-probs, `rl.advantage: opd`), per
  token:
      A_{i,t} = sampled_weight * stopgrad(logp_teacher_t - logp_student_t)
                + task_reward_weight * (E_i + m_{i,t} S_i)
  and every other sequence of the batch its task advantage. `sampled_weight` is
  `rl.sampledWeight` (1 by default), `task_reward_weight` `rl.taskRewardWeight` (0: distil only).
- a KL-penalised stage (`rl.klCoef`): the frozen log-probs are the reference's, not a teacher's,
  so there is no distillation term: the task advantage alone.

Numbers: the per-sequence pass is float64 Python arithmetic in the batch's order, the tensors
float32 from there on, as they were when the buffer took the mean.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from kiln.trajectory import Trajectory

if TYPE_CHECKING:
    from kiln.services.trainer.batch import TensorBatch

#: Added to each group's reward std under mean-std, so an all-equal group divides by it.
STD_EPS = 1e-6


class SequenceAdvantages(NamedTuple):
    """One step's per-sequence advantages, in the batch's order."""

    task: list[float]
    """E_i: the advantage every token of the sequence carries (A_i where nothing is split)."""
    shaping: list[float] | None
    """S_i: the shaping reward's advantage, for the sequence's masked tokens alone (0 for a
    sequence without a mask); None when no sequence of the batch has a mask."""


def sequence_advantages(batch: list[Trajectory],
                        norm: Literal["mean", "mean-std"] = "mean") -> SequenceAdvantages:
    """The per-sequence advantages of `batch` (whole groups), see the module doc."""
    if norm not in ("mean", "mean-std"):
        raise ValueError(f"advantage_norm={norm!r} is not 'mean' or 'mean-std'")
    rewards = _by_group(batch, "reward")
    mean = {k: sum(v) / len(v) for k, v in rewards.items()}
    task = [t.reward - mean[t.group_key] for t in batch]
    shaping = None
    if any(t.shaping_mask for t in batch):
        s_mean = {k: statistics.fmean(v) for k, v in _by_group(batch, "shaping_reward").items()}
        shaping = [t.shaping_reward - s_mean[t.group_key] if t.shaping_mask else 0.0 for t in batch]
        task = [a - s for a, s in zip(task, shaping)]
    if norm == "mean-std":
        std = {k: (statistics.stdev(v) if len(v) > 1 else 0.0) + STD_EPS for k, v in rewards.items()}
        task = [a / std[t.group_key] for a, t in zip(task, batch)]
        if shaping is not None:
            shaping = [s / std[t.group_key] for s, t in zip(shaping, batch)]
    return SequenceAdvantages(task, shaping)


def token_advantages(batch: "TensorBatch", logp: torch.Tensor, *, distill: bool = True,
                     task_reward_weight: float = 0.0, sampled_weight: float = 1.0) -> torch.Tensor:
    """What `policy_loss` weighs each token of the micro-batch `batch` by: its task advantage
    (`task_advantages`), and where a sequence carries a teacher's log-probs and `distill`, the
    distillation term (`distilled`). `logp`: the student's `[B, S]` log-probs."""
    task = task_advantages(batch.advantages, batch.shaping_mask, batch.shaping_advantages)
    if not distill:
        return task
    return distilled(task, logp, batch.teacher_logp, batch.has_teacher, task_reward_weight,
                     sampled_weight)


def task_advantages(advantages: torch.Tensor, shaping_mask: torch.Tensor | None,
                    shaping_advantages: torch.Tensor | None) -> torch.Tensor:
    """`[B]` (one per sequence) where no sequence has a shaping mask, else `[B, S]`: E_i on
    every token plus S_i on the masked ones."""
    if shaping_mask is None:
        return advantages
    return advantages[:, None] + shaping_mask * shaping_advantages[:, None]


def opd_advantages(logp_teacher: torch.Tensor, logp_student: torch.Tensor) -> torch.Tensor:
    """Per-token advantage of on-policy distillation: `stopgrad(logp_teacher - logp_student)`."""
    return (logp_teacher - logp_student).detach()


def distilled(task: torch.Tensor, logp_BS: torch.Tensor, teacher_BS: torch.Tensor,
              has_teacher_B: torch.Tensor, task_reward_weight: float = 0.0,
              sampled_weight: float = 1.0) -> torch.Tensor:
    """[B, S] advantages: a sequence with teacher log-probs gets `sampled_weight` times the
    distillation advantage of each token plus `task_reward_weight` times its task advantage;
    any other sequence its task advantage on every token. `task`: [B] or [B, S]."""
    seq = task.expand_as(logp_BS) if task.dim() == 2 else task[:, None].expand_as(logp_BS)
    opd = sampled_weight * opd_advantages(teacher_BS, logp_BS) + task_reward_weight * seq
    return torch.where(has_teacher_B[:, None], opd, seq)


def _by_group(batch: list[Trajectory], attr: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for t in batch:
        values.setdefault(t.group_key, []).append(getattr(t, attr))
    return values
