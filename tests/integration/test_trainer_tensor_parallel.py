"""Tensor parallelism over two gloo processes: logits and log-probs match transformers, the
gathered export reproduces the checkpoint exactly, and a training step (loss, gradient norm
across shards, updated weights) matches the same step at TP=1, for Qwen2, Llama and Qwen3 (q/k
norms per head, a head size other than hidden / heads). The MoE families (Qwen2-MoE, Qwen3-MoE,
GLM-4.5, DeepSeek-V3) are refused at tensorParallel > 1 by the family registry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kiln.metrics import StepMetrics
from kiln.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

ADAM_EPS = 1e-4
"""AdamW's first update is lr * g / (|g| + eps): with the default eps an element whose gradient
is of order 1e-8 moves by up to lr for a reduction-order difference of that size; this eps keeps
the update smooth in the gradient, so the weights compare the gradients of the two layouts."""

TRAINED = (0, 2)
"""The models a training step is compared for: Qwen2 and Qwen3."""


def _check_model(tp: int, model_dir: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from kiln.models import parallel
    from kiln.models.hf_io import iter_hf_tensors, load_hf_checkpoint
    from kiln.models.megatron_model import forward_logits, token_logprobs

    model, spec = load_hf_checkpoint(Path(model_dir), tp=tp)
    # Each rank really holds a shard, not the whole model.
    assert model.embedding.word_embeddings.weight.shape[0] == spec.vocab_size // tp
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape[0] == 2 * spec.intermediate_size // tp
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0] == (
        (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim // tp)
    tokens = torch.randint(0, spec.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = parallel.all_gather_tp(forward_logits(model, tokens), dim=-1)
        logp = token_logprobs(model, tokens)
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(tokens).logits
    assert (logits - ref).abs().max().item() <= 1e-5
    ref_logp = torch.log_softmax(ref, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert (logp[:, 1:] - ref_logp).abs().max().item() <= 1e-5
    original = load_file(str(Path(model_dir) / "model.safetensors"))
    exported = dict(iter_hf_tensors(model, spec))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def _batch():
    from kiln.trajectory import Trajectory, VersionSpan

    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(3):
        tokens = torch.randint(4, 300, (12,), generator=g).tolist()
        out.append(Trajectory(id=str(i), task_id="x", group_id="g", tokens=tokens, loss_mask=[0] * 4 + [1] * 8,
                              logp_infer=[0.0] * 12, version_spans=[VersionSpan(4, 12, 0)]))
    return out


def _train(tp: int, model_dir: str, out_dir: Path) -> dict:
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    engine = TrainerEngine(TrainerConfig(model_dir=Path(model_dir), tensor_parallel=tp, micro_batch_size=2,
                                         optimizer=OptimizerConfig(lr=1e-3, grad_clip=0.1,
                                                                             eps=ADAM_EPS)))
    m = engine.sft_step(_batch())
    engine.export_hf(out_dir)
    return m


def _worker(rank: int, tp: int, init_method: str, model_dirs: list[str], out: str) -> None:
    from kiln.models import parallel

    torch.set_num_threads(1)
    parallel.init_parallel(tp, rank=rank, init_method=init_method)
    try:
        for model_dir in model_dirs:
            _check_model(tp, model_dir)
        for i in TRAINED:
            m = _train(tp, model_dirs[i], Path(out) / f"weights{i}")
            if rank == 0:
                (Path(out) / f"metrics{i}.json").write_text(json.dumps(m.record()))
    finally:
        parallel.shutdown_parallel()


def test_tp2_logits_and_export(tmp_path: Path) -> None:
    from kiln.models.parallel import free_port

    # One spawn for both architectures: starting the processes dominates the run time.
    model_dirs = [
        str(
            make_tiny_checkpoint(
                tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, tie_word_embeddings=tied,
            )
        )
        for arch, tied in (("qwen2", False), ("llama", True))
    ] + [str(make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=32, intermediate_size=128))]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "tp2"
    out.mkdir()
    mp.spawn(_worker, args=(2, init_method, model_dirs, str(out)), nprocs=2, join=True)

    # The same step at TP=1 in this process.
    from safetensors.torch import load_file

    from kiln.models import parallel

    parallel.init_parallel(1)
    for i in TRAINED:
        ref = _train(1, model_dirs[i], tmp_path / f"tp1-{i}")
        got = StepMetrics.from_record(json.loads((out / f"metrics{i}.json").read_text()))
        assert got.grad_norm > 0.1  # clipping was active, so the norm across shards matters
        assert got.loss == pytest.approx(ref.loss, rel=1e-5)
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
        w1 = load_file(str(tmp_path / f"tp1-{i}" / "model.safetensors"))
        w2 = load_file(str(out / f"weights{i}" / "model.safetensors"))
        assert w1.keys() == w2.keys()
        diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
        print(f"{Path(model_dirs[i]).name}: TP=2 vs TP=1 loss {got.loss!r} / {ref.loss!r}, weights differ by {diff:.3g}")
        assert diff <= 1e-5
