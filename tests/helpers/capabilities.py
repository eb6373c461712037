"""A job and a checkpoint config for each capability the runtime refuses, shared by the
validation tests (`kiln validate`) and the runtime refusal tests (the services themselves)."""
from __future__ import annotations

import json
from pathlib import Path


def checkpoint_config(tmp_path: Path, **config) -> Path:
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512}
    d = tmp_path / "m"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**base, **config}))
    return d


MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "n_routed_experts": 8,
               "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
               "first_k_dense_replace": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": None, "head_dim": 64}


# The tool-call part of GLM-4.5's chat template (its hub tokenizer's), reduced.
GLM45_TOOLS_TEMPLATE = ("{%- if tools -%}{%- for tool in tools -%}{{ tool | tojson }}{%- endfor -%}{%- endif -%}"
                        "{%- for m in messages -%}{%- for tc in m.tool_calls or [] -%}<tool_call>{{ tc.name }}"
                        "{%- for k, v in tc.arguments.items() -%}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}"
                        "</arg_value>{%- endfor -%}</tool_call>{%- endfor -%}{%- endfor -%}")


# One job per capability that the runtime refuses: (spec changes, model config changes).
VIOLATIONS: dict[str, tuple[dict, dict]] = {
    "pipeline-parallel": ({"trainer": {"pipelineParallel": 2}}, {}),
    "trainer-dtype": ({"model": {"dtype": "float16"}}, {}),
    "trainer-gpus": ({"trainer": {"tensorParallel": 2, "resources": {"gpu": 1}}}, {}),
    "rollout-gpus": ({"rollout": {"resources": {"gpu": 2}}}, {}),
    "architecture": ({}, {"architectures": ["GPT2LMHeadModel"]}),
    "vllm-cpu-head-size": ({}, {"hidden_size": 64}),
    "tokenizer-vocab": ({}, {"vocab_size": 4}),
    "tensor-parallel-split": ({"trainer": {"tensorParallel": 2}},
                              {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192}),
    "moe-tensor-parallel": ({"trainer": {"tensorParallel": 2}}, MOE),
    "expert-parallel": ({"trainer": {"dataParallel": 3, "expertParallel": 3}}, MOE),
    "expert-parallel-layout": ({"trainer": {"dataParallel": 3, "expertParallel": 2}}, MOE),
    "chat-tool-format": ({"rollout": {"toolCallFormat": "hermes"}}, {}),
    "vllm-cpu-mla": ({"rollout": {"engine": "vllm"}}, DEEPSEEK_V3),
}


def violating_job(tmp_path: Path, name: str) -> tuple[dict, Path]:
    """An RLJob (as a mapping) and its checkpoint, failing capability `name` alone."""
    spec_changes, config_changes = VIOLATIONS[name]
    d = checkpoint_config(tmp_path, **config_changes)
    if name == "chat-tool-format":
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": GLM45_TOOLS_TEMPLATE}))
    if name == "tokenizer-vocab":
        (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                      "added_tokens": [{"id": 7}]}))
    spec = {"model": {"path": str(d), "dtype": "float32"},
            "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
            "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}]}
    for section, values in spec_changes.items():
        for key, value in values.items():
            spec.setdefault(section, {})[key] = value
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "bad"},
            "spec": spec}, d
