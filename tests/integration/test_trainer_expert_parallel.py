"""Expert parallelism over two gloo processes (two data-parallel replicas, each holding half of
every MoE layer's experts) against one process holding them all, for Qwen3-MoE and GLM-4.5 MoE
(sigmoid routing with expert groups and a dense first layer):
- each rank really holds its half, computes transformers' logits on its own rows (different
  token counts per rank: the padded dispatch), and exports the whole checkpoint bit for bit;
- one training step (replicas with different numbers of micro-batches: the idle passes) gives
  the loss and gradient norm of the one-process step, and exported / published weights equal to
  its weights within float32 reduction order (TOLERANCE: each token's expert outputs are summed
  per rank, then across ranks);
- a checkpoint written at EP=2 resumes at EP=2 to the same weights, and is refused at EP=1."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kiln.metrics import StepMetrics
from kiln.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6
"""Largest difference allowed between EP=2 and EP=1 updated weights and relative difference of
the loss and gradient norm (float32; measured: weights 8e-9 for Qwen3-MoE and 6e-8 for GLM-4.5,
loss 8e-8, gradient norm 3e-8 relative, the weights being of order 0.1)."""

ADAM_EPS = 1e-4
"""AdamW's first update is lr * g / (|g| + eps): with the default eps (1e-8) an element whose
gradient is itself of order 1e-8 moves by up to lr for a gradient difference of that size, so a
reduction-order difference would show as a weight difference of order lr. A larger eps keeps the
update smooth in the gradient (it moves by at most lr / eps times the gradient's difference),
so the weights compare the gradients the two layouts compute."""

ARCHS = {
    "qwen3_moe": dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # One dense first layer, then MoE layers routing top-4 within the best 2 of 4 expert groups.
    "glm4_moe": dict(arch="glm4_moe", hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                     intermediate_size=128, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                     n_group=4, topk_group=2, first_k_dense_replace=1),
}


def _batch():
    from kiln.trajectory import Trajectory, VersionSpan

    g = torch.Generator().manual_seed(2)
    out = []
    # 5 sequences of different lengths at micro-batch size 2: replica 0 takes rows 0, 2, 4 (two
    # micro-batches), replica 1 rows 1, 3 (one), so replica 1 makes an idle pass.
    for i, n in enumerate((12, 9, 15, 7, 11)):
        tokens = torch.randint(4, 300, (n,), generator=g).tolist()
        out.append(Trajectory(id=str(i), task_id="x", group_id="g", tokens=tokens,
                              loss_mask=[0] * 3 + [1] * (n - 3), logp_infer=[0.0] * n,
                              version_spans=[VersionSpan(3, n, 0)]))
    return out


def _config(model_dir: str, dp: int, ep: int, checkpoints: Path | None = None):
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig

    return TrainerConfig(model_dir=Path(model_dir), data_parallel=dp, expert_parallel=ep, micro_batch_size=2,
                         optimizer=OptimizerConfig(lr=1e-3, grad_clip=0.1, eps=ADAM_EPS), checkpoint_dir=checkpoints,
                         checkpoint_interval=1000 if checkpoints else 0)


def _check_model(model_dir: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from kiln.models import parallel
    from kiln.models.hf_io import iter_hf_tensors, load_hf_checkpoint, weight_rows
    from kiln.models.megatron_model import forward_logits

    model, spec = load_hf_checkpoint(Path(model_dir), ep=2)
    model.eval()
    experts = {n.split(".local_experts.")[1].split(".")[0] for n, _ in model.named_parameters()
               if ".local_experts." in n}
    assert len(experts) == spec.moe.num_experts // 2  # this rank holds half of the experts
    # Each rank its own rows, of a different length: the dispatcher pads to the longest.
    tokens = torch.randint(4, 300, (2, 17 + 6 * parallel.ep_rank()),
                           generator=torch.Generator().manual_seed(parallel.ep_rank()))
    with torch.no_grad():
        ours = forward_logits(model, tokens)
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-5
    original = load_file(str(Path(model_dir) / "model.safetensors"))
    exported = list(iter_hf_tensors(model, spec))
    # The whole model, in the order (and so the buckets) of an unsplit one: the weight table's.
    assert [n for n, _ in exported] == [n for _, _, names in weight_rows(spec) for n in names]
    for name, t in exported:
        assert torch.equal(t, original[name]), name


def _worker(rank: int, init_method: str, model_dirs: list[str], out: str) -> None:
    from kiln.models import parallel
    from kiln.services.trainer.engine import TrainerEngine

    torch.set_num_threads(1)
    parallel.init_parallel(1, dp=2, ep=2, rank=rank, init_method=init_method)
    try:
        for i, model_dir in enumerate(model_dirs):
            _check_model(model_dir)
            ckpts = Path(out) / f"ckpt{i}"
            engine = TrainerEngine(_config(model_dir, 2, 2, ckpts))
            m = engine.sft_step(_batch())
            published = engine.gathered_hf_tensors()
            engine.export_hf(Path(out) / f"weights{i}")
            engine.save_checkpoint()
            resumed = TrainerEngine(_config(model_dir, 2, 2, ckpts))
            again = resumed.gathered_hf_tensors()
            if rank == 0:
                (Path(out) / f"metrics{i}.json").write_text(json.dumps(m.record()))
                torch.save({"published": dict(published), "resumed": dict(again)}, Path(out) / f"published{i}.pt")
            else:
                assert published == [] and again == []
    finally:
        parallel.shutdown_parallel()


def test_ep2_equals_one_rank(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from kiln.models import parallel
    from kiln.models.parallel import free_port
    from kiln.services.trainer.engine import TrainerEngine

    # One spawn for both families: starting the processes dominates the run time.
    model_dirs = [str(make_tiny_checkpoint(tmp_path / arch, seed=7, **kw)) for arch, kw in ARCHS.items()]
    out = tmp_path / "ep2"
    out.mkdir()
    mp.spawn(_worker, args=(f"tcp://127.0.0.1:{free_port()}", model_dirs, str(out)), nprocs=2, join=True)

    # The same step on one process holding every expert.
    parallel.init_parallel(1)
    try:
        for i, model_dir in enumerate(model_dirs):
            engine = TrainerEngine(_config(model_dir, 1, 1))
            ref = engine.sft_step(_batch())
            engine.export_hf(tmp_path / f"ep1-{i}")
            got = StepMetrics.from_record(json.loads((out / f"metrics{i}.json").read_text()))
            assert got.grad_norm > 0.1  # clipping was active, so the norm across EP ranks matters
            assert got.loss == pytest.approx(ref.loss, rel=TOLERANCE)
            assert got.grad_norm == pytest.approx(ref.grad_norm, rel=TOLERANCE)
            w1 = load_file(str(tmp_path / f"ep1-{i}" / "model.safetensors"))
            w2 = load_file(str(out / f"weights{i}" / "model.safetensors"))
            assert w1.keys() == w2.keys()
            diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
            print(f"{Path(model_dir).name}: loss {got.loss!r} vs {ref.loss!r}, grad norm {got.grad_norm!r} vs "
                  f"{ref.grad_norm!r}, weights differ by {diff:.3g}")
            assert diff <= TOLERANCE
            saved = torch.load(out / f"published{i}.pt")
            # What weight sync publishes is what export writes, and the checkpoint resumes it.
            for name, t in w2.items():
                assert torch.equal(saved["published"][name], t), name
                assert torch.equal(saved["resumed"][name], t), name
            # A checkpoint split over two EP ranks is refused by one as a resume, but exported
            # (`kiln export`: load_weights) as the whole model, bit for bit what EP 2 wrote.
            with pytest.raises(ValueError, match="expertParallel 2, this trainer runs 1"):
                TrainerEngine(_config(model_dir, 1, 1, out / f"ckpt{i}"))
            whole = TrainerEngine(_config(model_dir, 1, 1))
            (ckpt,) = sorted((out / f"ckpt{i}").glob("step_*"))
            whole.load_weights(ckpt)
            whole.export_hf(tmp_path / f"merged-{i}")
            merged = load_file(str(tmp_path / f"merged-{i}" / "model.safetensors"))
            assert merged.keys() == w2.keys()
            assert all(torch.equal(merged[k], w2[k]) for k in w2)
    finally:
        parallel.shutdown_parallel()
