"""The RLJob API: one typed model for the manifest users write, torch-free.

`RLJob` is what `kubectl apply` sends and what `kiln run job.yaml` reads. The CRD's
openAPIV3Schema is generated from these models (`kiln.api.crd`), so the cluster and the local
launcher agree on every field. Field names are camelCase on the wire (Kubernetes convention) and
snake_case in Python. Cross-field rules live in `model_validator`s; the error messages name the
field path as a user would write it.

Not covered here: how a spec becomes pods (`kiln.operator`) or processes (`kiln.cli.local.launcher`).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "kiln.dev"
API_VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )


Quantity = Annotated[
    str,
    Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$", examples=["500m", "4Gi"]),
]


# ---------------------------------------------------------------------------------------- model


class ModelInit(_Model):
    """Create a small random-initialised model locally (tests, quickstart). Nothing is downloaded."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(256, ge=8)
    vocab_size: int = Field(512, ge=32)
    """Upper bound on the vocabulary of the tokenizer trained on the job's task sets (a small
    corpus gives fewer merges); padded only to a multiple of trainer.tensorParallel, since
    tokens that never occur slow a tiny model's learning."""
    max_position_embeddings: int = Field(1024, ge=16)
    tie_word_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> ModelInit:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hiddenSize ({self.hidden_size}) must be divisible by numHeads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"numHeads ({self.num_heads}) must be divisible by numKvHeads ({self.num_kv_heads})"
            )
        return self


class ModelSpec(_Model):
    path: str = Field(min_length=1)
    """Hugging Face checkpoint directory (config.json + safetensors). On a cluster, a path
    inside `pvc`; locally, a directory (relative paths are relative to the job file)."""
    pvc: str | None = None
    """PersistentVolumeClaim holding the model, mounted read-only at /models."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    init: ModelInit | None = None
    """If set and `path` holds no checkpoint yet, Kiln creates this model there first."""


# ----------------------------------------------------------------------------------------- tasks


class TaskGenerator(_Model):
    """Procedurally generated tasks (built-in environments only)."""

    count: int = Field(ge=1)
    seed: int = 0
    split: Literal["train", "heldout"] = "train"
    """Which side of the environment's fixed train/held-out partition to draw from; held-out
    tasks never coincide with training tasks, whatever the seeds."""
    num_steps: int = Field(4, ge=1, le=32)
    """Dependent tool calls per task. Without lengthTail every task takes exactly this many;
    with it, this sets the range of the drawn counts (1 to 4 * numSteps). The environment may
    hold fewer calls per task than 32 (`chain`: at most 9), which it reports when loading."""
    length_tail: float | None = Field(None, ge=0, le=10)
    """Long-tailed episode lengths: each task's call count k is drawn, independently and
    reproducibly from `seed`, from a Zipf law truncated to [1, K] with K = 4 * numSteps:
    P(k) = k^-lengthTail / sum_{j=1..K} j^-lengthTail. Larger values give shorter episodes
    (1.0: about 37% take one call and 5% take K for numSteps 2); 0 is uniform on [1, K]. Unset:
    every task takes numSteps calls."""


class TaskSetSpec(_Model):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    env: Literal["chain", "terminal", "swe", "search", "code"]
    """Environment type; fixes the tools offered and the verifier. `chain` is the built-in
    multi-step calculator task used by the quickstart."""
    path: str | None = None
    """JSONL file of task records (format per environment, see the README)."""
    generate: TaskGenerator | None = None
    """Generate tasks instead of reading `path` (only `chain`)."""

    @model_validator(mode="after")
    def _source(self) -> TaskSetSpec:
        if (self.path is None) == (self.generate is None):
            raise ValueError("exactly one of path or generate must be set")
        if self.generate is not None and self.env != "chain":
            raise ValueError(f"generate is only available for env 'chain', not {self.env!r}")
        return self


# --------------------------------------------------------------------------------------- stages


class EvalSpec(_Model):
    tasks: list[str] = Field(default_factory=list)
    """Held-out task sets evaluated before the stage and after it."""
    samples: int = Field(1, ge=1)
    """Sampled attempts per task, besides one greedy attempt."""


class _StageBase(_Model):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    tasks: list[str] = Field(min_length=1)
    """Names of entries in `spec.tasks` to train on."""
    max_steps: int = Field(100, ge=1)
    learning_rate: float = Field(1e-5, gt=0, le=1)
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to learningRate over this many steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep learningRate, or decay it along a cosine to minLrRatio at maxSteps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    batch_size: int = Field(32, ge=1)
    """Trajectories per optimizer step."""
    micro_batch_size: int = Field(8, ge=1)
    """Trajectories per forward/backward pass; must divide batchSize."""
    eval: EvalSpec | None = None

    @model_validator(mode="after")
    def _micro(self):  # type: ignore[no-untyped-def]
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"microBatchSize ({self.micro_batch_size}) must divide batchSize ({self.batch_size})"
            )
        return self


class SFTStage(_StageBase):
    """Supervised fine-tuning on expert trajectories produced by the environment's solver."""

    type: Literal["sft"]
    epochs: int = Field(1, ge=1)


