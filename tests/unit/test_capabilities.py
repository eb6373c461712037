"""The capability table: every entry is refused by `kiln validate`, by the operator and by the
trainer's own configuration the same way (the services' start-up refusals as processes are in
tests/integration/test_capability_refusals.py); the model checks give one line per reason a
checkpoint cannot be trained or served, and no traceback reaches the user."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import yaml

from kiln.api.capabilities import (CAPABILITIES, MODEL_CAPABILITIES, SPEC_CAPABILITIES,
                                   SUPPORTED_ARCHS, VLLM_CPU_HEAD_SIZES, VLLM_CPU_MLA_LATENT, job_model_refusals,
                                   model_problems)
from kiln.api.validate import validate_text
from kiln.operator.reconcile import parse_spec
from kiln.services.trainer.config import config_from_job

from helpers.capabilities import VIOLATIONS, checkpoint_config, violating_job


def test_a_supported_model_has_no_problems(tmp_path):
    assert model_problems(checkpoint_config(tmp_path), cuda=False) == []


@pytest.mark.parametrize(("config", "kwargs", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, {}, "architecture GPT2LMHeadModel is not supported"),
    ({"hidden_size": 64}, {}, "head size 16 (hidden_size 64 / num_attention_heads 4) has no kernel"),
    ({"head_dim": 48}, {}, "head size 48"),
    ({}, {"dtype": "float16"}, "dtype float16 is not supported by the trainer"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 192}, {"tensor_parallel": 2},
     "num_key_value_heads 3 does not split over tensorParallel 2"),
])
def test_each_problem_is_named(tmp_path, config, kwargs, message):
    problems = model_problems(checkpoint_config(tmp_path, **config), cuda=False, **kwargs)
    assert len(problems) == 1 and message in problems[0], problems


def test_head_size_is_only_a_problem_for_vllm_on_a_cpu(tmp_path):
    d = checkpoint_config(tmp_path, hidden_size=64)
    assert model_problems(d, engine="megatron", cuda=False) == []
    assert model_problems(d, engine="vllm", cuda=True) == []


def test_vocabulary_smaller_than_the_tokenizer(tmp_path):
    d = checkpoint_config(tmp_path, vocab_size=4)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                  "added_tokens": [{"id": 7}]}))
    (problem,) = model_problems(d, cuda=False)
    assert "the tokenizer has 8 tokens but the model's vocab_size is 4" in problem


def test_the_head_size_table_is_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_the_mla_latent_is_vllms():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert CPUMLABackend.get_supported_head_sizes() == [VLLM_CPU_MLA_LATENT]


def test_consistency_refuses_an_unsupported_model_in_one_line(tmp_path):
    d = checkpoint_config(tmp_path, hidden_size=64)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "consistency", "--model", str(d)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "head size 16" in lines[0] and lines[0].startswith("kiln consistency:")


def test_kiln_run_refuses_an_unsupported_model_before_starting_anything(tmp_path):
    d = checkpoint_config(tmp_path, architectures=["MistralForCausalLM"])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "bad-model"},
        "spec": {"model": {"path": str(d), "dtype": "float32"},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}]}}))
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(job), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"kiln run: invalid job:\n{job}:1: spec.model.path: {d}: architecture "
                                   "MistralForCausalLM is not supported; the trainer builds "
                                   + ", ".join(sorted(SUPPORTED_ARCHS)))
    assert not (tmp_path / "run" / "logs").exists()  # no service was started


def test_every_capability_has_a_violation_here():
    assert set(VIOLATIONS) == {c.name for c in CAPABILITIES}
    assert len({c.name for c in CAPABILITIES}) == len(CAPABILITIES)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: c.name)
def test_kiln_validate_refuses_what_the_runtime_refuses(tmp_path, cap):
    doc, _ = violating_job(tmp_path, cap.name)
    text = yaml.safe_dump(doc, sort_keys=False)
    jobs, problems = validate_text(text, file="job.yaml", local=True)
    assert not jobs
    assert [p.path for p in problems] == [cap.path], problems
    assert problems[0].line is not None  # points at the field in the file
    # Without the violation the same job is valid: the check refuses that field alone.
    good = violating_job(tmp_path / "ok", "pipeline-parallel")[0]
    good["spec"]["trainer"] = {}
    assert validate_text(yaml.safe_dump(good), file="ok.yaml", local=True)[1] == []


@pytest.mark.parametrize("cap", SPEC_CAPABILITIES, ids=lambda c: c.name)
def test_the_operator_and_the_trainer_refuse_spec_capabilities(tmp_path, cap):
    doc, _ = violating_job(tmp_path, cap.name)
    spec, problems = parse_spec("bad", doc["spec"])
    assert spec is None and len(problems) == 1 and problems[0].startswith(cap.path + ": "), problems
    # The trainer refuses a job built in-process (the schema alone accepts it) the same way.
    from kiln.api.spec import RLJob

    job = RLJob.model_validate(doc)
    if "trainer" in cap.enforced_by:
        with pytest.raises(ValueError, match=re.escape(problems[0])):
            config_from_job(job, run_dir=tmp_path)


@pytest.mark.parametrize("cap", MODEL_CAPABILITIES, ids=lambda c: c.name)
def test_model_capabilities_are_refused_per_component(tmp_path, cap):
    doc, d = violating_job(tmp_path, cap.name)
    from kiln.api.spec import RLJobSpec

    spec = RLJobSpec.model_validate(doc["spec"])
    for component in ("trainer", "rollout"):
        refused = [r.capability.name for r in job_model_refusals(spec, component, cuda=False)]
        assert refused == ([cap.name] if component in cap.enforced_by else []), component
    # The operator cannot read a model: it accepts the job, whose pods then refuse it.
    assert parse_spec("bad", doc["spec"])[1] == []


def test_the_cluster_example_validates_and_its_model_checks_pass_on_a_gpu(tmp_path):
    from kiln.api.validate import validate_file

    example = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "cluster-rljob.yaml"
    (job,), problems = validate_file(example)
    assert problems == []
    # A checkpoint shaped like the one it names (Qwen2-7B-Instruct's config.json).
    qwen = checkpoint_config(tmp_path, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064)
    assert job_model_refusals(job.spec, model_dir=qwen, cuda=True) == []
