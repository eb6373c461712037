"""LoRA at TP=1: adapter math, frozen base, what a version carries, merging, PEFT export, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln.api.loss import MaskedLoss
from kiln.api.model import LoraSpec
from kiln.models import lora, parallel
from kiln.models.hf_io import load_hf_checkpoint, read_hf_state_dict
from kiln.models.megatron_model import forward_logits
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

SUBSET = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A small corpus: its tokenizer trains in milliseconds (the default one takes seconds).
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora") / "m", arch="qwen2", hidden_size=64,
                                num_layers=2, intermediate_size=128, tie_word_embeddings=False, seed=3,
                                texts=[f"compute {i} * {i + 3} and answer" for i in range(200)], vocab_size=320)


def _tokens(spec, n: int = 2, s: int = 24) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (n, s), generator=torch.Generator().manual_seed(1))


def _randomise_b(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in lora.adapter_parameters(model).items():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("target", [LoraSpec(rank=4), SUBSET], ids=["all", "subset"])
def test_fresh_adapter_is_identity_and_only_adapters_learn(model_dir: Path, target: LoraSpec) -> None:
    model, spec = load_hf_checkpoint(model_dir)
    tokens = _tokens(spec)
    with torch.no_grad():
        before = forward_logits(model, tokens)
    adapted = lora.attach(model, spec, target, seed=0)
    assert len(adapted) == spec.num_layers * (4 if target is not SUBSET else 3)  # SUBSET: no o_proj
    logits = forward_logits(model, tokens)
    assert torch.equal(logits, before)  # B = 0: the adapter adds exactly zero
    logits.float().logsumexp(-1).mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora.lora_" in n for n in trainable)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    grads = lora.adapter_parameters(model)
    # With B = 0 only B gets a gradient (A's is B^T times something).
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in grads.items() if n.endswith("lora_B"))


def test_merged_weights_give_the_adapted_model(model_dir: Path) -> None:
    """transformers on base + scaling * B @ A (the rollout's merge of what a version carries)
    computes the trainer's adapted logits; untargeted projections of a fused layer stay base."""
    model, spec = load_hf_checkpoint(model_dir)
    lora.attach(model, spec, SUBSET, seed=0)
    _randomise_b(model)
    tokens = _tokens(spec)
    with torch.no_grad():
        ours = forward_logits(model, tokens)
    adapter = list(lora.adapter_hf_tensors(model, spec))
    names = {n for n, _ in adapter}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert not any(p in n for n in names for p in ("k_proj", "o_proj", "gate_proj"))
    base = read_hf_state_dict(model_dir)
    pristine = {n: t.clone() for n, t in base.items()}
    merged = dict(lora.merge_adapter(base, adapter, SUBSET.scaling))
    assert all(torch.equal(base[n], pristine[n]) for n in base)  # the base is left as it was
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.load_state_dict(merged, strict=True)
    with torch.no_grad():
        ref = hf(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-5


def test_merges_never_accumulate() -> None:
    base = {"l.weight": torch.randn(6, 5), "n.weight": torch.ones(5)}
    pristine = {n: t.clone() for n, t in base.items()}

    def adapter(seed: int):
        g = torch.Generator().manual_seed(seed)
        return [(f"{lora.PEFT_PREFIX}l.lora_A.weight", torch.randn(2, 5, generator=g)),
                (f"{lora.PEFT_PREFIX}l.lora_B.weight", torch.randn(6, 2, generator=g))]

    lora.merge_adapter(base, adapter(1), 2.0)
    second = dict(lora.merge_adapter(base, adapter(2), 2.0))
    (_, a), (_, b) = adapter(2)
    assert torch.allclose(second["l.weight"], pristine["l.weight"] + 2.0 * b @ a, atol=1e-6)
    assert torch.equal(second["n.weight"], pristine["n.weight"])
    with pytest.raises(ValueError, match="unpaired"):
        lora.merge_adapter(base, adapter(1)[:1], 2.0)


def _batch(n: int = 4) -> list[Trajectory]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        tokens = torch.randint(4, 300, (12,), generator=g).tolist()
        out.append(Trajectory(id=f"t{i}", task_id="t", group_id="g", tokens=tokens, loss_mask=[0] * 3 + [1] * 9,
                              logp_infer=[0.0] * 12, version_spans=[VersionSpan(3, 12, 0)],
                              reward=1.0 if i % 2 == 0 else -1.0))
    return out


def test_engine_trains_adapters_alone_ships_them_and_resumes(model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model_dir=model_dir, micro_batch_size=2, lora=SUBSET, checkpoint_dir=tmp_path / "ck",
                        optimizer=OptimizerConfig(lr=1e-2), loss=MaskedLoss())
    engine = TrainerEngine(cfg)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    adapters = lora.adapter_parameters(engine.model)
    assert in_optimizer == {id(p) for p in adapters.values()}
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if ".lora." not in n}
    first = engine.sft_step(_batch())
    for _ in range(3):
        last = engine.sft_step(_batch())
    assert last.loss < first.loss
    assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters() if n in base)
    payload = list(engine.named_hf_tensors())
    assert payload[-1][0] == lora.BASE_DIGEST  # the base it applies to, then A and B alone
    assert payload[:-1] and all(lora.is_adapter_name(n) for n, _ in payload[:-1])
    full = sum(t.numel() for t in read_hf_state_dict(model_dir).values())
    assert sum(t.numel() for _, t in payload) < full / 5
    logp = engine.logprobs([t.tokens for t in _batch()])
    ckpt = engine.save_checkpoint()
    state = torch.load(next(ckpt.glob("*.pt")), weights_only=False)["model"]
    assert set(state) == set(k for k in engine.model.state_dict() if ".lora." in k)
    resumed = TrainerEngine(cfg)
    assert resumed.step_count == 4
    assert resumed.logprobs([t.tokens for t in _batch()]) == logp


