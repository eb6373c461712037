"""What models Kiln can train and serve, checked from a checkpoint's files before anything starts.

`model_problems(model_dir, ...)` reads config.json (and the tokenizer's vocabulary) and returns
one line per reason the trainer or the rollout engine would refuse the model: an architecture
the Megatron model code does not build, a head size vLLM's attention backend has no kernel for
on this device, a dtype the trainer does not train in, a vocabulary smaller than the
tokenizer's, shapes that do not split over the tensor-parallel ranks. `kiln run` and `kiln
consistency` call it and stop with the first line, instead of failing inside an engine.

Torch-free: it only reads JSON files, so the launcher can check before importing an engine.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

#: Hugging Face architectures the Megatron model code builds (`megatron_model.ArchSpec`).
SUPPORTED_ARCHS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
#: Head sizes vLLM 0.32's CPU attention backend has kernels for (its
#: `CPUAttentionBackend.get_supported_head_sizes()`; a test keeps the two equal).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
TRAINER_DTYPES = ("float32", "bfloat16")


def has_cuda() -> bool:
    """Whether this host has an NVIDIA GPU (without importing torch)."""
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def _tokenizer_size(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    ids = set(data.get("model", {}).get("vocab", {}).values())
    ids |= {t["id"] for t in data.get("added_tokens", [])}
    return max(ids) + 1 if ids else None


def model_problems(model_dir: Path, *, engine: str = "vllm", dtype: str = "float32",
                   tensor_parallel: int = 1, cuda: bool | None = None) -> list[str]:
    """Why the trainer or a rollout `engine` ("vllm", "megatron", "torch") cannot run the
    checkpoint in `model_dir` in `dtype`; empty when they can."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        return [f"{model_dir} holds no config.json (not a Hugging Face checkpoint)"]
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        return [f"{config_path} is not JSON: {exc}"]
    problems = []
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        problems.append(f"architecture {', '.join(archs) or '(none)'} is not supported; the "
                        f"trainer builds {' and '.join(sorted(SUPPORTED_ARCHS))}")
    if dtype not in TRAINER_DTYPES:
        problems.append(f"dtype {dtype} is not supported by the trainer; use "
                        f"{' or '.join(TRAINER_DTYPES)}")
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    cuda = has_cuda() if cuda is None else cuda
    dsa = config.get("kiln_dsa") is not None
    if engine == "vllm" and not cuda and not dsa and head_dim not in VLLM_CPU_HEAD_SIZES:
        problems.append(f"head size {head_dim} (hidden_size {config.get('hidden_size')} / "
                        f"num_attention_heads {heads}) has no kernel in vLLM's CPU attention "
                        f"(supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use such a "
                        "model, or rollout engine megatron")
    vocab = config.get("vocab_size")
    tokens = _tokenizer_size(model_dir)
    if vocab is not None and tokens is not None and tokens > vocab:
        problems.append(f"the tokenizer has {tokens} tokens but the model's vocab_size is {vocab}; "
                        "ids past it cannot be embedded")
    for field in ("num_key_value_heads", "vocab_size", "intermediate_size"):
        value = config.get(field) or (heads if field == "num_key_value_heads" else None)
        if value and tensor_parallel > 1 and value % tensor_parallel:
            problems.append(f"{field} {value} does not split over tensorParallel {tensor_parallel}")
    return problems