class RLSettings(_Model):
    group_size: int = Field(8, ge=2)
    """G: samples per task; advantages are relative to the group mean."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Tokens with ratio below 1 - epsLow are masked out of the gradient."""
    eps_high: float = Field(0.28, ge=0)
    """Tokens with ratio above 1 + epsHigh are masked out of the gradient."""
    icepop_beta: float | None = Field(2.0, gt=1)
    """IcePop: keep a token only if pi_train_old / pi_infer_old is in [1/beta, beta]; null disables."""
    tau: int = Field(4, ge=0)
    """Freshness: drop a trajectory whose oldest policy version is more than tau behind."""
    sync_interval: int = Field(1, ge=1)
    """Publish weights to rollout every this many optimizer steps."""
    reset_optimizer_on_sync: bool = True
    """Reset AdamW's first and second moments after each weight publish."""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    advantage: Literal["group", "opd"] = "group"
    """`group`: reward minus group mean; `opd`: per-token teacher minus student log-prob."""
    teacher: str | None = None
    """Checkpoint directory of the teacher (required when advantage is opd)."""
    asynchronous: bool = Field(True, alias="async")
    """Rollout keeps generating while the trainer steps; false pauses rollout during training."""

    @model_validator(mode="after")
    def _opd(self) -> RLSettings:
        if self.advantage == "opd" and not self.teacher:
            raise ValueError("teacher must be set when advantage is 'opd'")
        return self


class RLStage(_StageBase):
    """Reinforcement learning with verifiable rewards."""

    type: Literal["rl"]
    rl: RLSettings = Field(default_factory=RLSettings)


Stage = Annotated[SFTStage | RLStage, Field(discriminator="type")]


# -------------------------------------------------------------------------------------- services


class Resources(_Model):
    cpu: Quantity = "1"
    memory: Quantity = "4Gi"
    gpu: int = Field(0, ge=0)


class SamplingSpec(_Model):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens_per_turn: int = Field(256, ge=1)
    max_total_tokens: int = Field(1024, ge=16)
    """Prompt, actions and observations together; the episode ends when it is reached."""


class RolloutSpec(_Model):
    replicas: int = Field(1, ge=0)
    engine: Literal["vllm", "megatron"] = "vllm"
    max_turns: int = Field(8, ge=1)
    episode_timeout_seconds: float = Field(300, gt=0)
    thinking: Literal["interleaved", "preserved", "turn-level", "off"] = "interleaved"
    """`interleaved`: the model may open a `<think>` block before any action; `preserved`:
    earlier turns' blocks stay in the context too. An episode is one task and its tool loop,
    in which every block stays in the context, so the two behave the same. `off`: an empty
    `<think></think>` is written before each action (context, not trained on). `turn-level`
    is not implemented by the agent loop and is rejected."""
    max_concurrent_episodes: int = Field(64, ge=1)
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    """KV cache reserved by each engine (vLLM otherwise takes most of the host's memory)."""
    enforce_eager: bool = True
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _thinking_supported(self) -> RolloutSpec:
        if self.thinking == "turn-level":
            raise ValueError(f"thinking: {self.thinking!r} is not implemented by the agent loop; "
                             "use 'interleaved', 'preserved' or 'off'")
        return self


class TrainerSpec(_Model):
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    checkpoint_interval: int = Field(50, ge=1)
    """Write a checkpoint every this many optimizer steps (and on SIGTERM)."""
    keep_checkpoints: int = Field(3, ge=1)
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables."""
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW's second-moment decay. 0.95 rather than PyTorch's 0.999: the second moment then
    follows the fast-changing gradients of a small model at a high learning rate (SFT of the
    quickstart model reached a loss several times lower in the same number of steps)."""
    resources: Resources = Field(default_factory=Resources)