def test_export_writes_a_peft_adapter_and_a_merged_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model_dir=model_dir, lora=SUBSET)
    engine = TrainerEngine(cfg, resume=False)
    _randomise_b(engine.model)
    out = engine.adapter.write_peft(tmp_path / "adapter", model_dir)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(SUBSET.target_modules)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    spec = engine.spec
    # PEFT's convention: base_model.model.<module>.lora_A.weight [r, in], lora_B.weight [out, r].
    for i in range(spec.num_layers):
        for mod, (out_f, in_f) in {"self_attn.q_proj": (spec.num_heads * spec.head_dim, spec.hidden_size),
                                   "self_attn.v_proj": (spec.num_kv_heads * spec.head_dim, spec.hidden_size),
                                   "mlp.up_proj": (spec.intermediate_size, spec.hidden_size),
                                   "mlp.down_proj": (spec.hidden_size, spec.intermediate_size)}.items():
            stem = f"base_model.model.model.layers.{i}.{mod}"
            assert tensors.pop(f"{stem}.lora_A.weight").shape == (4, in_f)
            assert tensors.pop(f"{stem}.lora_B.weight").shape == (out_f, 4)
    assert not tensors
    merged_dir = engine.export_hf(tmp_path / "merged")
    hf = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    tokens = _tokens(spec)
    with torch.no_grad():
        assert (hf(tokens).logits - forward_logits(engine.model, tokens)).abs().max().item() <= 1e-5


def test_peft_loads_the_exported_adapter(model_dir: Path, tmp_path: Path) -> None:
    import peft  # a test dependency (deploy/requirements.txt)
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, lora=SUBSET), resume=False)
    _randomise_b(engine.model, seed=7)
    out = engine.adapter.write_peft(tmp_path / "adapter", model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, str(out))
    tokens = _tokens(engine.spec)
    with torch.no_grad():
        assert (model(tokens).logits - forward_logits(engine.model, tokens)).abs().max().item() <= 1e-5


def test_a_lora_stage_after_full_training_puts_the_adapter_on_the_trained_weights(
        model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model_dir=model_dir, micro_batch_size=2, checkpoint_dir=tmp_path / "ck",
                        optimizer=OptimizerConfig(lr=1e-2), loss=MaskedLoss())
    engine = TrainerEngine(cfg)
    engine.sft_step(_batch())  # every weight trains
    assert not any(lora.is_adapter_name(n) for n, _ in engine.named_hf_tensors())
    trained = {n: t.clone() for n, t in engine.named_hf_tensors()}
    engine.config = cfg.model_copy(update={"lora": SUBSET})  # what the stage runner does
    m = engine.sft_step(_batch())
    # The full-weight step's gradients are gone: the norm is the adapter's alone.
    grads = [p.grad for p in lora.adapter_parameters(engine.model).values()]
    assert all(p.grad is None for n, p in engine.model.named_parameters() if ".lora." not in n)
    assert m.grad_norm == pytest.approx(float(sum(g.double().pow(2).sum() for g in grads)) ** 0.5, rel=1e-6)
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in lora.adapter_parameters(engine.model).values()}
    payload = dict(engine.named_hf_tensors())
    assert lora.same_digest(float(payload[lora.BASE_DIGEST][0]), lora.weights_digest(trained.items(), torch.float32))
    ckpt = engine.save_checkpoint()  # the trained base is not in model_dir: the checkpoint keeps it
    resumed = TrainerEngine(cfg)  # a first stage's config: no LoRA, yet the checkpoint's adapter
    assert resumed.adapter.base == "trained" and resumed.last_checkpoint == ckpt
    assert resumed.logprobs([t.tokens for t in _batch()]) == engine.logprobs([t.tokens for t in _batch()])
    assert float(dict(resumed.named_hf_tensors())[lora.BASE_DIGEST][0]) == float(payload[lora.BASE_DIGEST][0])


