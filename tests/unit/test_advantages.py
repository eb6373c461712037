"""The trainer's advantages (`kiln.services.trainer.advantages`), by hand: group means, mean-std,
the shaping split and the distillation term, through the calls the engine's step makes."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.services.buffer.synthetic import synthetic_trajectory
from kiln.services.trainer.advantages import (
    distilled,
    opd_advantages,
    sequence_advantages,
    task_advantages,
    token_advantages,
)
from kiln.services.trainer.batch import collate
from kiln.trajectory import Trajectory, VersionSpan

F64 = torch.float64
THIRD = 1 / 3


def _rewards(groups: dict[str, list[float]]) -> list[Trajectory]:
    return [synthetic_trajectory(f"{g}/{i}", g, reward=r)
            for g, rs in groups.items() for i, r in enumerate(rs)]


def _tb(batch: list[Trajectory], norm: str = "mean"):
    """The engine's step: per-sequence advantages over the whole batch, then the tensors."""
    return collate(batch, *sequence_advantages(batch, norm))


def test_the_group_mean_is_the_baseline() -> None:
    """A_i = r_i - mean_j r_j over the group (what the buffer computed before the trainer did)."""
    assert sequence_advantages(_rewards({"a": [1.0, 0.0, 0.0, 1.0]})).task == [0.5, -0.5, -0.5, 0.5]
    assert sequence_advantages(_rewards({"a": [0.25, 0.25]})).task == [0.0, 0.0]
    adv = sequence_advantages(_rewards({"a": [0.1, 0.7, 0.4]})).task
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert adv[1] == pytest.approx(0.7 - 0.4)
    # Two groups in one batch each take their own mean; trajectories without a group id (SFT
    # data) are groups of one, advantage 0, not one group of everything ungrouped.
    mixed = _rewards({"a": [1.0, 0.0], "b": [3.0, 5.0]}) + [
        synthetic_trajectory("s0", reward=3.0), synthetic_trajectory("s1", reward=1.0)]
    assert sequence_advantages(mixed) == ([0.5, -0.5, -1.0, 1.0, 0.0, 0.0], None)
    with pytest.raises(ValueError, match="advantage_norm"):
        sequence_advantages(mixed, "std")


def test_group_std_normalization_by_hand() -> None:
    """mean-std divides the reward-minus-mean advantage by the group's sample reward std
    (n - 1, as torch.std in verl and slime): group a (rewards 1, 0, 0, 0: std 1/2; the
    population std would be sqrt(3)/4) and group b (all 1: advantage 0 stays 0); a group of one
    (c) has no baseline and keeps 0."""
    out = sequence_advantages(_rewards({"a": [1.0, 0.0, 0.0, 0.0], "b": [1.0, 1.0], "c": [5.0]}),
                              "mean-std")
    std = 0.5 + 1e-6
    assert out.task == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0.0, 0.0, 0.0],
                                     rel=1e-9)
    assert out.shaping is None
    # Two members: sample std |r1 - r2| / sqrt(2), so the advantages are +-1/sqrt(2).
    pair = sequence_advantages(_rewards({"d": [1.0, 0.0]}), "mean-std")
    assert pair.task == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)],
                                      rel=1e-9)


