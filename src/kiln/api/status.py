"""The RLJob's status: what `kubectl get rljobs` shows, written by the operator (and by the
launcher locally). Part of the RLJob API; import it from `kiln.api.spec`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.components import Model

Phase = Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(Model):
    """One observation of the job's state, as a Kubernetes `metav1.Condition`."""

    type: str = Field(max_length=316)
    """What the condition is about: `Valid` (the spec was accepted), `Ready` (the trainer and
    buffer serve) or `Driving` (the stages are being run; False once they ended, and why)."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """One CamelCase word saying why (`DeadlineExceeded`, `Suspended`, `Completed`, ...)."""
    message: str = Field(max_length=32768)
    """Details for a human."""
    last_transition_time: str
    """RFC 3339 time the status last changed."""
    observed_generation: int | None = Field(None, ge=0)
    """The metadata.generation of the spec the condition was set from."""


class EvaluationResult(Model):
    """One held-out evaluation, before or after a stage."""

    policy_version: int = 0
    """The policy version evaluated."""
    tasks: int = 0
    """How many tasks of the set were run."""
    greedy_success: float = 0.0
    """Fraction solved with greedy decoding."""
    sampled_success: float = 0.0
    """Fraction solved with the stage's sampling temperature."""
    seconds: float = 0.0
    """How long the evaluation took."""
    critical_path_steps: float = 0.0
    """Agent swarm task sets: mean critical-path steps per episode (0 for others)."""
    critical_path_steps_answered: float = 0.0
    """The same over the episodes that answered only (0 if none did)."""
    pass_at_k: dict[str, float] = Field(default_factory=dict)
    """pass@k by k (1, 2, 4, ... up to eval.samples): the chance that one of k sampled attempts
    at a task succeeds, estimated without bias from the attempts and averaged over tasks."""


class CheckpointSelection(Model):
    """The checkpoint a guarded RL stage ended with (`eval.select`, `eval.stopOnRegression`)."""

    step: int = 0
    """The stage step whose weights the stage ended with (0: those it started from)."""
    reason: str = ""
    """Why that step."""
    stopped: bool = False
    """The stage was stopped early on a regression and rolled back."""


class RLJobStatus(Model):
    """What `kubectl get rljobs` shows; written by the operator, by the launcher locally."""

    phase: Phase = "Pending"
    """Pending, Running, Succeeded, Failed or Suspended."""
    conditions: list[Condition] = Field(default_factory=list)
    """The Valid, Ready and Driving conditions."""
    stage: str | None = None
    """The stage the trainer is running."""
    policy_version: int = 0
    """The policy version the trainer holds."""
    step: int = 0
    """Optimizer steps taken in the current stage."""
    reward: float | None = None
    """Mean reward of the last training batch."""
    observed_staleness: int | None = None
    """Largest (trainer version - oldest trajectory version) among trajectories trained on."""
    last_weight_sync: str | None = None
    """RFC 3339 time of the last completed weight publish."""
    message: str = ""
    """Why the job is in its phase, when that needs saying."""
    observed_generation: int | None = None
    """The metadata.generation of the spec the status describes."""
    start_time: str | None = None
    """RFC 3339 time the job's pods were first asked for; set again when a suspended job
    resumes (`spec.activeDeadlineSeconds` counts from it). Unset while suspended from the
    start."""
    completion_time: str | None = None
    """RFC 3339 time the job finished, Succeeded or Failed (`spec.ttlSecondsAfterFinished`
    counts from it)."""
    finished_stages: list[str] = Field(default_factory=list)
    """Stages the driver completed, in order (a restarted operator resumes after them)."""
    evaluations: dict[str, EvaluationResult] = Field(default_factory=dict)
    """Held-out results keyed "stage/before|after/task set" (and "stage/step-N/task set" for
    the evaluations inside a stage, `eval.every`)."""
    selections: dict[str, CheckpointSelection] = Field(default_factory=dict)
    """Guarded RL stages: the checkpoint each ended with, and why."""
    rollout_replicas: int | None = None
    """Rollout replicas applied (the scale subresource's status replicas)."""
    rollout_selector: str | None = None
    """Label selector of the rollout pods (the scale subresource's, for an HPA)."""
