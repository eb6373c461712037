"""The policy model of a job (`spec.model`): where its checkpoint is, and how Kiln gets it there
when it is not yet: made locally (`init`, tiny random models) or downloaded from the Hugging
Face Hub (`hub`). Torch-free, like the rest of the spec."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kiln.api.base import Model

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face Hub repository id: `owner/name`."""

#: Where a pod mounts `spec.model.pvc` (the operator sets KILN_MODEL_ROOT to it).
MODEL_ROOT_ENV = "KILN_MODEL_ROOT"



class ModelInit(Model):
    """Create a small random-initialised model locally (tests, quickstart). Nothing is downloaded."""

    arch: Literal["qwen2", "llama", "qwen2_moe", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3",
                  "deepseek_v32"] = "qwen2"
    """Architecture of the checkpoint written (Hugging Face Qwen2, Llama, Qwen2-MoE, Qwen3,
    Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3 or DeepSeek-V3.2; the last three with one dense first
    layer, one shared expert and sigmoid routing, DeepSeek-V3 with multi-latent attention of
    fixed small ranks, V3.2 that model with a random lightning indexer per layer choosing
    `indexTopk` keys per query, the sparse attention Kiln's DSA kernels run)."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1)
    """Transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (must divide hiddenSize)."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention; must divide numHeads)."""
    intermediate_size: int = Field(256, ge=8)
    """Width of the MLP's hidden layer."""
    vocab_size: int = Field(512, ge=32)
    """Upper bound on the vocabulary of the tokenizer trained on the job's task sets (a small
    corpus gives fewer merges); padded only to a multiple of trainer.tensorParallel, since
    tokens that never occur slow a tiny model's learning."""
    max_position_embeddings: int = Field(1024, ge=16)
    """Longest sequence the model supports (prompt, actions and observations together)."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output projection."""
    seed: int = 0
    """Seed of the random initialisation (the same seed gives the same weights)."""
    num_experts: int = Field(8, ge=1, le=4096)
    """MoE archs: routed experts per layer."""
    num_experts_per_tok: int = Field(2, ge=1)
    """MoE archs: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = Field(64, ge=8)
    """MoE archs: width of each expert's hidden layer."""
    shared_expert_intermediate_size: int = Field(128, ge=8)
    """qwen2_moe: width of the shared expert's hidden layer (Qwen3-MoE has none)."""
    index_topk: int = Field(64, ge=1)
    """deepseek_v32: keys each query attends to, chosen by the indexer (a sequence no longer
    than this attends densely)."""

    @model_validator(mode="after")
    def _heads(self) -> ModelInit:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"numExpertsPerTok ({self.num_experts_per_tok}) must not exceed "
                             f"numExperts ({self.num_experts})")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hiddenSize ({self.hidden_size}) must be divisible by numHeads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"numHeads ({self.num_heads}) must be divisible by numKvHeads ({self.num_kv_heads})"
            )
        return self


