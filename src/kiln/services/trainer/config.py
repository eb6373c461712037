"""Typed configuration of the trainer service (what the operator or the local launcher fills in
from an RLJob's trainer section)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from kiln.api.capabilities import spec_refusals
from kiln.api.loss import Correction, Loss, MaskedLoss
from kiln.api.model import LoraSpec
from kiln.api.spec import RLJob, RLStage


class OptimizerConfig(BaseModel):
    """AdamW with a linear warm-up to a constant learning rate."""

    lr: float = Field(1e-5, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still reported)."""
    reset_moments_on_publish: bool = True
    """Zero AdamW's first and second moments (and its step count) after each weight publish."""


class RLTerms(BaseModel):
    """What the trainer's RL step reads besides the policy loss (`TrainerConfig.loss`, the
    RLJob's `rl.loss` as it is): the stage's advantage and penalty settings, which the API keeps
    flat in `rl`, and two constants of `rollout.sampling`. Only what the trainer needs, under
    the API's names; SFT stages keep the defaults."""

    advantage_norm: Literal["mean", "mean-std"] = "mean"
    """`rl.advantageNorm`."""
    task_reward_weight: float = Field(0.0, ge=0.0)
    """`rl.taskRewardWeight` (on-policy distillation)."""
    sampled_weight: float = Field(1.0, ge=0.0)
    """`rl.sampledWeight` (on-policy distillation)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """`rl.klCoef`: weight of the KL penalty to the reference, whose log-probs the trajectories
    then carry instead of a teacher's."""
    kl_clamp: float | None = Field(10.0, gt=0.0)
    """`rl.klClamp`: the bound on each token's k3 estimate (None: unbounded)."""
    correction: Correction | None = None
    """`rl.correction`: rollout correction weights (None: none)."""
    dense_weight: float = Field(0.0, ge=0.0)
    """`rl.denseWeight` where `rl.teacherTopK` is set, else 0: weight of the forward KL on the
    teacher's top k (`kiln.services.trainer.distill`)."""
    temperature: float = Field(1.0, gt=0.0)
    """The policy's log-probs are of softmax(logits / temperature): rollout's sampling one."""
    seq_sum_tokens: int = Field(1024, ge=1)
    """`rollout.sampling.maxTotalTokens`: what `sequence-sum` divides each sequence's loss by."""


class TrainerConfig(BaseModel):
    model_dir: Path
    """Hugging Face checkpoint (config.json + safetensors + tokenizer) to start from."""
    tensor_parallel: int = Field(1, ge=1)
    data_parallel: int = Field(1, ge=1)
    """Replicas of the TP group, each training on a share of every batch's rows."""
    expert_parallel: int = Field(1, ge=1)
    """MoE: data-parallel replicas each MoE layer's experts are split over (divides
    `data_parallel`; `kiln.models.parallel`)."""
    collective_timeout_s: float | None = None
    """Bound on one collective (torch's default when None)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["sdpa", "megatron"] = "sdpa"
    """Core attention: PyTorch's fused causal SDPA, or Megatron's local unfused version."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per forward/backward pass; gradients of a batch's micro-batches are summed."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Packing: micro-batches of at most this many tokens, their sequences concatenated into
    one row with no padding (`kiln.models.packing`), instead of `micro_batch_size` padded rows;
    a longer sequence goes alone. None: padded micro-batches."""
    minibatches_per_step: int = Field(1, ge=1)
    """Optimizer updates per `step(batch)`: the batch is split into this many parts. With more
    than one, the log-probs of the weights at the start of the step (`logp_train_old`, used by
    IcePop) differ from the current ones in later updates."""
    loss: Loss = Field(default_factory=MaskedLoss)
    """The stage's policy loss, `rl.loss` as the RLJob writes it (SFT: the default, whose
    aggregation the cross-entropy takes)."""
    terms: RLTerms = RLTerms()
    """The RL step's other settings (advantages, penalties, temperature)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint_dir: Path | None = None
    """Where `step_*` checkpoints go; the latest one there is resumed on start."""
    checkpoint_interval: int = Field(0, ge=0)
    """Checkpoint every this many steps; 0 = only on request."""
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    lora: LoraSpec | None = None
    """Train a LoRA adapter on the frozen model (`kiln.models.lora`; RLJob spec.model.lora)."""
    routing_replay: Literal["off", "record", "replay"] = "replay"
    """MoE models: replay the rollout's routing, only count flips, or ignore it (RLJob
    spec.model.routingReplay)."""

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.checkpoint_interval and self.checkpoint_dir is None:
            raise ValueError("checkpoint_interval is set but checkpoint_dir is not")
        if self.expert_parallel > 1 and self.lora is not None:
            raise ValueError("spec.trainer.expertParallel > 1 with spec.model.lora: LoRA adapters train "
                             "with expertParallel 1 only")
        return self


