"""`kiln consistency` on the Qwen3 and GLM-4.5 families: the rollout engine and the trainer agree on
log-probs before and after a weight sync. Qwen3 through vLLM's CPU engine (slow: it starts vLLM),
Qwen3-MoE through the torch engine (transformers' own MoE code, an implementation independent of
the trainer's) with routing recorded and replayed, and no routing flips in float32; GLM-4.5 MoE
(sigmoid routing with a selection bias, expert groups, a dense first layer, half-rotary RoPE)
through its default engine and the torch engine; DeepSeek-V3 (multi-latent attention with vLLM's
CPU latent of 576, the same routing) through the torch engine, and refused on vLLM on a CPU with
the measured reason."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.models.tiny import make_tiny_checkpoint

# Head size 32: vLLM's CPU attention has kernels for it.
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=1)
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", re.M)


def _consistency(model: Path, engine: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "consistency", "--model", str(model),
                           "--engine", engine, "--samples", "3", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = ROW.findall(proc.stdout)
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    for _, n, mx, mean, verdict in rows:
        assert int(n) > 0 and verdict == "OK" and float(mx) < 1e-4 and float(mean) <= float(mx)
    assert float(re.search(r"by (\S+) on average", proc.stdout).group(1)) > 1e-3
    return proc.stdout


@pytest.mark.slow
def test_vllm_serves_qwen3_as_the_trainer_computes_it(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", **TINY)
    assert "engine vllm, model dense, dtype float32" in _consistency(model, "vllm")


def test_qwen3_moe_routing_recorded_by_transformers_replays_in_the_trainer(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "qwen3-moe", arch="qwen3_moe", num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, **TINY)
    out = _consistency(model, "torch")
    assert "engine torch, model MoE, dtype float32, routing replay on" in out
    rate = re.search(r"^routing-flip rate (\S+)%: (\d+) of (\d+) \(token, layer\) pairs", out, re.M)
    assert rate and rate.group(2) == "0" and int(rate.group(3)) > 0, out


GLM = dict(arch="glm4_moe", num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4,
           topk_group=2, first_k_dense_replace=1, **{**TINY, "num_layers": 3})


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_glm4_moe_rollout_and_trainer_agree(tmp_path: Path, engine: str) -> None:
    model = make_tiny_checkpoint(tmp_path / "glm4-moe", **GLM)
    out = _consistency(model, engine)
    assert f"engine {'megatron' if engine == 'auto' else engine}, model MoE, dtype float32, routing replay on" in out
    rate = re.search(r"^routing-flip rate (\S+)%: (\d+) of (\d+) \(token, layer\) pairs", out, re.M)
    assert rate and rate.group(2) == "0" and int(rate.group(3)) > 0, out


DEEPSEEK_V3 = dict(GLM, arch="deepseek_v3", hidden_size=128, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=None)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v3") / "deepseek-v3", **DEEPSEEK_V3)


@pytest.mark.slow
def test_deepseek_v3_torch_rollout_and_trainer_agree(deepseek_v3: Path) -> None:
    out = _consistency(deepseek_v3, "torch")
    assert "engine torch, model MoE, dtype float32, routing replay on" in out
    rate = re.search(r"^routing-flip rate (\S+)%: (\d+) of (\d+) \(token, layer\) pairs", out, re.M)
    assert rate and rate.group(2) == "0" and int(rate.group(3)) > 0, out


def test_deepseek_v3_on_vllm_on_a_cpu_is_refused_with_the_measured_reason(deepseek_v3: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "consistency", "--model", str(deepseek_v3),
                           "--engine", "vllm"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "multi-latent attention on vLLM's CPU" in proc.stderr and "max |log-prob diff|" in proc.stderr
