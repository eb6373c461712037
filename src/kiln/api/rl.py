"""The RL algorithm's settings of one stage (`spec.stages[].rl`): group size, the policy loss
(`rl.loss`, `kiln.api.loss`), freshness, weight sync, advantages and distillation teachers.
Torch-free, like the rest of the spec; the trainer takes `rl.loss` as it is and reads the rest
in `src/kiln/services/trainer/config.py`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.api.components import Model, TeacherSpec
from kiln.api.loss import Correction, Loss, MaskedLoss, correction_refusal

MOVED_TO_LOSS: dict[str, str] = {
    "lossMode": "mode", "epsLow": "epsLow", "epsHigh": "epsHigh", "dualClip": "dualClip",
    "icepopBeta": "icepopBeta", "lossAggregation": "aggregation",
}
"""Fields `rl` had before the loss became one section: old name -> its name under `rl.loss`
(`kiln validate` names the new place)."""


class RLSettings(Model):
    """The RL algorithm's knobs."""

    group_size: int = Field(8, ge=2)
    """G: samples per task; advantages are relative to the group mean."""
    loss: Loss = Field(default_factory=MaskedLoss)
    """The policy loss, by `mode` (`masked` when left out); each mode has its own fields."""
    correction: Correction | None = None
    """Rollout correction: importance weights to the inference policy at the token, sequence or
    geometric level, truncated (TIS) or masked (rejection), on top of the loss's own masks;
    null (the default): none. See "Off-policy corrections" in docs/concepts/algorithms.md."""
    # Not in the loss: the trainer splits a step's batch into this many updates in either mode,
    # and masked mode can use it too (a later update's ratio to the inference policy grows, and
    # its window bounds it); only ppo needs it, for its two ratios to differ.
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per step, each on a share of the batch (the trainer's log-probs at the
    start of the step are what ppo's ratio and IcePop compare against, so ppo wants more than
    one)."""
    tau: int = Field(4, ge=0)
    """Freshness: drop a trajectory whose oldest policy version is more than tau behind."""
    sync_interval: int = Field(1, ge=1)
    """Publish weights to rollout every this many optimizer steps."""
    reset_optimizer_on_sync: bool = True
    """Reset AdamW's first and second moments after each weight publish."""
    advantage_norm: Literal["mean", "mean-std"] = "mean"
    """`mean`: a trajectory's advantage is its reward minus its group's mean (Dr. GRPO keeps it
    so); `mean-std`: also divided by the sample standard deviation (n - 1) of its group's rewards
    (GRPO as first published, and verl's and slime's `torch.std`; a group whose rewards are all
    equal keeps advantage 0)."""
    advantage: Literal["group", "opd"] = "group"
    """`group`: reward minus group mean; `opd`: per-token teacher minus student log-prob."""
    teacher: str | None = None
    """The teacher (required when advantage is opd): the name of an earlier stage, whose final
    weights it is, or a Hugging Face checkpoint directory."""
    teachers: list[TeacherSpec] = Field(default_factory=list)
    """opd: a teacher per group of the stage's task sets, instead of `teacher` for all of them;
    each task set has exactly one."""
    task_reward_weight: float = Field(0.0, ge=0.0)
    """opd: weight of the group-relative task advantage added to every token's distillation
    advantage (teacher minus student log-prob); 0 distils only."""
    sampled_weight: float = Field(1.0, ge=0.0)
    """opd: weight of the sampled-token advantage (teacher minus student log-prob of each token
    the student sampled). 0 with teacherTopK distils from the teacher's top k alone, a forward
    KL on the student's own trajectories (GKD's): no per-token advantages of -20 on tokens the
    teacher would never write, which at a high learning rate shake what the student knows."""
    teacher_top_k: int = Field(0, ge=0, le=64)
    """opd: also distil densely. The teacher returns its k most likely tokens at every trained
    position, and each such token's loss gets `denseWeight * sum_j q_j (log q_j - log
    pi_theta(j))`: the teacher's top k, renormalised to q, against the student (forward KL on
    the teacher's top k, reported as `dense_kl`). This reaches tokens the student no longer
    samples, which the sampled-token advantage cannot. 0 (the default): sampled tokens only."""
    dense_weight: float = Field(1.0, ge=0.0)
    """opd with teacherTopK: weight of the dense term in each trained token's loss."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of a KL penalty to `reference`: every trained token's loss gets
    `klCoef * KL(pi_theta || pi_ref)`, the k3 estimate `exp(d) - d - 1` with
    `d = log pi_ref - log pi_theta` (GRPO's), from the reference's log-probs of the sampled
    tokens; 0 (the default) has no reference and no penalty."""
    kl_clamp: float | None = Field(10.0, gt=0.0)
    """klCoef: each token's k3 estimate is clamped at this value, so a token whose reference
    log-prob is far above the policy's (k3 grows as exp(d)) adds at most `klCoef * klClamp` to
    the loss and no gradient beyond it; 10 is verl's (`low_var_kl`) and slime's bound. null: no
    clamp (the log-ratio is still clamped at +-20)."""
    reference: str | None = None
    """The frozen reference of `klCoef` (advantage group only): an earlier stage's name, whose
    final weights it is, or a Hugging Face checkpoint directory; served like a distillation
    teacher, scoring every trajectory of the stage."""
    asynchronous: bool = Field(True, alias="async")
    """Rollout keeps generating while the trainer steps; false pauses rollout during training."""

    @model_validator(mode="after")
    def _opd(self) -> RLSettings:
        if (why := correction_refusal(self.correction, self.loss)) is not None:
            raise ValueError(why)
        if self.advantage == "opd" and bool(self.teacher) == bool(self.teachers):
            raise ValueError("advantage 'opd' needs a teacher: set teacher or teachers (not both)")
        if self.teachers and self.advantage != "opd":
            raise ValueError("teachers applies to advantage 'opd' only")
        if self.task_reward_weight and self.advantage != "opd":
            raise ValueError("taskRewardWeight applies to advantage 'opd' only")
        if self.sampled_weight != 1.0 and self.advantage != "opd":
            raise ValueError("sampledWeight applies to advantage 'opd' only")
        if (self.advantage == "opd" and not self.sampled_weight and not self.teacher_top_k
                and not self.task_reward_weight):
            raise ValueError("sampledWeight 0 leaves an opd stage nothing to learn from: "
                             "set teacherTopK (dense distillation) or taskRewardWeight")
        if self.teacher_top_k and self.advantage != "opd":
            raise ValueError("teacherTopK applies to advantage 'opd' only (it is the teacher's)")
        if bool(self.kl_coef) != bool(self.reference):
            raise ValueError("klCoef and reference go together: a KL penalty needs the reference "
                             "it is measured to, and a reference is only used by the penalty")
        if self.reference and self.advantage != "group":
            raise ValueError("reference (a KL penalty) applies to advantage 'group' only; an opd "
                             "stage's teacher already pulls the policy towards it")
        return self