def stage_by_name(job: RLJob, name: str | None):
    """The stage called `name`, or the job's first stage when `name` is None."""
    if name is None:
        return job.spec.stages[0]
    for stage in job.spec.stages:
        if stage.name == name:
            return stage
    raise ValueError(f"stage {name!r} is not in spec.stages ({[s.name for s in job.spec.stages]})")


def config_from_job(job: RLJob, *, run_dir: Path, stage: str | None = None, model_dir: Path | None = None) -> TrainerConfig:
    """The trainer configuration an RLJob asks for, for stage `stage` (default: the first).

    Learning rate and micro-batch size come from the stage, the loss (`rl.loss`, as it is) and
    the advantage and penalty settings from its `rl` section (SFT stages keep the defaults,
    unused but for the aggregation), everything else from `spec.trainer`.
    Checkpoints go to `<run_dir>/checkpoints`. `model_dir` overrides `spec.model.path`.
    """
    st = stage_by_name(job, stage)
    t = job.spec.trainer
    refused = spec_refusals(job.spec)  # a job built in-process skipped the file's validation
    if refused:
        raise ValueError(str(refused[0]))
    loss: Loss = MaskedLoss()
    terms = RLTerms()
    reset = True
    minibatches = 1
    if isinstance(st, RLStage):
        rl = st.rl
        loss = rl.loss
        terms = RLTerms(
            advantage_norm=rl.advantage_norm,
            task_reward_weight=rl.task_reward_weight,
            sampled_weight=rl.sampled_weight,
            kl_coef=rl.kl_coef,
            kl_clamp=rl.kl_clamp,
            correction=rl.correction,
            dense_weight=rl.dense_weight if rl.teacher_top_k else 0.0,
            # Rollout records log-probs at its temperature (raw for 0 and 1): so does the trainer.
            temperature=s.temperature if (s := job.spec.rollout.sampling).tempered else 1.0,
            seq_sum_tokens=job.spec.rollout.sampling.max_total_tokens,
        )
        reset = rl.reset_optimizer_on_sync
        minibatches = rl.minibatches
    return TrainerConfig(
        model_dir=model_dir if model_dir is not None else job.spec.model.local_path(),
        tensor_parallel=t.tensor_parallel,
        data_parallel=t.data_parallel,
        expert_parallel=t.expert_parallel,
        params_dtype=job.spec.model.dtype,
        micro_batch_size=st.micro_batch_size,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        minibatches_per_step=minibatches,
        loss=loss,
        terms=terms,
        optimizer=OptimizerConfig(
            lr=st.learning_rate, weight_decay=t.weight_decay, grad_clip=t.grad_clip, reset_moments_on_publish=reset,
            betas=(t.adam_beta1, t.adam_beta2),
        ),
        checkpoint_dir=Path(run_dir) / "checkpoints",
        checkpoint_interval=t.checkpoint_interval,
        keep_checkpoints=t.keep_checkpoints,
        routing_replay=job.spec.model.routing_replay,
        lora=job.spec.model.lora if job.spec.model.lora and job.spec.model.lora.trains(st.name) else None,
        seed=job.spec.seed,
    )
