"""The RLJob's service sections: rollout, trainer, sandbox, weight sync, buffer, checkpoints and
experiment tracking, with the resources each component's pods ask for.

Part of the RLJob API; `kiln.api.spec` assembles the job from these and is the module to import.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kiln.api.base import ByteQuantity, Model, Quantity
from kiln.api.openai_endpoint import OpenAIEndpointSpec
from kiln.api.ports import RESERVED as RESERVED_PORTS
from kiln.api.sampling import VLLM_MAX_TEMPERATURE, SamplingSpec
from kiln.api.scheduling import EnginePodSettings, PodSettings, shm_fits


class Resources(Model):
    """Requests (and limits) of one component's pod."""

    cpu: Quantity = "1"
    """CPU cores, as a Kubernetes quantity (e.g. `500m`, `4`)."""
    memory: ByteQuantity = "4Gi"
    """Memory, as a Kubernetes quantity (e.g. `512Mi`, `16Gi`)."""
    gpu: int = Field(0, ge=0)
    """Accelerators per pod, of the kind `gpuResource` names."""
    gpu_resource: str = Field("nvidia.com/gpu", max_length=253,
                              pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    """The extended resource `gpu` counts, as the node's device plugin advertises it:
    `nvidia.com/gpu`, `amd.com/gpu`, `gpu.intel.com/i915`, a MIG profile such as
    `nvidia.com/mig-1g.10gb`, ..."""
    ephemeral_storage: ByteQuantity = "8Gi"
    """Local disk the pod's containers may fill (their own layer, logs, caches, scratch
    folders); the kubelet evicts a pod that passes it rather than let the node's disk fill up.
    A model named by hub id is downloaded there: size it to fit, or use `model.pvc`. The
    sandbox pod gets `maxConcurrent` workspaces (`disk`) on top."""


# --------------------------------------------------------------------------------------- rollout


class AutoscaleSpec(Model):
    """Rollout replicas sized by what the trainer and freshness control see (`kiln.control.autoscale`):
    one more when the trainer waits for batches, one fewer when the staleness trained nears the
    stage's tau or the buffer backs up. Decided after each optimizer step of an asynchronous RL
    stage, from the last `windowSteps` steps; the operator writes the result to
    `spec.rollout.replicas`, `kiln run` starts or stops rollout worker processes. Leave it unset
    to size rollout by hand, or from an HPA or KEDA through the RLJob's scale subresource."""

    min_replicas: int = Field(1, ge=1)
    """Fewest replicas autoscaling leaves."""
    max_replicas: int = Field(ge=1)
    """Most replicas autoscaling starts."""
    scale_up_idle: float = Field(0.3, gt=0, lt=1)
    """Add a replica when the trainer waited this fraction of the window's time for batches."""
    staleness_margin: int = Field(1, ge=0)
    """Remove one when a trained trajectory was tau - stalenessMargin (at least 1) or more
    versions old."""
    max_buffer_batches: float = Field(2.0, gt=0)
    """Remove one when this many batches wait in the buffer (rollout outruns the trainer)."""
    window_steps: int = Field(3, ge=1)
    """Optimizer steps each decision looks at; after a change, the next decision waits for as
    many steps, all taken with the new replica count."""

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscaleSpec":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"maxReplicas ({self.max_replicas}) is below minReplicas "
                             f"({self.min_replicas})")
        return self