class HubModel(Model):
    """A checkpoint on the Hugging Face Hub, downloaded to `spec.model.path` before the job starts
    (`kiln prepare-model`: under `kiln run`, and on a cluster as an init container of the
    trainer and rollout pods). The download resumes where it stopped, is checked against the
    Hub's checksums, and is skipped when `path` already holds this revision."""

    id: str
    """Repository id, `owner/name` (e.g. `Qwen/Qwen3-8B`)."""
    revision: str = "main"
    """Branch, tag or commit; a commit hash pins the exact weights."""
    token_secret: str | None = None
    """On a cluster: a Secret whose key `token` is the Hub token (gated and private models); it
    reaches the download as HF_TOKEN and nothing else. Locally, HF_TOKEN from the environment."""

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not HUB_ID.match(value):
            raise ValueError(f"{value!r} is not a Hub repository id (expected owner/name)")
        return value


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers a LoRA adapter may go on, named as PEFT users name them."""


class LoraSpec(Model):
    """Train a low-rank adapter (LoRA) instead of the model's weights: each targeted linear
    layer W gets W + (alpha / rank) * B @ A, with A [rank, in] and B [out, rank] trained and W
    frozen. Weight sync ships only A and B; `kiln export` writes a PEFT adapter (or, with
    `--merge`, the merged checkpoint). The trainer fuses q/k/v into one layer and gate/up into
    another: a subset of a fused layer's projections shares one A there, and the rows of the
    projections not targeted stay zero in its B (each targeted projection is a PEFT adapter of
    its own, the shared A repeated)."""

    rank: int = Field(8, ge=1, le=1024)
    """r: the adapter's inner width."""
    alpha: float = Field(16.0, gt=0)
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Projections that get an adapter, among q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj (attention and dense MLPs; MoE experts are not covered)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (PEFT's `lora_dropout`)."""
    stages: list[str] | None = None
    """The stages that train the adapter; unset: all. The others, which must come first, train
    every weight, and the adapter then goes on the weights they ended with (e.g. full SFT of a
    small model, then LoRA RL)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"targetModules: {unknown} are not among {list(LORA_TARGETS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"targetModules: {value} names a module twice")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def trains(self, stage: str) -> bool:
        """Whether stage `stage` trains the adapter."""
        return self.stages is None or stage in self.stages


def lora_problems(lora: LoraSpec | None, stage_names: list[str]) -> list[str]:
    """What is wrong with `spec.model.lora` for a job of these stages (empty: nothing)."""
    if lora is None or lora.stages is None:
        return []
    unknown = [s for s in lora.stages if s not in stage_names]
    if unknown:
        return [f"model.lora.stages: {unknown} are not stages of the job ({stage_names})"]
    flags = [lora.trains(s) for s in stage_names]
    if True in flags and not all(flags[flags.index(True):]):
        return [f"model.lora.stages {lora.stages}: the LoRA stages must be the last ones "
                f"(stages in order: {stage_names}); an adapter, once on, stays on"]
    return []


class ModelSpec(Model):
    """The policy model the job starts from."""

    path: str = Field(min_length=1)
    """Hugging Face checkpoint directory (config.json + safetensors). On a cluster, a path
    inside `pvc`; locally, a directory (a relative path is relative to the working directory,
    where `kiln run` keeps its runs)."""
    pvc: str | None = None
    """PersistentVolumeClaim holding the model, mounted read-only at /models."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Precision of the weights in the trainer and the rollout engines."""
    init: ModelInit | None = None
    """If set and `path` holds no checkpoint yet, Kiln creates this model there first."""
    hub: HubModel | None = None
    """If set, Kiln downloads this Hub checkpoint to `path` first (on a cluster `path` is then on
    `pvc`, which the download writes to, or, without one, in each pod's own run volume)."""
    lora: LoraSpec | None = None
    """If set, train a low-rank adapter (rank, alpha, targetModules, dropout, stages) on the frozen
    model instead of all its weights."""
    routing_replay: Literal["off", "record", "replay"] = "replay"
    """Mixture-of-experts models: `record` has rollout record the experts it chose for every
    token and the trainer count the tokens whose own routing differs (metric
    routing_flip_frac); `replay` also makes the trainer's forward use the recorded experts
    (the router's gate is still trained); `off` records nothing. Ignored for dense models."""

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        if self.init is not None and self.hub is not None:
            raise ValueError("init and hub are two ways to get the model: set one")
        return self

    def local_path(self) -> Path:
        """Where this process finds the checkpoint: `path`, under the model volume's mount point
        in a pod that mounts `pvc` (KILN_MODEL_ROOT)."""
        return self._on_volume(self.path)

    def tokenizer_path(self) -> Path:
        """Where this process finds the tokenizer (`tokenizer`, default the checkpoint's)."""
        return self._on_volume(self.tokenizer) if self.tokenizer else self.local_path()

    def _on_volume(self, value: str) -> Path:
        path, root = Path(value), os.environ.get(MODEL_ROOT_ENV)
        return Path(root) / path if root and self.pvc and not path.is_absolute() else path


