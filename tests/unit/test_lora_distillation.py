"""On-policy distillation from a LoRA student: the OPD step (sampled-token advantage from the
teacher's log-probs, and the dense top-k term) trains the adapter alone, and its loss and
gradients are the full model's on the merged weights W + (alpha / r) B A, by the chain rule:
dL/dB = s G A^T and dL/dA = s B^T G, with G the full model's gradient of W."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from kiln.api.loss import MaskedLoss
from kiln.api.model import LoraSpec
from kiln.models import lora, parallel
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, RLTerms, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

LORA = LoraSpec(rank=4, alpha=8.0)  # every projection: each fused layer wholly adapted
K = 3


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A small corpus: its tokenizer trains in milliseconds (the default one takes seconds).
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora-opd") / "m", hidden_size=64, num_layers=2,
                                intermediate_size=128, seed=0, vocab_size=320,
                                texts=[f"compute {i} * {i + 3} and answer" for i in range(200)])


def _trajectories() -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(4):
        n = rng.randint(8, 12)
        tokens = [rng.randrange(4, 300) for _ in range(n)]
        mask = [0] * 3 + [1] * (n - 3)
        ids, lps = [], []
        for m in mask:
            ids += rng.sample(range(4, 300), K) if m else [0] * K
            lps += [math.log(p) for p in (0.7, 0.2, 0.1)] if m else [0.0] * K
        out.append(Trajectory(id=f"t{i}", task_id="x", group_id="g", tokens=tokens, loss_mask=mask,
                              logp_infer=[0.0] * n, version_spans=[VersionSpan(3, n, 0)], reward=float(i % 2),
                              teacher_top_k=K, teacher_topk_ids=ids, teacher_topk_logp=lps))
    return out


def _config(model_dir: Path, lora_spec: LoraSpec | None) -> TrainerConfig:
    # No clipping, so the gradients compared are the raw ones; both distillation terms on.
    return TrainerConfig(model_dir=model_dir, micro_batch_size=2, lora=lora_spec, loss=MaskedLoss(),
                         optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
                         terms=RLTerms(sampled_weight=1.0, dense_weight=1.0))


def test_a_lora_students_opd_step_is_the_merged_models(model_dir: Path, tmp_path: Path) -> None:
    student = TrainerEngine(_config(model_dir, LORA), resume=False)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a trained adapter: B != 0, so A gets a gradient too
        for n, p in lora.adapter_parameters(student.model).items():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    full = TrainerEngine(_config(student.export_hf(tmp_path / "merged"), None), resume=False)

    trajs = _trajectories()
    rng = random.Random(1)
    for t, lp in zip(trajs, student.logprobs([t.tokens for t in trajs])):
        # On-policy samples; a teacher that disagrees with the student on the sampled tokens.
        t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
        t.teacher_logp = [x + rng.uniform(-1.0, 0.5) if m else 0.0 for x, m in zip(lp, t.loss_mask)]
        t.check()
    base = {n: p.detach().clone() for n, p in student.model.named_parameters() if ".lora." not in n}
    adapters = {n: p.detach().clone() for n, p in lora.adapter_parameters(student.model).items()}

    ours, theirs = student.step(trajs), full.step(trajs)
    assert ours.loss == pytest.approx(theirs.loss, rel=1e-5)
    assert ours.dense_kl == pytest.approx(theirs.dense_kl, rel=1e-5)
    assert ours.dense_kl > 0 and abs(ours.loss) > 1e-4

    params = dict(student.model.named_parameters())
    assert all(p.grad is None and torch.equal(p, base[n]) for n, p in params.items() if n in base)
    assert all(not torch.equal(params[n], a) for n, a in adapters.items())  # the adapter moved
    full_params = dict(full.model.named_parameters())
    worst = 0.0
    for name, module in student.model.named_modules():
        if not hasattr(module, "lora"):
            continue
        a, b = adapters[f"{name}.lora.lora_A"], adapters[f"{name}.lora.lora_B"]
        g = full_params[f"{name}.weight"].grad  # [out, in]
        s = LORA.scaling
        for got, want in ((module.lora.lora_B.grad, s * g @ a.t()), (module.lora.lora_A.grad, s * b.t() @ g)):
            err = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, err)
    assert worst <= 1e-4, worst
    print(f"LoRA OPD step vs merged full model: loss {ours.loss:.6e} vs {theirs.loss:.6e}, "
          f"worst relative adapter-gradient error {worst:.2e}")