class SandboxSpec(_Model):
    backend: Literal["bubblewrap", "docker"] = "bubblewrap"
    image: str | None = None
    """Container image (docker backend)."""
    rootfs: str | None = None
    """Root filesystem directory (bubblewrap backend); the host's read-only /usr when unset."""
    cpu: float = Field(1.0, gt=0)
    """CPU cores per sandbox."""
    memory: Quantity = "512Mi"
    pids: int = Field(256, ge=8)
    timeout_seconds: float = Field(30, gt=0)
    """Wall-clock limit of one tool call."""
    network: bool = False
    max_concurrent: int = Field(32, ge=1)
    warm_pool: int = Field(0, ge=0)
    output_limit_bytes: int = Field(65536, ge=1024)
    replicas: int = Field(1, ge=0)
    resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _docker_image(self) -> SandboxSpec:
        if self.backend == "docker" and self.rootfs is not None:
            raise ValueError("rootfs applies to the bubblewrap backend; use image with docker")
        return self


class WeightSyncSpec(_Model):
    bucket_bytes: int = Field(1 << 20, ge=4096)
    """Tensors are streamed in checksummed buckets of about this size."""
    timeout_seconds: float = Field(120, gt=0)
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"))


class StorageSpec(_Model):
    size: Quantity = "10Gi"
    storage_class: str | None = None
    retain: bool = True
    """Keep the PVC when the RLJob is deleted."""


class BufferSpec(_Model):
    capacity: int = Field(4096, ge=1)
    """Trajectories held before producers are told to back off."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"))


class CheckpointSpec(_Model):
    storage: StorageSpec = Field(default_factory=lambda: StorageSpec(size="50Gi"))


# ------------------------------------------------------------------------------------------- job


class RLJobSpec(_Model):
    model: ModelSpec
    tasks: list[TaskSetSpec] = Field(min_length=1)
    stages: list[Stage] = Field(min_length=1)
    """Run in order; each starts from the previous stage's final weights."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    checkpoints: CheckpointSpec = Field(default_factory=CheckpointSpec)
    image: str = "ghcr.io/kiln-dev/kiln:0.1.0"
    """Image the services run from (cluster only)."""
    suspend: bool = False
    """Scale every component to zero, keeping checkpoints and buffer."""
    seed: int = 0

    @model_validator(mode="after")
    def _references(self) -> RLJobSpec:
        names = [t.name for t in self.tasks]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"task set names must be unique; repeated: {sorted(dup)}")
        stage_names = [s.name for s in self.stages]
        dup = {n for n in stage_names if stage_names.count(n) > 1}
        if dup:
            raise ValueError(f"stage names must be unique; repeated: {sorted(dup)}")
        known = set(names)
        for i, stage in enumerate(self.stages):
            for ref in stage.tasks + (stage.eval.tasks if stage.eval else []):
                if ref not in known:
                    raise ValueError(
                        f"stages[{i}] ({stage.name}) refers to task set {ref!r}, which is not in "
                        f"spec.tasks (known: {sorted(known)})"
                    )
            if isinstance(stage, RLStage) and stage.batch_size % stage.rl.group_size:
                raise ValueError(
                    f"stages[{i}] ({stage.name}): batchSize ({stage.batch_size}) must be a "
                    f"multiple of rl.groupSize ({stage.rl.group_size})"
                )
        return self


class ObjectMeta(BaseModel):
    """The parts of Kubernetes metadata Kiln reads; everything else passes through."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str | None = None


class RLJob(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["kiln.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLJob"]
    metadata: ObjectMeta
    spec: RLJobSpec
    status: dict | None = None
    """Written by the operator; ignored on input."""


# ------------------------------------------------------------------------------------- status


Phase = Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class RLJobStatus(_Model):
    """What `kubectl get rljobs` shows; written by the operator, by the launcher locally."""

    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    stage: str | None = None
    policy_version: int = 0
    step: int = 0
    reward: float | None = None
    """Mean reward of the last training batch."""
    observed_staleness: int | None = None
    """Largest (trainer version - oldest trajectory version) among trajectories trained on."""
    last_weight_sync: str | None = None
    """RFC 3339 time of the last completed weight publish."""
    message: str = ""
    observed_generation: int | None = None
