"""`kiln export`: a trainer checkpoint out as a Hugging Face checkpoint that transformers and
vLLM load and that scores tokens as the trainer does (within 1e-5 in float32)."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

pytestmark = pytest.mark.slow


def _trajs(n: int) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        tokens = [rng.randrange(4, 300) for _ in range(12)]
        out.append(Trajectory(id=f"t{i}", task_id="x", group_id="", tokens=tokens,
                              loss_mask=[0, 0] + [1] * 10, logp_infer=[0.0] * 12,
                              version_spans=[VersionSpan(2, 12, 0)]))
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `kiln run` leaves it: job.yaml and trainer checkpoints (steps 2, 3)."""
    root = tmp_path_factory.mktemp("export")
    model = make_tiny_checkpoint(root / "model", hidden_size=64, num_heads=2, num_kv_heads=1,
                                 intermediate_size=128)
    run = root / "run"
    ckpts = run / "trainer" / "checkpoints"
    engine = TrainerEngine(TrainerConfig(model_dir=model, checkpoint_dir=ckpts, micro_batch_size=4,
                                         optimizer=OptimizerConfig(lr=3e-3)))
    for step in range(3):
        engine.sft_step(_trajs(4))
        if step >= 1:
            engine.save_checkpoint()
    (run / "job.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "exp"},
        "spec": {"model": {"path": str(model), "dtype": "float32"},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}]}}))
    sequences = [t.tokens for t in _trajs(3)]
    return run, engine.logprobs(sequences), sequences


def _export(run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "export", str(run), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300)


def test_export_loads_in_transformers_and_matches_the_trainer(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trainer_logprobs, sequences = run_dir
    proc = _export(run, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "hf"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "chat_template.jinja"):
        assert (out / name).exists(), name
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        for seq, want in zip(sequences, trainer_logprobs):
            logits = hf(torch.tensor([seq])).logits[0, :-1]
            got = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            assert (got - torch.tensor(want[1:])).abs().max().item() <= 1e-5


def test_export_of_an_earlier_step_and_clear_errors(run_dir, tmp_path):
    run, _, _ = run_dir
    assert _export(run, tmp_path / "s2", "--step", "2").returncode == 0
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "s2" / "model.safetensors"))
    assert _export(run, tmp_path / "s3").returncode == 0
    b = load_file(str(tmp_path / "s3" / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # step 3 trained past step 2
    bad = _export(run, tmp_path / "x", "--step", "9")
    assert bad.returncode == 1 and "--step 9: no checkpoint of that step" in bad.stderr
    assert "(steps: 2, 3)" in bad.stderr and "Traceback" not in bad.stderr
    none = _export(tmp_path, tmp_path / "y")
    assert none.returncode == 1 and "not a run directory" in none.stderr


def test_export_loads_in_vllm_and_matches_the_trainer(run_dir, tmp_path):
    from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine

    run, _, _ = run_dir
    assert _export(run, tmp_path / "hf").returncode == 0
    engine_dir = tmp_path / "hf"

    async def sample():
        engine = await start_engine("vllm", EngineSettings(model=str(engine_dir), dtype="float32",
                                                           kv_cache_bytes=64 << 20))
        try:
            return await engine.generate([5, 6, 7, 8], SamplingOptions(max_tokens=12, seed=1))
        finally:
            await engine.close()

    gen = asyncio.run(sample())
    trainer = TrainerEngine(TrainerConfig(model_dir=engine_dir))
    want = trainer.logprobs([[5, 6, 7, 8] + gen.token_ids])[0][4:]
    assert max(abs(a - b) for a, b in zip(gen.logprobs, want)) <= 1e-5
