"""A tiny RL job per model family, as `kiln run` runs it: `spec.model.init.arch` makes the
checkpoint, the trainer builds the family, the megatron rollout engine serves it (the MoE
families' and DeepSeek's CPU engine; for Qwen3 the quickest to start, its vLLM path being
checked by tests/integration/test_family_consistency.py), and two RL steps train with weight sync
(and routing replay for the MoE families; Qwen3-MoE's experts split over two trainer replicas).
Qwen2, Llama and Qwen2-MoE run in the other end-to-end tests."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from helpers.kiln_run import kiln_run, read_records

pytestmark = pytest.mark.slow

# `_job(tmp, "deepseek_v32")` makes the same job for DeepSeek-V3.2's shape (DeepSeek-V3's model
# with Kiln's lightning indexer choosing 16 keys per query): it passes, but takes 210 s on an
# idle 2-core machine (the sparse attention on the CPU), too long to run on every change; its
# pieces are tested on the fast path (tests/unit/test_deepseek_v32.py).
FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")


def _job(tmp: Path, arch: str) -> Path:
    moe = arch != "qwen3"
    init = dict(arch=arch, hiddenSize=64, numLayers=2, numHeads=2, numKvHeads=2 if arch.startswith("deepseek") else 1,
                intermediateSize=128, vocabSize=320, maxPositionEmbeddings=256)
    if moe:
        init.update(numExperts=8, numExpertsPerTok=2, moeIntermediateSize=32)
    if arch == "deepseek_v32":
        init.update(indexTopk=16)
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": f"family-{arch.replace('_', '-')}"},
        "spec": {
            "model": {"path": str(tmp / "model"), "dtype": "float32", "init": init,
                      **({"routingReplay": "replay"} if moe else {})},
            "tasks": [{"name": "chain", "env": "chain", "generate": {"count": 32, "seed": 1}}],
            "stages": [{"name": "rl", "type": "rl", "tasks": ["chain"], "maxSteps": 2, "learningRate": 1e-4,
                        "batchSize": 8, "microBatchSize": 8,
                        "rl": {"groupSize": 4, "tau": 1, "syncInterval": 1}}],
            "rollout": {"engine": "megatron", "toolCallFormat": "tags", "maxTurns": 3, "maxConcurrentEpisodes": 8,
                        "sampling": {"temperature": 1.0, "maxTokensPerTurn": 12, "maxTotalTokens": 96}},
            "sandbox": {"backend": "bubblewrap", "timeoutSeconds": 5, "memory": "128Mi", "maxConcurrent": 8},
            # Qwen3-MoE's job splits its experts over two trainer replicas (expert parallelism):
            # weight sync then gathers them from both, and the final checkpoint holds both halves.
            "trainer": {"checkpointInterval": 100,
                        **({"dataParallel": 2, "expertParallel": 2} if arch == "qwen3_moe" else {})},
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_tiny_job_trains_two_rl_steps(tmp_path: Path, arch: str) -> None:
    run = tmp_path / "run"
    kiln_run(_job(tmp_path, arch), run, timeout=600)
    steps = [r["trainer"] for r in read_records(run)
             if r.get("event") == "progress" and r.get("stage") == "rl" and "loss" in r.get("trainer", {})]
    assert max(t["step"] for t in steps) >= 2, steps
    for t in steps:
        assert math.isfinite(t["loss"]) and math.isfinite(t["grad_norm"])
        # Rollout (the megatron engine) and trainer score the sampled tokens alike, after the
        # weight sync too (the second step's trajectories come from version 1).
        assert t["mismatch_abs"] < 1e-4, t
    if arch == "qwen3_moe":
        import torch

        ckpts = sorted(run.rglob("checkpoints/step_*"))
        assert ckpts, "no checkpoint written"
        state = torch.load(ckpts[-1] / "rank_00.pt", weights_only=True)
        assert len(state["ep_ranks"]) == 2
