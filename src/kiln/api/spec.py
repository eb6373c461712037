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

from kiln.api.components import (BufferSpec, CheckpointSpec, Model, Quantity, Resources,
                                 RolloutSpec, SamplingSpec, SandboxSpec, StorageSpec, TeacherSpec,
                                 ToolLatency, TrackingSpec, TrainerSpec, WandbSpec, WeightSyncSpec)
from kiln.api.distillation import teacher_problems
from kiln.api.guard import RegressionSpec, SelectSpec, guard_problems
from kiln.api.model import HubModel, ModelInit, ModelSpec, lora_problems
from kiln.api.outputs import OutputSpec
from kiln.api.rewards import RewardRules
from kiln.api.rl import RLSettings
from kiln.api.swarm import SwarmSettings, swarm_problems
from kiln.api.task_sources import TaskSource
from kiln.api.status import Condition, Phase, RLJobStatus

__all__ = [
    "API_GROUP", "API_VERSION", "KIND", "PLURAL", "BufferSpec", "CheckpointSpec", "Condition",
    "EvalSpec", "GENERATED_ENVS", "HubModel", "ModelInit", "ModelSpec", "Phase", "PluginRef", "Quantity", "RLJob",
    "RLJobSpec", "RLJobStatus",
    "RLSettings", "RLStage", "Resources", "RolloutSpec", "SFTStage", "SamplingSpec", "SandboxSpec",
    "Stage", "StorageSpec", "TaskGenerator", "TaskSetSpec", "TeacherSpec", "TrackingSpec", "TrainerSpec",
    "WandbSpec", "WeightSyncSpec",
]

API_GROUP = "kiln.dev"
API_VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"
MANAGED_BY = f"{API_GROUP}/operator"
"""`spec.managedBy` of the jobs Kiln's operator runs (also when unset)."""

_Model = Model


# ----------------------------------------------------------------------------------------- tasks


class TaskGenerator(_Model):
    """Procedurally generated tasks (built-in environments only)."""

    count: int = Field(ge=1)
    """Tasks in the set."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same tasks."""
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


BuiltinEnv = Literal["chain", "lookup", "terminal", "swe", "search", "code", "wide", "wide-lookup"]
#: Built-in environments whose tasks can be generated (`generate`) rather than read from a file.
GENERATED_ENVS = ("chain", "lookup", "wide", "wide-lookup")


class PluginRef(_Model):
    """A user's plugin: `module.path:Name` importable where the sandbox service runs (for a
    local run, with its folder on PYTHONPATH), or the name of an entry point of the group
    `kiln.environments` (environments) or `kiln.rewards` (rewards)."""

    plugin: str = Field(min_length=1, pattern=r"^[A-Za-z_][\w.-]*(:[A-Za-z_]\w*)?$")
    """The reference, e.g. `my_pkg.my_env:MyEnv`."""


class TaskSetSpec(_Model):
    """A named set of tasks of one environment."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Name stages refer to (lowercase letters, digits, dashes)."""
    env: BuiltinEnv | PluginRef
    """The environment: a built-in one by name (`chain`, the quickstart's multi-step calculator;
    `lookup`, the terminal quickstart's; `terminal`, `swe`, `search`, `code`), or a user's
    `{plugin: "module:Class"}`. It fixes the prompt, the tools offered and the grade."""
    path: str | None = None
    """JSONL file of task records (format per environment: docs/guides/environments.md); locally, a
    relative path is relative to the job file's folder."""
    source: TaskSource | None = None
    """Where a cluster keeps the task file instead: a ConfigMap key, a file on a PVC or in an
    OCI image, which the operator brings into the pods that read task sets
    (`kiln.api.task_sources`)."""
    generate: TaskGenerator | None = None
    """Generate tasks instead of reading `path` (built-in `chain` and `lookup` only)."""
    reward: PluginRef | None = None
    """A custom reward, `{plugin: "module:function"}`: called with (task, grade, transcript)
    after the environment's own grade, it returns the reward (a number, or a `kiln.env.Grade`
    whose parts are kept beside the environment's)."""
    tool_latency: ToolLatency | None = None
    """Time added to each tool call, run in the sandbox (benchmarks of environment latency)."""
    reward_rules: RewardRules | None = None
    """Rule-based components added to the reward (answer regex, answer length, well-formed
    replies), each weighted, each score kept on the trajectory."""

    @model_validator(mode="before")
    @classmethod
    def _source_path(cls, data):  # type: ignore[no-untyped-def]
        # `source: {path: F}` is the simple case spelled the long way: the same as `path: F`.
        source = data.get("source") if isinstance(data, dict) else None
        if isinstance(source, dict) and set(source) == {"path"} and data.get("path") is None:
            return {**{k: v for k, v in data.items() if k != "source"}, "path": source["path"]}
        return data

    @model_validator(mode="after")
    def _source(self) -> TaskSetSpec:
        given = [name for name, value in (("path", self.path), ("source", self.source),
                                          ("generate", self.generate)) if value is not None]
        if len(given) != 1:
            raise ValueError("exactly one of path, source or generate must be set"
                             + (f" (found {', '.join(given)})" if given else ""))
        if self.generate is not None and self.env not in GENERATED_ENVS:
            raise ValueError(f"generate is only available for env {' or '.join(GENERATED_ENVS)}, "
                             f"not {self.env_name!r}")
        return self

    @property
    def env_name(self) -> str:
        """The built-in name, or the plugin reference."""
        return self.env if isinstance(self.env, str) else self.env.plugin


