"""What Kiln can run: one table of capabilities, checked the same way by everything that acts on a job.

Each `Capability` names the RLJob field it governs, what is supported, and a check that returns
why a job is refused (None when it is not). Two kinds:

- spec capabilities need the spec alone. `validate_document` applies them, so `kiln validate`,
  `kiln run`, the operator (before it creates any child) and every service (when it loads its
  job file) refuse exactly the same jobs, with the same message naming the field;
- model capabilities need the checkpoint's `config.json` and tokenizer. `model_problems` applies
  them: `kiln validate` and `kiln run` where the model is on this machine, the trainer and the
  rollout service when they start (the operator cannot read a model on a PVC; the pods then
  exit with the message, which the job's status shows).

Torch-free: model checks read JSON files only, so they run before any engine is imported.
A test enumerates the table and shows each refusal made at validation and at start-up.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.api.chat_templates import chat_template, foreign_tool_format
# SUPPORTED_ARCHS (Hugging Face architectures the Megatron model code builds) and the config
# checks of each family come from the family registry.
from kiln.api.model_families import SUPPORTED_ARCHS, config_problems, family_of, is_dsa_config

#: Head sizes vLLM 0.32's CPU attention backend has kernels for (its
#: `CPUAttentionBackend.get_supported_head_sizes()`; a test keeps the two equal).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: The one MLA latent (kv_lora_rank + qk_rope_head_dim) vLLM 0.32's CPU MLA kernel takes (its
#: `CPUMLABackend.get_supported_head_sizes()`; a test keeps the two equal).
VLLM_CPU_MLA_LATENT = 576
#: Measured: vLLM 0.32 (CPU, float32) against transformers on the prompt log-probs of a tiny
#: random DeepSeek-V3 checkpoint with that latent (2 layers, hidden 128, 8 experts top-4 in 2 of
#: 4 groups), 4 prompts of 40 tokens; with both layers dense it is still 0.012 (mean 0.0018), so
#: the gap is in its MLA, where other families agree to ~1e-6.
VLLM_CPU_MLA_MISMATCH = "max |log-prob diff| 0.020 (mean 0.0031) against transformers in float32"
TRAINER_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelFacts:
    """What the model checks read from a checkpoint directory."""

    path: Path
    config: dict[str, Any]
    tokenizer_size: int | None
    chat_template: str = ""
    """The tokenizer's chat template(s) as text (tokenizer_config.json or chat_template.jinja);
    empty when it has none."""

    @property
    def heads(self) -> int:
        return self.config.get("num_attention_heads") or 1

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config.get("hidden_size", 0) // self.heads


@dataclass(frozen=True)
class Target:
    """Where a model check applies: the engine that will serve it and the hardware."""

    engine: str = "vllm"
    """The rollout engine that will run (`engine_kind`'s answer: vllm, megatron or torch)."""
    cuda: bool = False
    tensor_parallel: int = 1
    """The trainer's `spec.trainer.tensorParallel`."""
    expert_parallel: int = 1
    """The trainer's `spec.trainer.expertParallel`."""
    tool_call_format: str = "auto"
    """Rollout's `spec.rollout.toolCallFormat`."""


@dataclass(frozen=True)
class Capability:
    name: str
    field: tuple[str, ...]
    """Where in the RLJob, e.g. ("spec", "trainer", "pipelineParallel")."""
    supported: str
    enforced_by: tuple[str, ...]
    """The runtime parts that would fail without this check (documentation and tests)."""
    check: Callable[..., str | None]
    """spec -> reason, or (ModelFacts, Target) -> reason for a model capability."""
    needs_model: bool = False

    @property
    def path(self) -> str:
        return ".".join(self.field)


# ----------------------------------------------------------------------------- spec checks


def _pipeline(spec) -> str | None:
    pp = spec.trainer.pipeline_parallel
    return None if pp == 1 else f"pipelineParallel {pp} is not supported; only 1 (use tensorParallel)"


def dtype_refusal(dtype: str) -> str | None:
    return None if dtype in TRAINER_DTYPES else (
        f"dtype {dtype} is not supported by the trainer; use {' or '.join(TRAINER_DTYPES)}")


def _dtype(spec) -> str | None:
    return dtype_refusal(spec.model.dtype)


def _trainer_gpus(spec) -> str | None:
    gpu, tp = spec.trainer.resources.gpu, spec.trainer.tensor_parallel
    if gpu in (0, tp):
        return None
    return (f"{gpu} GPU{'s' if gpu > 1 else ''} per trainer pod for tensorParallel {tp}: each tensor-parallel rank takes "
            f"one GPU of its pod; set gpu to {tp} (or 0 to train on CPUs)")


def _expert_layout(spec) -> str | None:
    t = spec.trainer
    if t.data_parallel % t.expert_parallel:  # Megatron carves EP groups out of the DP replicas
        return (f"expertParallel {t.expert_parallel} must divide dataParallel {t.data_parallel}: "
                "experts are split over data-parallel replicas")
    if t.expert_parallel > 1 and t.tensor_parallel > 1:
        return f"expertParallel {t.expert_parallel} needs tensorParallel 1 (MoE layers train unsplit by TP)"
    return None


def _rollout_gpus(spec) -> str | None:
    gpu = spec.rollout.resources.gpu
    return None if gpu <= 1 else (
        f"{gpu} GPUs per rollout pod: a rollout pod runs one engine on one GPU; set gpu to 1 and "
        "raise spec.rollout.replicas instead")


SPEC_CAPABILITIES: tuple[Capability, ...] = (
    Capability("pipeline-parallel", ("spec", "trainer", "pipelineParallel"),
               "1 (tensor and data parallelism only)", ("trainer",), _pipeline),
    Capability("trainer-dtype", ("spec", "model", "dtype"), "float32 or bfloat16",
               ("trainer",), _dtype),
    Capability("trainer-gpus", ("spec", "trainer", "resources", "gpu"),
               "0 (CPU, gloo) or tensorParallel (one GPU per rank, NCCL)", ("trainer", "operator"),
               _trainer_gpus),
    Capability("rollout-gpus", ("spec", "rollout", "resources", "gpu"),
               "0 or 1 per rollout pod (scale out with replicas)", ("rollout", "operator"), _rollout_gpus),
    Capability("expert-parallel-layout", ("spec", "trainer", "expertParallel"),
               "a divisor of dataParallel, with tensorParallel 1", ("trainer",), _expert_layout),
)


# ---------------------------------------------------------------------------- model checks


def _arch(m: ModelFacts, t: Target) -> str | None:
    # An unknown architecture, or a config.json field its family's model code does not build.
    problems = config_problems(m.config)
    return problems[0] if problems else None


def _is_mla(config: dict[str, Any]) -> bool:
    family = family_of(config)
    return family is not None and family.attention.kind == "mla"


def _head_size(m: ModelFacts, t: Target) -> str | None:
    if (t.engine != "vllm" or t.cuda or is_dsa_config(m.config) or _is_mla(m.config)
            or m.head_dim in VLLM_CPU_HEAD_SIZES):
        return None
    return (f"head size {m.head_dim} (hidden_size {m.config.get('hidden_size')} / "
            f"num_attention_heads {m.heads}) has no kernel in vLLM's CPU attention (supported: "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use such a model, or rollout engine megatron")


def _vllm_cpu_mla(m: ModelFacts, t: Target) -> str | None:
    if t.engine == "vllm" and _is_mla(m.config) and is_dsa_config(m.config):
        # On GPUs vLLM would run DeepSeek's own indexer, whose weights Kiln's checkpoints lack.
        return (f"{family_of(m.config).title} selects keys with Kiln's DeepSeek sparse attention (config.json "
                "index_topk), which vLLM has no CPU path for and runs with another indexer on GPUs; "
                "use rollout engine megatron")
    if t.engine != "vllm" or t.cuda or not _is_mla(m.config):
        return None
    kv, rope = m.config.get("kv_lora_rank"), m.config.get("qk_rope_head_dim")
    if (kv or 0) + (rope or 0) != VLLM_CPU_MLA_LATENT:
        return (f"config.json kv_lora_rank {kv} + qk_rope_head_dim {rope}: vLLM's CPU MLA kernel takes "
                f"a latent of {VLLM_CPU_MLA_LATENT} only (512 + 64); use rollout engine megatron or torch")
    return (f"multi-latent attention on vLLM's CPU: its MLA path serves log-probs off by "
            f"{VLLM_CPU_MLA_MISMATCH}; use rollout engine megatron or torch")


def _vocab(m: ModelFacts, t: Target) -> str | None:
    vocab = m.config.get("vocab_size")
    if vocab is None or m.tokenizer_size is None or m.tokenizer_size <= vocab:
        return None
    return (f"the tokenizer has {m.tokenizer_size} tokens but the model's vocab_size is {vocab}; "
            "ids past it cannot be embedded")


def _tp_split(m: ModelFacts, t: Target) -> str | None:
    tp = t.tensor_parallel
    if tp == 1:
        return None
    for field in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        value = m.config.get(field) or (m.heads if field == "num_key_value_heads" else None)
        if value and value % tp:
            return f"{field} {value} does not split over tensorParallel {tp}"
    return None


def is_moe_config(config: dict[str, Any]) -> bool:
    family = family_of(config)
    return family is not None and family.moe is not None


def _moe_tp(m: ModelFacts, t: Target) -> str | None:
    family = family_of(m.config)
    limit = family.max_tensor_parallel if family is not None else None
    if limit is None or t.tensor_parallel <= limit:
        return None
    what = "MoE models" if family.moe is not None else f"{family.title} models"
    return f"tensorParallel {t.tensor_parallel}: {what} train with tensorParallel {limit} only"


def _expert_parallel(m: ModelFacts, t: Target) -> str | None:
    ep = t.expert_parallel
    if ep == 1:
        return None
    family = family_of(m.config)
    if family is None or family.moe is None:
        return f"expertParallel {ep}: the model has no experts to split (expert parallelism is for MoE models)"
    experts = family.moe.experts(m.config)
    if experts and experts % ep:
        return (f"expertParallel {ep} does not divide the {experts} experts of each MoE layer "
                f"(config.json {' or '.join(family.moe.num_experts)})")
    return None


MODEL_CAPABILITIES: tuple[Capability, ...] = (
    Capability("architecture", ("spec", "model", "path"),
               f"{', '.join(sorted(SUPPORTED_ARCHS))}, with the config.json fields their family builds",
               ("trainer", "rollout"), _arch, needs_model=True),
    Capability("vllm-cpu-head-size", ("spec", "model", "path"),
               f"head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} for vLLM on a CPU",
               ("rollout",), _head_size, needs_model=True),
    Capability("vllm-cpu-mla", ("spec", "rollout", "engine"),
               "no multi-latent attention (DeepSeek-V3) on vLLM on a CPU, no DeepSeek-V3.2 on vLLM",
               ("rollout",), _vllm_cpu_mla,
               needs_model=True),
    Capability("tokenizer-vocab", ("spec", "model", "path"),
               "a tokenizer no larger than the model's vocab_size", ("trainer", "rollout"), _vocab,
               needs_model=True),
    Capability("tensor-parallel-split", ("spec", "trainer", "tensorParallel"),
               "heads, KV heads, vocabulary and MLP width divisible by tensorParallel",
               ("trainer",), _tp_split, needs_model=True),
    Capability("moe-tensor-parallel", ("spec", "trainer", "tensorParallel"),
               "tensorParallel up to the family's limit (1 for MoE models)", ("trainer",), _moe_tp,
               needs_model=True),
    Capability("chat-tool-format", ("spec", "rollout", "toolCallFormat"),
               "a chat template whose tool calls are hermes, llama3 or glm45 (or toolCallFormat tags)",
               ("rollout",), lambda m, t: foreign_tool_format(m.chat_template, t.tool_call_format),
               needs_model=True),
    Capability("expert-parallel", ("spec", "trainer", "expertParallel"),
               "expertParallel 1, or for a MoE model one that divides its expert count",
               ("trainer",), _expert_parallel, needs_model=True),
)

CAPABILITIES = SPEC_CAPABILITIES + MODEL_CAPABILITIES


@dataclass(frozen=True)
class Refusal:
    capability: Capability
    message: str

    def __str__(self) -> str:
        return f"{self.capability.path}: {self.message}"


def spec_refusals(spec) -> list[Refusal]:
    """Why the runtime would refuse `spec` (an RLJobSpec), from the spec alone."""
    return [Refusal(c, msg) for c in SPEC_CAPABILITIES if (msg := c.check(spec)) is not None]


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


def read_model(model_dir: str | Path) -> ModelFacts:
    """The facts the model checks need; ValueError naming the file when they cannot be read."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{model_dir} holds no config.json (not a Hugging Face checkpoint)")
    try:
        config = json.loads(config_path.read_text())
        return ModelFacts(model_dir, config, _tokenizer_size(model_dir), chat_template(model_dir))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from None


def model_refusals(model_dir: str | Path, target: Target) -> list[Refusal]:
    """Why the trainer or the rollout engine would refuse the checkpoint in `model_dir` on
    `target`; ValueError when the checkpoint cannot be read at all."""
    facts = read_model(model_dir)
    return [Refusal(c, msg) for c in MODEL_CAPABILITIES if (msg := c.check(facts, target)) is not None]


def rollout_engine(requested: str, config: dict[str, Any], cuda: bool | None = None) -> str:
    """The engine that serves a model: `requested`, with "auto" meaning vllm, and "auto" or
    "vllm" meaning megatron for a DSA checkpoint, which vLLM has no CPU path for, and the
    family's first engine on this hardware where its registry entry lists no vLLM (except a
    multi-latent-attention family asked to run on vLLM on a CPU, which the vllm-cpu-mla
    capability refuses with its reason) (the MoE
    families: vLLM 0.32's CPU build serves them, but returns routed experts only from its V2
    model runner, which needs Triton on a GPU, so routing replay would have nothing to replay,
    and its `reload_weights` leaves the expert weights in checkpoint layout instead of the CPU
    kernel's packed one: wrong outputs after a weight sync)."""
    if requested not in ("auto", "vllm"):
        return requested
    if "kiln_dsa" in config:
        return "megatron"
    family = family_of(config)
    if family is None:
        return "vllm"
    cuda = has_cuda() if cuda is None else cuda
    if requested == "vllm" and not cuda and family.attention.kind == "mla":
        return "vllm"  # asked for by name: refused with the measured reason (vllm-cpu-mla), not replaced
    engines = family.rollout.gpu if cuda else family.rollout.cpu
    return "vllm" if "vllm" in engines else engines[0]


def job_model_refusals(spec, component: str | None = None, *, model_dir: str | Path | None = None,
                       cuda: bool | None = None) -> list[Refusal]:
    """The model capabilities `spec`'s checkpoint (`model_dir`, default spec.model.path) fails,
    for `component` ("trainer", "rollout"; None: both). ValueError when it cannot be read."""
    model_dir = Path(model_dir) if model_dir is not None else spec.model.local_path()
    facts = read_model(model_dir)
    cuda = has_cuda() if cuda is None else cuda
    target = Target(engine=rollout_engine(spec.rollout.engine, facts.config, cuda), cuda=cuda,
                    tensor_parallel=spec.trainer.tensor_parallel, expert_parallel=spec.trainer.expert_parallel,
                    tool_call_format=spec.rollout.tool_call_format)
    return [Refusal(c, msg) for c in MODEL_CAPABILITIES
            if (component is None or component in c.enforced_by)
            and (msg := c.check(facts, target)) is not None]


def model_problems(model_dir: str | Path, *, engine: str = "vllm", dtype: str = "float32",
                   tensor_parallel: int = 1, cuda: bool | None = None) -> list[str]:
    """One line per reason the trainer or a rollout `engine` cannot run the checkpoint in
    `model_dir` in `dtype`; empty when they can."""
    target = Target(engine=engine, cuda=has_cuda() if cuda is None else cuda, tensor_parallel=tensor_parallel)
    try:
        problems = [r.message for r in model_refusals(model_dir, target)]
    except ValueError as exc:
        problems = [str(exc)]
    if (msg := dtype_refusal(dtype)) is not None:
        problems.append(msg)
    return problems
