"""LoRA at TP=2 over two gloo processes: two training steps (the second one trains A too) give
the TP=1 loss, gradient norm and adapter, so the adapters' shards and all-reduces are placed
right for column- and row-parallel layers and for a fused layer targeted in part."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kiln.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _batch():
    from kiln.trajectory import Trajectory, VersionSpan

    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(3):
        tokens = torch.randint(4, 300, (12,), generator=g).tolist()
        out.append(Trajectory(id=str(i), task_id="x", group_id="g", tokens=tokens, loss_mask=[0] * 4 + [1] * 8,
                              logp_infer=[0.0] * 12, version_spans=[VersionSpan(4, 12, 0)]))
    return out


def _train(tp: int, model_dir: str, out: Path) -> list[dict]:
    from safetensors.torch import save_file

    from kiln.api.model import LoraSpec
    from kiln.models import parallel
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    engine = TrainerEngine(TrainerConfig(
        model_dir=Path(model_dir), tensor_parallel=tp, micro_batch_size=2,
        lora=LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.05)), resume=False)
    steps = [engine.sft_step(_batch()).record() for _ in range(2)]
    adapter = {n: t.contiguous() for n, t in engine.named_hf_tensors()}
    if parallel.tp_rank() == 0:
        save_file(adapter, str(out / f"adapter-tp{tp}.safetensors"))
    return steps


def _worker(rank: int, init_method: str, model_dir: str, out: str) -> None:
    from kiln.models import parallel

    torch.set_num_threads(1)
    parallel.init_parallel(2, rank=rank, init_method=init_method)
    try:
        steps = _train(2, model_dir, Path(out))
        if rank == 0:
            (Path(out) / "steps.json").write_text(json.dumps(steps))
    finally:
        parallel.shutdown_parallel()


def test_lora_tp2_matches_tp1(tmp_path: Path) -> None:
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
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert got[1]["grad_norm"] > 0.05  # clipping was active: the norm over shards counts
    w1 = load_file(str(tmp_path / "adapter-tp1.safetensors"))
    w2 = load_file(str(tmp_path / "adapter-tp2.safetensors"))
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-5
    moved = [k for k in w1 if k.endswith("lora_A.weight")]
    assert moved