# --------------------------------------------------------------------------------------- stages


class EvalSpec(_Model):
    """Held-out evaluation of a stage: greedy and sampled success before and after it, and in an
    RL stage the guard rails (`every`, `select`, `stopOnRegression`; `kiln.api.guard`)."""

    tasks: list[str] = Field(default_factory=list)
    """Held-out task sets evaluated before the stage and after it."""
    samples: int = Field(1, ge=1)
    """Sampled attempts per task, besides one greedy attempt."""
    before: bool = True
    """Also evaluate before the stage (false: after it only, e.g. when every stage of a chain
    is evaluated and the previous stage's "after" is this one's "before")."""
    every: int | None = Field(None, ge=1)
    """RL stages: also evaluate every this many optimizer steps inside the stage (the trainer
    waits at that step, with its weights published and checkpointed, until it is done)."""
    select: SelectSpec | None = None
    """RL stages: end the stage with the evaluated checkpoint of the best score (the step before
    the stage, if evaluated, every `every` steps, and the last), not necessarily its last step:
    the stage's export, the next stage and final-hf start from it."""
    stop_on_regression: RegressionSpec | None = None
    """RL stages: stop early, rolled back to the best checkpoint (by `select`, else by this
    rule's metric), once the score has fallen `drop` below its best for `patience` evaluations
    in a row."""