def test_a_shaping_reward_credited_by_turn_is_split_off_its_group_advantage() -> None:
    """Group a: rewards 2, 1, 0, of which shaping 1, 0, 0 credited to marked tokens; b has no
    mask and keeps its advantage whole. Where every generated token is marked, the two parts
    add up to the advantage there was; mean-std divides both by the total reward's std."""
    batch = []
    for g, rewards, shaping in (("a", [2.0, 1.0, 0.0], [1.0, 0.0, 0.0]), ("b", [1.0, 0.0], None)):
        for i, r in enumerate(rewards):
            t = synthetic_trajectory(f"{g}/{i}", g, reward=r)
            if shaping:
                t.shaping_reward = shaping[i]
                # The first generated token earned it; in a/2 every one did.
                gen = [j for j, m in enumerate(t.loss_mask) if m]
                t.shaping_mask = [int(m and (j == gen[0] or i == 2)) for j, m in enumerate(t.loss_mask)]
                t.check()
            batch.append(t)
    out = sequence_advantages(batch)
    assert out.shaping == pytest.approx([2 * THIRD, -THIRD, -THIRD, 0, 0])
    assert out.task == pytest.approx([1 - 2 * THIRD, THIRD, -1 + THIRD, 0.5, -0.5])
    tb = collate(batch, *out)
    adv = task_advantages(tb.advantages, tb.shaping_mask, tb.shaping_advantages)
    gen = tb.loss_mask.bool()
    first = gen.float().argmax(dim=1)
    assert adv[0, first[0]].item() == pytest.approx(1.0)            # the earning token: both parts
    assert adv[0, first[0] + 1].item() == pytest.approx(1 - 2 * THIRD)  # the others: the rest
    assert adv[2][gen[2]].tolist() == pytest.approx([-1.0] * int(gen[2].sum()))  # all marked: whole
    assert adv[3][gen[3]].tolist() == pytest.approx([0.5] * int(gen[3].sum()))   # no mask: whole
    std = 1.0  # sample std of 2, 1, 0
    normed = sequence_advantages(batch, "mean-std")
    assert normed.shaping[0] == pytest.approx(2 * THIRD / std, rel=1e-5)
    assert normed.task[0] == pytest.approx((1 - 2 * THIRD) / std, rel=1e-5)
    # Without a mask in the batch nothing is split and the tensors stay per sequence.
    plain = [synthetic_trajectory("c/0", "c", reward=1.0)]
    assert sequence_advantages(plain).shaping is None
    tb = _tb(plain)
    assert task_advantages(tb.advantages, tb.shaping_mask, tb.shaping_advantages).dim() == 1


def test_opd_advantage_is_per_token_and_stops_gradient() -> None:
    student = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0]], dtype=F64)
    adv = opd_advantages(teacher, student)
    assert adv.tolist() == [[0.5, -1.0]] and not adv.requires_grad
    # The policy-gradient term at ratio 1, token-mean: -A * exp(logp - logp_old) / 2, whose
    # gradient is -A / 2 and nothing through A.
    (-adv * torch.exp(student - student.detach())).mean().backward()
    assert student.grad.tolist() == [[-0.25, 0.5]]


def test_task_reward_mixes_into_distillation_advantages_only_where_a_teacher_scored() -> None:
    student = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], dtype=F64)
    teacher = torch.tensor([[-0.5, -3.0], [0.0, 0.0]], dtype=F64)
    seq_adv = torch.tensor([0.4, -0.6], dtype=F64)
    has_teacher = torch.tensor([True, False])
    # Distillation only: the teacher's sequence gets teacher - student, the other its task advantage.
    assert distilled(seq_adv, student, teacher, has_teacher).tolist() == [[0.5, -1.0], [-0.6, -0.6]]
    # With weight 0.5: + 0.5 * 0.4 on each token of the distilled sequence.
    mixed = distilled(seq_adv, student, teacher, has_teacher, 0.5)
    assert torch.allclose(mixed, torch.tensor([[0.7, -0.8], [-0.6, -0.6]], dtype=F64))
    # sampledWeight scales only the teacher's part; 0 leaves the task's (and the dense term).
    half = distilled(seq_adv, student, teacher, has_teacher, 0.5, sampled_weight=0.5)
    assert torch.allclose(half, torch.tensor([[0.45, -0.3], [-0.6, -0.6]], dtype=F64))
    task_only = distilled(seq_adv, student, teacher, has_teacher, 0.5, sampled_weight=0.0)
    assert torch.allclose(task_only, torch.tensor([[0.2, 0.2], [-0.6, -0.6]], dtype=F64))


# Two groups, every case at once: a (rewards 2, 1, 0, shaping rewards 1, 0, 0 credited to
# marked tokens) and b (rewards 1, 0; b/0 scored by a teacher at -1 per generated token).
MASK = [0, 0, 1, 1, 1, 1]
MARKS = {"a/0": [0, 0, 1, 0, 0, 0], "a/1": [0, 0, 1, 0, 0, 0], "a/2": [0, 0, 1, 1, 1, 1]}


