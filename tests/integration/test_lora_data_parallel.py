"""LoRA at DP=2 over two gloo processes: two training steps give the DP=1 loss, gradient norm and
adapter, both replicas hold the same adapter and the base they started from, and the only
gradients reduced across the replicas are the adapters' (the frozen base has none to reduce)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kiln.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-5
"""float32: the replicas' summed gradients differ from one process's in reduction order only."""


def _batch():
    from kiln.trajectory import Trajectory, VersionSpan

    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(4):  # lengths differ, so the replicas' rows carry different token counts
        n = 10 + 3 * i
        tokens = torch.randint(4, 300, (n,), generator=g).tolist()
        out.append(Trajectory(id=str(i), task_id="x", group_id="g", tokens=tokens, loss_mask=[0] * 4 + [1] * (n - 4),
                              logp_infer=[0.0] * n, version_spans=[VersionSpan(4, n, 0)]))
    return out


def _train(dp: int, model_dir: str, out: Path) -> list[dict]:
    from safetensors.torch import save_file

    from kiln.api.model import LoraSpec
    from kiln.models import lora, parallel
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    engine = TrainerEngine(TrainerConfig(
        model_dir=Path(model_dir), data_parallel=dp, micro_batch_size=1,
        lora=LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.05)), resume=False)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    reduced: list[int] = []
    if dp > 1:
        # Record what crosses the replicas: gradients and the loss statistics, nothing else.
        reduce = parallel.all_reduce_dp
        parallel.all_reduce_dp = lambda tensors: (reduced.append(sum(t.numel() for t in tensors)),
                                                  reduce(tensors))[1]
    steps = [engine.sft_step(_batch()).record() for _ in range(2)]
    assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters() if n in base)
    adapter_numel = sum(p.numel() for p in lora.adapter_parameters(engine.model).values())
    steps[0]["reduced"] = reduced
    steps[0]["adapter_numel"] = adapter_numel
    adapter = {n: t.contiguous() for n, t in lora.adapter_hf_tensors(engine.model, engine.spec)}
    save_file(adapter, str(out / f"adapter-dp{dp}-rank{parallel.dp_rank()}.safetensors"))
    return steps


def _worker(rank: int, init_method: str, model_dir: str, out: str) -> None:
    from kiln.models import parallel

    torch.set_num_threads(1)
    parallel.init_parallel(1, dp=2, rank=rank, init_method=init_method)
    try:
        steps = _train(2, model_dir, Path(out))
        if rank == 0:
            (Path(out) / "steps.json").write_text(json.dumps(steps))
    finally:
        parallel.shutdown_parallel()


def test_lora_dp2_matches_dp1(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from kiln.models import parallel
    from kiln.models.parallel import free_port

    model_dir = str(make_tiny_checkpoint(tmp_path / "m", arch="qwen2", hidden_size=64, num_layers=2,
                                         num_heads=4, num_kv_heads=2, intermediate_size=128,
                                         tie_word_embeddings=False))
    mp.spawn(_worker, args=(f"tcp://127.0.0.1:{free_port()}", model_dir, str(tmp_path)), nprocs=2, join=True)
    parallel.init_parallel(1)
    ref = _train(1, model_dir, tmp_path)
    got = json.loads((tmp_path / "steps.json").read_text())
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=TOLERANCE)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOLERANCE)
    assert got[1]["grad_norm"] > 0.05  # clipping was active
    # Per minibatch: one reduce of the adapters' gradients, one of the loss and its statistics.
    reduced = got[0]["reduced"]
    assert reduced[0::2] == [got[0]["adapter_numel"]] * 2 and max(reduced[1::2]) < 64
    w1 = load_file(str(tmp_path / "adapter-dp1-rank0.safetensors"))
    r0 = load_file(str(tmp_path / "adapter-dp2-rank0.safetensors"))
    r1 = load_file(str(tmp_path / "adapter-dp2-rank1.safetensors"))
    assert w1.keys() == r0.keys() == r1.keys()
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the replicas never drift apart
    diff = max((w1[k] - r0[k]).abs().max().item() for k in w1)
    print(f"LoRA DP=2 vs DP=1 after 2 steps: max|adapter diff| {diff:.2e}, loss rel diff "
          f"{max(abs(a['loss'] / b['loss'] - 1) for a, b in zip(got, ref)):.2e}")
    assert diff <= TOLERANCE
    assert any(not torch.equal(w1[k], torch.zeros_like(w1[k])) for k in w1 if k.endswith("lora_B.weight"))