async def test_rollout_merges_each_version_into_its_base_and_refuses_another_base(model_dir: Path) -> None:
    from kiln.services.rollout.engine import EngineSettings, start_engine

    engine = await start_engine("torch", EngineSettings(model=str(model_dir), dtype="float32",
                                                        lora_scaling=SUBSET.scaling))
    trainer = TrainerEngine(TrainerConfig(model_dir=model_dir, lora=SUBSET, micro_batch_size=2,
                                          optimizer=OptimizerConfig(lr=1e-2)), resume=False)
    seqs = [t.tokens for t in _batch()]
    try:
        for version in (1, 2):  # two versions: the second must not carry the first's delta
            trainer.sft_step(_batch())
            await engine.apply_weights(version, list(trainer.named_hf_tensors()))
            ours, theirs = trainer.logprobs(seqs), await engine.score(seqs)
            assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)) <= 1e-5
        # The same adapter named as trained on other base weights: refused, version 2 kept.
        other = [(n, t + 1.0 if n == lora.BASE_DIGEST else t) for n, t in trainer.named_hf_tensors()]
        with pytest.raises(ValueError, match="other base weights"):
            await engine.apply_weights(3, other)
        assert engine.policy_version == 2
        with pytest.raises(ValueError, match="without kiln.lora.base_digest"):
            await engine.apply_weights(3, [(n, t) for n, t in trainer.named_hf_tensors() if n != lora.BASE_DIGEST])
        # A full version becomes the base later adapters merge into.
        full = [(n, t + 0.01) for n, t in read_hf_state_dict(model_dir).items()]
        await engine.apply_weights(4, full)
        with pytest.raises(ValueError, match="other base weights"):
            await engine.apply_weights(5, list(trainer.named_hf_tensors()))
    finally:
        await engine.close()


def test_kiln_export_of_a_lora_run(model_dir: Path, tmp_path: Path) -> None:
    import yaml

    from kiln.cli.export import export_run

    run = tmp_path / "run"
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, lora=SUBSET, micro_batch_size=2,
                                         checkpoint_dir=run / "trainer" / "checkpoints",
                                         optimizer=OptimizerConfig(lr=1e-2)), resume=False)
    engine.sft_step(_batch())
    engine.save_checkpoint()
    (run / "job.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "lora"},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32",
                           "lora": {"rank": 4, "alpha": 8.0, "targetModules": SUBSET.target_modules}},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}]}}))
    adapter = export_run(run, tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir() if p.name.startswith("adapter")) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
    exported = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in lora.adapter_hf_tensors(engine.model, engine.spec))
    merged = export_run(run, tmp_path / "merged", merge=True)
    hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    tokens = _tokens(engine.spec)
    with torch.no_grad():
        assert (hf(tokens).logits - forward_logits(engine.model, tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("lora_spec, error", [
    ({"targetModules": ["qkv_proj"]}, "targetModules: \\['qkv_proj'\\] are not among"),
    ({"stages": ["nope"]}, "model.lora.stages: \\['nope'\\] are not stages"),
    ({"stages": ["sft"]}, "the LoRA stages must be the last ones"),
    ({"rank": 0}, "rank"),
])
def test_lora_spec_errors_name_the_field(lora_spec: dict, error: str) -> None:
    from kiln.api.spec import RLJob

    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
           "spec": {"model": {"path": "m", "lora": lora_spec},
                    "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                    "stages": [{"name": "sft", "type": "sft", "tasks": ["t"]},
                               {"name": "rl", "type": "rl", "tasks": ["t"]}]}}
    with pytest.raises(ValueError, match=error):
        RLJob.model_validate(job)
    job["spec"]["model"]["lora"] = {"stages": ["rl"]}
    assert RLJob.model_validate(job).spec.model.lora.trains("rl")


def test_summary_reports_the_bytes_a_version_carried(model_dir: Path, tmp_path: Path) -> None:
    from kiln.api.spec import RLJob
    from kiln.cli.local.report import sync_sizes
    from kiln.services.trainer.publisher import record_version_bytes

    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32", "lora": {"rank": 4}},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["t"]}]}})
    assert sync_sizes(job, tmp_path) == {}  # nothing published yet
    (tmp_path / "trainer").mkdir()
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, lora=LoraSpec(rank=4)), resume=False)
    payload = list(engine.named_hf_tensors())
    record_version_bytes(tmp_path / "trainer" / "weight_sync.json", 1,
                         sum(t.numel() * t.element_size() for _, t in payload))
    sizes = sync_sizes(job, tmp_path)
    assert sizes["model_bytes"] == sum(t.numel() * 4 for t in read_hf_state_dict(model_dir).values())
    assert 0 < sizes["weight_sync_bytes_per_version"] * 10 <= sizes["model_bytes"]


def test_a_bfloat16_trainer_and_its_rollout_agree_on_the_base_digest(model_dir: Path) -> None:
    # The trainer keeps norms in float32 in a bfloat16 model; rollout casts what it reads.
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, params_dtype="bfloat16", lora=SUBSET), resume=False)
    rollout_side = lora.weights_digest(read_hf_state_dict(model_dir).items(), torch.bfloat16)
    assert lora.same_digest(engine.adapter.digest, rollout_side)