def _two_groups() -> list[Trajectory]:
    out = []
    for tid, reward, shaping in (("a/0", 2.0, 1.0), ("a/1", 1.0, 0.0), ("a/2", 0.0, 0.0),
                                 ("b/0", 1.0, 0.0), ("b/1", 0.0, 0.0)):
        t = Trajectory(id=tid, task_id=tid[0], group_id=tid[0], tokens=[5, 6, 7, 8, 9, 10],
                       loss_mask=MASK, logp_infer=[0.0, 0.0, -1.0, -1.0, -1.0, -1.0],
                       version_spans=[VersionSpan(2, 6, 0)], reward=reward,
                       shaping_reward=shaping, shaping_mask=MARKS.get(tid, []),
                       teacher_logp=[0.0, 0.0, -1.0, -1.0, -1.0, -1.0] if tid == "b/0" else [])
        t.check()
        out.append(t)
    return out


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_two_groups_by_hand() -> None:
    """What the engine's step hands the loss, against the module doc's formulas worked by hand:
    a's mean 1 (A = 1, 0, -1), shaping mean 1/3 (S = 2/3, -1/3, -1/3 on the marked tokens,
    E = A - S elsewhere); b's mean 1/2 (A = +-1/2); b/0's tokens
    sampled_weight * (teacher - student) + task_reward_weight * A with the student at 0."""
    batch, logp = _two_groups(), torch.zeros(5, 6)
    e, s = [THIRD, THIRD, -2 * THIRD], [2 * THIRD, -THIRD, -THIRD]
    task = [[e[i] + s[i] * m for m in MARKS[f"a/{i}"]] for i in range(3)] + [[0.5] * 6, [-0.5] * 6]

    # mean, no teacher in play (a KL-penalised stage's frozen log-probs are no teacher's).
    plain = token_advantages(_tb(batch), logp, distill=False, task_reward_weight=0.5)
    _close(plain, task)
    assert plain[0, 2].item() == pytest.approx(1.0) and plain[1, 2].item() == pytest.approx(0.0)

    # mean, distilled: only b/0 changes, by the teacher's term plus 0.5 of its task advantage.
    opd = token_advantages(_tb(batch), logp, task_reward_weight=0.5, sampled_weight=1.0)
    b0 = [0.0 + 0.5 * 0.5] * 2 + [-1.0 + 0.5 * 0.5] * 4
    _close(opd, task[:3] + [b0, task[4]])
    half = token_advantages(_tb(batch), logp, task_reward_weight=0.0, sampled_weight=0.5)
    assert half[3].tolist() == pytest.approx([0.0, 0.0] + [-0.5] * 4)

    # mean-std: both parts of a over a's reward std, b's over b's (sample std, + 1e-6).
    std_a, std_b = 1.0 + 1e-6, math.sqrt(0.5) + 1e-6
    normed = token_advantages(_tb(batch, "mean-std"), logp, distill=False)
    _close(normed, [[x / std_a for x in row] for row in task[:3]]
           + [[x / std_b for x in row] for row in task[3:]])


def test_the_split_and_the_task_weight_are_not_skipped() -> None:
    """Skipping the split would give every token of a/0 its whole advantage (1) and of a/1 its
    (0), where the tokens off the mask carry 1/3; ignoring task_reward_weight would leave b/0's
    tokens the teacher's term alone (-1), not -1 + 0.5 * 1/2."""
    batch, logp = _two_groups(), torch.zeros(5, 6)
    adv = token_advantages(_tb(batch), logp, task_reward_weight=0.5)
    assert adv[1, 2].item() == pytest.approx(0.0, abs=1e-6)
    assert adv[1, 3:].tolist() == pytest.approx([THIRD] * 3)
    assert adv[0, 3:].tolist() == pytest.approx([THIRD] * 3)
    assert adv[3, 2:].tolist() == pytest.approx([-0.75] * 4)
    unweighted = token_advantages(_tb(batch), logp, task_reward_weight=0.0)
    assert unweighted[3, 2:].tolist() == pytest.approx([-1.0] * 4)