class _StageBase(_Model):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Stage name, unique in the job (status and metrics carry it)."""
    tasks: list[str] = Field(min_length=1)
    """Names of entries in `spec.tasks` to train on."""
    max_steps: int = Field(100, ge=1)
    """Optimizer steps the stage takes."""
    learning_rate: float = Field(1e-5, gt=0, le=1)
    """Peak learning rate (after warm-up)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to learningRate over this many steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep learningRate, or decay it along a cosine to minLrRatio at maxSteps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine schedule ends at learningRate * minLrRatio."""
    batch_size: int = Field(32, ge=1)
    """Trajectories per optimizer step."""
    micro_batch_size: int = Field(8, ge=1)
    """Trajectories per forward/backward pass; must divide batchSize."""
    eval: EvalSpec | None = None
    """Held-out evaluation before and after the stage."""

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
    """`sft`."""


class RLStage(_StageBase):
    """Reinforcement learning with verifiable rewards."""

    type: Literal["rl"]
    """`rl`."""
    tasks: list[str] = Field(default_factory=list)
    """Names of entries in `spec.tasks` whose episodes rollout plays and the stage trains on.
    Empty: the stage trains on the episodes an outside agent plays through the OpenAI
    endpoint alone (`rollout.openaiPort`; rewarded with the stage's `rl.groupSize`)."""
    kind: Literal["reasoning", "agentic", "general"] | None = None
    """What the stage trains, in a staged pipeline's terms (GLM-5's reasoning, agentic and
    general RL): a label the run's summary shows (`stages`); the settings say how it trains."""
    rl: RLSettings = Field(default_factory=RLSettings)
    """Group size, policy loss, freshness, weight sync and advantage settings."""
    swarm: SwarmSettings | None = None
    """Train an orchestrator whose subagents run a frozen checkpoint (`kiln.swarm`)."""


class OPDStage(RLStage):
    """On-policy distillation: an RL stage whose advantage is the teachers' (`rl.advantage`
    is `opd`, and need not be written); `rl.teacher` or `rl.teachers` names them."""

    type: Literal["opd"]  # type: ignore[assignment]
    """`opd`."""

    @model_validator(mode="before")
    @classmethod
    def _distils(cls, data):  # type: ignore[no-untyped-def]
        rl = data.get("rl") if isinstance(data, dict) else None
        if isinstance(rl, dict):
            if rl.get("advantage", "opd") != "opd":
                raise ValueError(f"rl.advantage: an opd stage distils (advantage 'opd'), "
                                 f"found {rl['advantage']!r}")
            return {**data, "rl": {**rl, "advantage": "opd"}}  # the caller's dict left as it is
        if isinstance(data, dict) and rl is None:
            raise ValueError("rl: an opd stage needs rl.teacher or rl.teachers")
        return data


Stage = Annotated[SFTStage | RLStage | OPDStage, Field(discriminator="type")]


# ------------------------------------------------------------------------------------------- job


class RLJobSpec(_Model):
    """What to train, on which tasks, in which stages, and with which services."""

    model: ModelSpec
    """The policy model the job starts from."""
    tasks: list[TaskSetSpec] = Field(min_length=1)
    """Task sets the stages train and evaluate on."""
    stages: list[Stage] = Field(min_length=1)
    """Run in order; each starts from the previous stage's final weights."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """The rollout service (inference engines and the agent loop)."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """The trainer service (Megatron-core)."""
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    """The sandbox service (where tool calls run) and its per-sandbox limits."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    """The weight-sync service."""
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    """The trajectory buffer."""
    checkpoints: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """The trainer's checkpoint volume."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment tracking (TensorBoard, Weights & Biases)."""
    output: OutputSpec | None = None
    """Where each stage's model (a Hugging Face checkpoint), the summary and the job file go
    (`kiln.api.outputs`); `kiln export` reads the model from there."""
    image: str = "ghcr.io/kiln-dev/kiln:0.1.0"
    """Image the services run from (cluster only)."""
    suspend: bool = False
    """Scale every component to zero, keeping checkpoints and buffer. A job created suspended
    starts no pod until this is false: the admission gate a queue such as Kueue opens (with
    the `kueue.x-k8s.io/queue-name` label on the RLJob)."""
    active_deadline_seconds: int | None = Field(None, ge=1)
    """Wall-clock seconds the job may run, counted from `status.startTime` (set again on each
    resume): past it the job fails with reason DeadlineExceeded and its pods are stopped.
    Under `kiln run`, counted from the run's (or resume's) start: the run stops as on Ctrl-C
    and ends Failed, `summary.json` saying DeadlineExceeded."""
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    """Delete the RLJob this many seconds after it finished (`status.completionTime`),
    Succeeded or Failed; its PVCs follow their `retain` settings. Unset: kept. Cluster only:
    `kiln run` says so and keeps its run directory."""
    managed_by: str | None = Field(None, max_length=63,
                                   pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-A-Za-z0-9_.]+$")
    """The controller that runs this job, as a domain-prefixed name; unset or
    `kiln.dev/operator`: Kiln's operator. Any other (e.g. `kueue.x-k8s.io/multikueue`, which
    runs it on a worker cluster) and Kiln's operator leaves the job alone. Cannot change."""
    seed: int = 0
    """Seed of the task streams, sampling and initialisation."""

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
            if (isinstance(stage, RLStage) and stage.rl.teacher_top_k
                    and self.trainer.tensor_parallel > 1):
                raise ValueError(
                    f"stages[{i}] ({stage.name}): rl.teacherTopK needs trainer.tensorParallel 1 "
                    f"(the dense term takes the log-softmax of the whole vocabulary on one rank)")
            if isinstance(stage, RLStage) and not stage.tasks and (
                    stage.type != "rl" or stage.swarm is not None or not self.rollout.openai_port):
                raise ValueError(
                    f"stages[{i}] ({stage.name}): tasks is empty; only a plain rl stage may train "
                    "on outside episodes alone, and only with rollout.openaiPort set (their "
                    "source); name the task sets it plays")
            if isinstance(stage, RLStage) and stage.batch_size % stage.rl.group_size:
                raise ValueError(
                    f"stages[{i}] ({stage.name}): batchSize ({stage.batch_size}) must be a "
                    f"multiple of rl.groupSize ({stage.rl.group_size})"
                )
        if self.rollout.sampling.tool_choice_temperature is not None and self.trainer.tensor_parallel > 1:
            raise ValueError("rollout.sampling.toolChoiceTemperature needs trainer.tensorParallel 1 "
                             "(a tool choice's log-softmax takes the whole vocabulary on one rank)")
        problems = (teacher_problems(self) + swarm_problems(self) + guard_problems(self)
                    + lora_problems(self.model.lora, stage_names))
        if problems:
            raise ValueError(problems[0])
        return self

    def is_stage(self, teacher: str) -> bool:
        """Whether a teacher reference names one of the job's stages (its final weights)."""
        return teacher in {s.name for s in self.stages}


class ObjectMeta(BaseModel):
    """The parts of Kubernetes metadata Kiln reads; everything else passes through."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str | None = None


class RLJob(BaseModel):
    """A reinforcement-learning job for an LLM agent."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["kiln.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLJob"]
    metadata: ObjectMeta
    spec: RLJobSpec
    status: dict | None = None
    """Written by the operator; ignored on input."""