class RolloutSpec(Model):
    """The rollout service: inference engines running the agent loop."""

    replicas: int = Field(1, ge=0)
    """Rollout replicas, each with its engine: pods on a cluster, worker processes for `kiln
    run`. With `autoscale`, the number to start with."""
    autoscale: AutoscaleSpec | None = None
    """Size rollout from the trainer's waiting and the staleness trained (see AutoscaleSpec)."""
    engine: Literal["vllm", "megatron"] = "vllm"
    """`vllm` (production; DSA and MoE checkpoints fall back to megatron: vLLM cannot run DSA
    on a CPU, nor record MoE routing for replay) or `megatron` (the trainer's own model code:
    bit-exact with training, slow)."""
    max_turns: int = Field(8, ge=1)
    """Actions per episode; an episode without an answer by then gets reward 0."""
    episode_timeout_seconds: float = Field(300, gt=0)
    """Wall-clock limit of one episode; its sandbox is reclaimed after it plus grading."""
    thinking: Literal["interleaved", "preserved", "turn-level", "off"] = "interleaved"
    """`interleaved`: the model may open a `<think>` block before any action; `preserved`:
    earlier turns' blocks stay in the context too. An episode is one task and its tool loop,
    in which every block stays in the context, so the two behave the same. `off`: an empty
    `<think></think>` is written before each action (context, not trained on). `turn-level`:
    the model may think on the first turn and every `thinkEvery`-th turn (an empty block is
    written before the others), and each thought is dropped from later turns' context; the
    episode is then trained as one trajectory per stretch whose context only grew. Needs a
    chat-template tool-call format."""
    think_every: int = Field(0, ge=0)
    """With `thinking: turn-level`: the model may also think on every this-many-th turn after
    the first (0: on the first turn alone)."""
    tool_call_format: Literal["auto", "tags", "hermes", "llama3", "glm45"] = "auto"
    """How the model's prompts, replies and tool calls are written. `hermes` (Qwen, Hermes:
    `<tool_call>{json}</tool_call>`), `llama3` (a JSON object per call) and `glm45` (GLM-4.5
    and later: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`)
    render the conversation with the tokenizer's chat template (`tools=`); `tags` is Kiln's
    plain text protocol without a chat template (`<call>NAME ARG</call>`, `<obs>`, `<answer>`),
    which the quickstart's tiny models use. `auto`: the chat template when it renders tools
    (glm45 for a template that writes GLM's tool calls, llama3 for Llama models, hermes
    otherwise), else `tags`."""
    max_concurrent_episodes: int = Field(64, ge=1)
    """Episodes in flight per rollout replica, at most."""
    target_engine_occupancy: int | None = Field(None, ge=1)
    """RL: start a new group only while the engine has fewer generations in progress than
    this, so that episodes waiting on slow tools leave room for others (maxConcurrentEpisodes
    still bounds the total). Unset: maxConcurrentEpisodes episodes whatever they wait on."""
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    """KV cache reserved by each engine (vLLM otherwise takes most of the host's memory)."""
    sample_every: int = Field(10, ge=1)
    """Every this many finished trajectories, one is also kept in the rollout's
    trajectories.jsonl (what `kiln trajectories` shows)."""
    enforce_eager: bool = True
    """Run vLLM without CUDA graphs / compilation (faster start-up, slower steps)."""
    openai_port: int | None = Field(None, ge=1, le=65535)
    """Also serve the OpenAI chat-completions API on this port, so that an outside agent
    scaffold can play episodes with the policy (each request names its episode; a reward call
    ends it and its trajectories go to the buffer). Unset: not served. Not one of the ports
    Kiln's pods use (50050, 50051, 9090, 29500)."""
    openai: OpenAIEndpointSpec = Field(default_factory=OpenAIEndpointSpec)
    """API keys, admitted peers, reward range and limits of that endpoint."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling settings of training episodes (evaluation adds one greedy attempt)."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of each rollout pod."""
    pod: EnginePodSettings = Field(default_factory=EnginePodSettings)
    """Scheduling, identity, extra environment and volumes of these pods, and /dev/shm."""

    @field_validator("openai_port")
    @classmethod
    def _port_of_its_own(cls, value: int | None) -> int | None:
        if value in RESERVED_PORTS:
            raise ValueError(f"{value} is {RESERVED_PORTS[value]}; the endpoint needs a port of its "
                             f"own (not {', '.join(map(str, sorted(RESERVED_PORTS)))})")
        return value

    @model_validator(mode="after")
    def _temperature_on_vllm(self) -> RolloutSpec:
        # vLLM validates each request: without this the job would fail at its first RL
        # episode, after every stage before it had run.
        if self.engine == "vllm" and self.sampling.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(f"sampling.temperature={self.sampling.temperature}: vLLM samples at "
                             f"most at {VLLM_MAX_TEMPERATURE:g}; use a lower one, or engine "
                             "'megatron'")
        return self

    @model_validator(mode="after")
    def _tool_choice_temperature(self) -> RolloutSpec:
        if self.sampling.tool_choice_temperature is None:
            return self
        if self.sampling.temperature == 0:
            raise ValueError("sampling.toolChoiceTemperature needs a sampling temperature above 0 "
                             "(a greedy rollout samples nothing)")
        if self.tool_call_format != "tags":
            raise ValueError(f"sampling.toolChoiceTemperature needs toolCallFormat 'tags' (a tool's "
                             f"name right after one <call> token); got {self.tool_call_format!r}")
        return self

    @model_validator(mode="after")
    def _thinking_supported(self) -> RolloutSpec:
        if self.thinking == "turn-level" and self.tool_call_format == "tags":
            raise ValueError("thinking: 'turn-level' needs a chat-template toolCallFormat (hermes, "
                             "llama3 or auto), not 'tags', which has no turns to re-render")
        return self

    @model_validator(mode="after")
    def _shm(self) -> "RolloutSpec":
        shm_fits(self.resources.memory, self.pod)
        return self

    @model_validator(mode="after")
    def _autoscale_bounds(self) -> "RolloutSpec":
        a = self.autoscale
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be within autoscale's minReplicas "
                             f"({a.min_replicas}) and maxReplicas ({a.max_replicas})")
        return self


