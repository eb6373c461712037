"""Dense on-policy distillation (`rl.teacherTopK`): the forward KL on the teacher's top k, on
hand-made numbers, the gradient it gives a token the student no longer samples (which the
sampled-token advantage cannot), and the trainer's step on a tiny model checked against an
independent transformers computation."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from kiln.api.loss import MaskedLoss
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.advantages import distilled
from kiln.services.trainer.batch import collate
from kiln.services.trainer.config import OptimizerConfig, RLTerms, TrainerConfig
from kiln.services.trainer.distill import dense_kl
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.loss import policy_loss
from kiln.trajectory import Trajectory, VersionSpan


def test_dense_kl_on_hand_made_numbers() -> None:
    teacher = torch.tensor([[[math.log(0.6), math.log(0.2)], [0.0, 0.0]]])
    student = torch.tensor([[[math.log(0.5), math.log(0.1)], [-1.0, -2.0]]])
    on = torch.tensor([[True, False]])
    # q = (0.75, 0.25): 0.75 ln(0.75 / 0.5) + 0.25 ln(0.25 / 0.1); nothing where off.
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(2.5)
    out = dense_kl(student, teacher, on)
    assert out[0, 0].item() == pytest.approx(expected, rel=1e-6) and out[0, 1].item() == 0.0
    # Equal distributions over the k, with the student's mass all on them: zero.
    same = torch.log(torch.tensor([[[0.75, 0.25]]]))
    assert dense_kl(same, same + 3.0, torch.tensor([[True]])).item() == pytest.approx(0.0, abs=1e-6)


def test_the_dense_term_reaches_a_token_the_student_no_longer_samples() -> None:
    """The forgetting example's collapse, in one place: the student puts 0.9999 on `bash` (id
    1), the teacher 0.99 on `step` (id 2). The sampled-token advantage moves `step`'s logit by
    about nothing; the dense term by about 1."""
    # Position 0 predicts token 1 (the trained one); position 1 predicts nothing here.
    logits = torch.tensor([[[0.0, 12.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    tokens, mask = torch.tensor([[3, 1]]), torch.tensor([[0.0, 1.0]])

    def grads(dense_weight: float) -> torch.Tensor:
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = torch.nn.functional.pad(logp_all[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0], (1, 0))
        teacher_logp = torch.tensor([[0.0, math.log(0.005)]])  # the teacher on `bash`
        adv = distilled(torch.zeros(1), logp, teacher_logp, torch.tensor([True]), 0.0)
        ids = torch.tensor([[[0, 0], [2, 1]]])
        student_topk = torch.nn.functional.pad(logp_all[:, :-1].gather(-1, ids[:, 1:]), (0, 0, 1, 0))
        loss, stats = policy_loss(logp, logp.detach(), mask, adv, MaskedLoss(),
                                  dense_weight=dense_weight, student_topk=student_topk,
                                  teacher_topk=torch.log(torch.tensor([[[1.0, 1.0], [0.99, 0.005]]])),
                                  has_topk=torch.tensor([True]))
        (g,) = torch.autograd.grad(loss, logits)
        return g[0, 0], stats

    sparse, _ = grads(0.0)
    dense, stats = grads(1.0)
    assert abs(sparse[2].item()) < 1e-3
    # d/d logit_step of sum_j q_j (log q_j - log p_j) = p_step - q_step ~ -0.99: descent raises it.
    assert dense[2].item() < -0.9
    assert stats.as_dict()["dense_kl"] > 4.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "m", hidden_size=64, num_layers=2,
                                intermediate_size=128, seed=0)


def _trajectories(k: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(4):
        n = rng.randint(8, 12)
        tokens = [rng.randrange(4, 300) for _ in range(n)]
        mask = [0] * 3 + [1] * (n - 3)
        ids, lps = [], []
        for m in mask:
            top = rng.sample(range(4, 300), k)
            ids += top if m else [0] * k
            lps += [math.log(p) for p in (0.7, 0.2, 0.1)] if m else [0.0] * k
        out.append(Trajectory(id=f"t{i}", task_id="x", group_id="g", tokens=tokens, loss_mask=mask,
                              logp_infer=[0.0] * n, version_spans=[VersionSpan(3, n, 0)],
                              teacher_top_k=k, teacher_topk_ids=ids, teacher_topk_logp=lps))
    return out


def test_trainer_step_distils_the_top_k_and_reports_it_as_transformers_computes_it(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    trajs = _trajectories(k=3)
    for t in trajs:
        t.check()
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, micro_batch_size=2,
                                         optimizer=OptimizerConfig(lr=3e-3, grad_clip=1.0),
                                         terms=RLTerms(dense_weight=1.0)))
    # The teacher agrees with the student on the sampled tokens: the sampled-token advantage
    # is 0 and the dense term is all there is.
    for t, lp in zip(trajs, engine.logprobs([t.tokens for t in trajs])):
        t.teacher_logp = t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tb = collate(trajs)
    total = tokens = 0.0
    with torch.no_grad():
        for i, t in enumerate(trajs):
            n = len(t.tokens)
            logp = torch.log_softmax(hf(torch.tensor([t.tokens])).logits[0, :-1].float(), -1)
            student = torch.nn.functional.pad(logp.gather(-1, tb.topk_ids[i, 1:n]), (0, 0, 1, 0))
            on = tb.loss_mask[i:i + 1, :n].bool()
            total += float(dense_kl(student[None], tb.topk_logp[i:i + 1, :n], on).sum())
            tokens += float(on.sum())
    first = engine.step(trajs)
    assert first.dense_kl == pytest.approx(total / tokens, rel=1e-4)
    for _ in range(5):
        last = engine.step(trajs)
    assert last.dense_kl < 0.8 * first.dense_kl


def test_trajectories_carry_k_entries_per_token() -> None:
    (t,) = _trajectories(k=3)[:1]
    t.check()
    t.teacher_topk_logp = t.teacher_topk_logp[:-1]
    with pytest.raises(ValueError, match="teacher top-k"):
        t.check()
