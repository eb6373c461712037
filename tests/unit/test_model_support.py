"""The model checks made before any service starts: one line per reason a checkpoint cannot
be trained or served, and no traceback reaching the user."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.models.support import VLLM_CPU_HEAD_SIZES, model_problems


def _model(tmp_path: Path, **config) -> Path:
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512}
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**base, **config}))
    return d


def test_a_supported_model_has_no_problems(tmp_path):
    assert model_problems(_model(tmp_path), cuda=False) == []


@pytest.mark.parametrize(("config", "kwargs", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, {}, "architecture GPT2LMHeadModel is not supported"),
    ({"hidden_size": 64}, {}, "head size 16 (hidden_size 64 / num_attention_heads 4) has no kernel"),
    ({"head_dim": 48}, {}, "head size 48"),
    ({}, {"dtype": "float16"}, "dtype float16 is not supported by the trainer"),
    ({"num_key_value_heads": 3, "num_attention_heads": 3, "hidden_size": 96}, {"tensor_parallel": 2},
     "num_key_value_heads 3 does not split over tensorParallel 2"),
])
def test_each_problem_is_named(tmp_path, config, kwargs, message):
    problems = model_problems(_model(tmp_path, **config), cuda=False, **kwargs)
    assert len(problems) == 1 and message in problems[0], problems


def test_head_size_is_only_a_problem_for_vllm_on_a_cpu(tmp_path):
    d = _model(tmp_path, hidden_size=64)
    assert model_problems(d, engine="megatron", cuda=False) == []
    assert model_problems(d, engine="vllm", cuda=True) == []


def test_vocabulary_smaller_than_the_tokenizer(tmp_path):
    d = _model(tmp_path, vocab_size=4)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                  "added_tokens": [{"id": 7}]}))
    (problem,) = model_problems(d, cuda=False)
    assert "the tokenizer has 8 tokens but the model's vocab_size is 4" in problem


def test_the_head_size_table_is_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_consistency_refuses_an_unsupported_model_in_one_line(tmp_path):
    d = _model(tmp_path, hidden_size=64)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "consistency", "--model", str(d)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "head size 16" in lines[0] and lines[0].startswith("kiln consistency:")


def test_kiln_run_refuses_an_unsupported_model_before_starting_anything(tmp_path):
    d = _model(tmp_path, architectures=["MistralForCausalLM"])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "bad-model"},
        "spec": {"model": {"path": str(d), "dtype": "float32"},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}]}}))
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(job), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"kiln run: spec.model.path: {d}: architecture MistralForCausalLM "
                                   "is not supported; the trainer builds LlamaForCausalLM and "
                                   "Qwen2ForCausalLM")
    assert not (tmp_path / "run" / "logs").exists()  # no service was started