# --------------------------------------------------------------------------------------- trainer


class TrainerSpec(Model):
    """The trainer service: Megatron-core, the policy loss, the optimizer, checkpoints."""

    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel ranks the model is split over."""
    data_parallel: int = Field(1, ge=1)
    """Data-parallel replicas of the tensor-parallel group, one pod each (gloo on CPUs, NCCL on
    GPUs): each trains on a share of every batch and gradients are summed across them."""
    expert_parallel: int = Field(1, ge=1)
    """MoE models: data-parallel replicas each MoE layer's experts are split over (each holds
    `experts / expertParallel`). Must divide `dataParallel` and the expert count."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel stages (only 1 is supported)."""
    checkpoint_interval: int = Field(50, ge=1)
    """Write a checkpoint every this many optimizer steps (and on SIGTERM)."""
    keep_checkpoints: int = Field(3, ge=1)
    """Newest checkpoints kept; older ones are deleted."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's first-moment decay."""
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW's second-moment decay. 0.95 rather than PyTorch's 0.999: the second moment then
    follows the fast-changing gradients of a small model at a high learning rate (SFT of the
    quickstart model reached a loss several times lower in the same number of steps)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=16)
    """Packed sequences: each forward/backward pass takes up to this many tokens, the
    sequences concatenated with no padding (attention and positions kept per sequence), in
    place of a stage's `microBatchSize` padded rows; data-parallel replicas share a batch by
    tokens. Unset: padded micro-batches. Not for DSA models."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of the trainer pod."""
    pod: EnginePodSettings = Field(default_factory=EnginePodSettings)
    """Scheduling, identity, extra environment and volumes of these pods, and /dev/shm."""

    @model_validator(mode="after")
    def _shm(self) -> "TrainerSpec":
        shm_fits(self.resources.memory, self.pod)
        return self


# --------------------------------------------------------------------------------------- sandbox


class SandboxSpec(Model):
    """The sandbox service: where tool calls run, with the limits every sandbox gets."""

    backend: Literal["bubblewrap", "docker"] = "bubblewrap"
    """`bubblewrap` (namespaces and cgroups; the local default) or `docker` (the Docker Engine
    API: a dind sidecar on a cluster, podman's socket on one machine)."""
    image: str | None = None
    """Container image (docker backend)."""
    rootfs: str | None = None
    """Root filesystem directory (bubblewrap backend); the host's read-only /usr when unset."""
    cpu: float = Field(1.0, gt=0)
    """CPU cores per sandbox."""
    memory: ByteQuantity = "512Mi"
    """Memory limit per sandbox; the process tree is OOM-killed beyond it."""
    pids: int = Field(256, ge=8)
    """Processes and threads alive at once per sandbox (holds fork bombs)."""
    disk: ByteQuantity = "1Gi"
    """Workspace size per sandbox: a write past it fails inside the sandbox with ENOSPC. A
    filesystem of its own (bubblewrap: see `workspace_fs`; docker: a tmpfs, which counts
    towards `memory`)."""
    workspace_fs: Literal["ext4", "tmpfs"] = "ext4"
    """bubblewrap backend: the workspace is a loop-mounted ext4 image (disk-backed) or a tmpfs
    (memory-backed, no loop device needed)."""
    timeout_seconds: float = Field(30, gt=0)
    """Wall-clock limit of one tool call."""
    network: bool = False
    """Give sandboxes the host's network; off, a sandbox has only its own loopback."""
    max_concurrent: int = Field(32, ge=1)
    """Sandboxes alive at once per sandbox replica."""
    max_per_owner: int | None = Field(None, ge=1)
    """Sessions one owner (a rollout replica) may hold at once per sandbox replica, so one
    cannot starve the others; unset: only `maxConcurrent` bounds them."""
    warm_pool: int = Field(0, ge=0)
    """Sandboxes started ahead of demand (cuts start latency of container backends)."""
    output_limit_bytes: int = Field(65536, ge=1024)
    """Bytes of stdout and of stderr kept per tool call; the rest is cut behind a marker."""
    plugin_memory: ByteQuantity = "2Gi"
    """Address space of each task set's plugin worker (the process a job's environment and
    reward plugins run in, `RLIMIT_AS`): an allocation past it raises MemoryError in the
    plugin, which fails that call, not the service."""
    replicas: int = Field(1, ge=0)
    """Sandbox service pods (on a cluster)."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of each sandbox service pod."""
    pod: PodSettings = Field(default_factory=PodSettings)
    """Scheduling, identity, extra environment and volumes of these pods."""

    @model_validator(mode="after")
    def _docker_image(self) -> SandboxSpec:
        if self.backend == "docker" and self.rootfs is not None:
            raise ValueError("rootfs applies to the bubblewrap backend; use image with docker")
        return self


