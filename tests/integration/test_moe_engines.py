"""MoE rollout engines record routing that the trainer replays: the `megatron` engine (the
trainer's own code) and the `torch` engine (transformers with a KV cache, an independent
implementation), a weight update through both, and `kiln consistency` on a Qwen2-MoE checkpoint
end to end (its output is the interface other checks read)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

from helpers.moe import TINY_MOE

PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 300, 12], [1, 99] * 5]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "m", seed=7, **TINY_MOE)


def _trainer(model_dir: Path, tmp: Path) -> TrainerEngine:
    return TrainerEngine(TrainerConfig(
        model_dir=model_dir, micro_batch_size=4, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
        checkpoint_dir=tmp / "ckpt"), resume=False)


@pytest.mark.parametrize("kind", ["megatron", "torch"])
async def test_engines_record_routing_that_the_trainer_replays(moe_dir: Path, tmp_path: Path, kind: str) -> None:
    engine = await start_engine(kind, EngineSettings(model=str(moe_dir), dtype="float32", seed=0,
                                                    record_routing=True))
    trainer = _trainer(moe_dir, tmp_path)
    try:
        for version in (0, 1):
            gens = [await engine.generate(p, SamplingOptions(max_tokens=12, seed=i))
                    for i, p in enumerate(PROMPTS)]
            seqs = [p + g.token_ids for p, g in zip(PROMPTS, gens)]
            for s, g in zip(seqs, gens):
                r = g.routed_experts
                # Every position that predicted a sampled token, from the prompt's first.
                assert (r.start, r.rows, r.layers, r.topk, r.num_experts) == (0, len(s) - 1, 2, 2, 8)
                assert len(r.packed) == (len(s) - 1) * 2 * 2 * 3 // 8 + ((len(s) - 1) * 12 % 8 > 0)
                assert g.versions == [version] * len(g.token_ids)
                assert r.versions == ((0, version),)  # every row routed under this version
            replayed, flips = trainer.logprobs_routed(seqs, [g.routed_experts for g in gens], replay=True)
            # In float32 the two sides agree on every expert of this model, and on log-probs to
            # rounding.
            assert flips.flips == 0 and flips.compared == sum(2 * (len(s) - 1) for s in seqs)
            for p, g, lp in zip(PROMPTS, gens, replayed):
                assert max(abs(a - b) for a, b in zip(g.logprobs, lp[len(p):])) < 1e-5
            if version == 0:
                trajs = [Trajectory(id=f"t{i}", task_id="x", group_id="g", tokens=s,
                                    loss_mask=[0] * len(p) + [1] * len(g.token_ids),
                                    logp_infer=[0.0] * len(p) + g.logprobs,
                                    version_spans=[VersionSpan(len(p), len(s), 0)], prompt_len=len(p),
                                    routed_experts=g.routed_experts)
                         for i, (p, g, s) in enumerate(zip(PROMPTS, gens, seqs))]
                before = trainer.logprobs(seqs)
                m = trainer.sft_step(trajs)
                assert m.routing_flip_frac == 0.0
                assert trainer.logprobs(seqs) != before
                # Checkpoint names, per expert: the torch engine fuses them into its layout.
                await engine.apply_weights(trainer.new_version(), trainer.named_hf_tensors())
    finally:
        await engine.close()


@pytest.mark.slow
def test_kiln_consistency_on_a_moe_checkpoint(moe_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "consistency", "--model", str(moe_dir),
                           "--samples", "2", "--max-tokens", "12"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "engine megatron, model MoE, dtype float32, routing replay on" in out
    assert len(re.findall(r"^\s+[01]\s+\d+\s+\S+\s+\S+\s+OK$", out, re.M)) == 2, out
    rate = re.search(r"^routing-flip rate (\S+)%: (\d+) of (\d+) \(token, layer\) pairs", out, re.M)
    assert rate and int(rate.group(3)) > 0, out