class ToolLatency(Model):
    """Wall-clock time added to every tool call of a task set's episodes: after the tool runs,
    the episode's sandbox runs `sleep D`, D drawn from a log-normal law with the given median
    and 99th percentile (capped at maxSeconds). It makes a fast environment behave like one
    whose tools run tests or builds, for measuring how rollout overlaps environment time."""

    p50_seconds: float = Field(gt=0)
    """Median added time per tool call."""
    p99_seconds: float = Field(gt=0)
    """99th percentile; its ratio to the median sets the tail (1: always the median)."""
    max_seconds: float = Field(120.0, gt=0)
    """Longest added time (a tool's timeout, as a real environment has)."""
    seed: int = 0
    """Seed of the draws (their order follows the calls' arrival)."""

    @model_validator(mode="after")
    def _tail(self) -> "ToolLatency":
        if self.p99_seconds < self.p50_seconds:
            raise ValueError(f"p99Seconds ({self.p99_seconds}) must be at least p50Seconds "
                             f"({self.p50_seconds})")
        return self


# ------------------------------------------------------------------------ weight sync and buffer


class WeightSyncSpec(Model):
    """The weight-sync service: moves each policy version from the trainer to rollout."""

    bucket_bytes: int = Field(1 << 20, ge=4096)
    """Tensors are streamed in checksummed buckets of about this size."""
    timeout_seconds: float = Field(120, gt=0)
    """A publish not complete after this long is abandoned (the trainer publishes again)."""
    max_version_step: int = Field(64, ge=1)
    """A published version more than this ahead of the latest one is refused: the trainer only
    ever publishes the next one, and a leap would make all its later publishes stale."""
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"))
    """Resources of the weight-sync pod."""
    pod: PodSettings = Field(default_factory=PodSettings)
    """Scheduling, identity, extra environment and volumes of these pods."""


class StorageSpec(Model):
    """A PersistentVolumeClaim of the job."""

    size: ByteQuantity = "10Gi"
    """Requested capacity."""
    storage_class: str | None = None
    """StorageClass; the cluster's default when unset."""
    retain: bool = True
    """Keep the PVC when the RLJob is deleted."""


class BufferSpec(Model):
    """The buffer service: the durable store of trajectories between rollout and trainer."""

    capacity: int = Field(4096, ge=1)
    """Trajectories held before producers are told to back off."""
    capacity_bytes: ByteQuantity = "1Gi"
    """Bytes of trajectories held (all in memory) before producers are told to back off; keep
    it well under `resources.memory`."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    """The buffer's volume (its append-only log)."""
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"))
    """Resources of the buffer pod."""
    pod: PodSettings = Field(default_factory=PodSettings)
    """Scheduling, identity, extra environment and volumes of these pods."""


class CheckpointSpec(Model):
    """Where the trainer's checkpoints live."""

    storage: StorageSpec = Field(default_factory=lambda: StorageSpec(size="50Gi"))
    """The checkpoints volume."""


# -------------------------------------------------------------------------------------- tracking


class WandbSpec(Model):
    """Weights & Biases: each process that tracks (the trainer, the driver) logs a run in the
    group named after the job. Needs the `wandb` package; online mode needs WANDB_API_KEY."""

    project: str = Field("kiln", min_length=1)
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); the API key's default when unset."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes runs under the run directory for a later `wandb sync` (no network)."""


class TrackingSpec(Model):
    """Experiment tracking: loss, gradient norm, learning rate, reward, pass rate, mask
    fractions, train/inference mismatch, staleness, throughput and evaluations."""

    tensorboard: bool = True
    """Write TensorBoard event files into the run directory (`tensorboard --logdir RUN_DIR`)."""
    wandb: WandbSpec | None = None
    """Also log to Weights & Biases when set."""


class TeacherSpec(Model):
    """One teacher of an on-policy distillation stage and the task sets it teaches."""

    teacher: str = Field(min_length=1)
    """The name of an earlier stage (its final weights) or a Hugging Face checkpoint directory."""
    tasks: list[str] = Field(min_length=1)
    """Task sets of the stage whose trajectories this teacher scores."""
