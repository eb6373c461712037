"""Every metric Kiln reports, defined once: its name, unit and meaning, and the Prometheus series
it is exported as, if any.

One name per concept, everywhere. A step's metrics are the typed record `StepMetrics`: its
field names are the keys of the trainer's part of `metrics.jsonl`, the run report's columns,
the tracker tags (`train/<name>` in TensorBoard and W&B) and the fields of
`kiln.v1.StepMetrics` on the wire; a field that Prometheus exports names its series here too.
The other series (services, sandboxes, the operator) are `SERIES`. The Grafana dashboard and
the PrometheusRule alerts in `charts/kiln` are written against these series names, and
`tests/unit/test_metric_names.py` walks the code, the chart and this registry to keep it the
only definition.

Torch-free and free of prometheus_client: the processes that export a series build it with
`prometheus(metric)`, once (`kiln.services.common.metrics`, `kiln.operator.metrics`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Kind = Literal["gauge", "counter", "histogram"]

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class Metric:
    name: str
    """The one name: a `StepMetrics` field, a metrics.jsonl key, a tracker tag `train/<name>`."""
    unit: str
    help: str
    series: str = ""
    """The Prometheus series it is exported as ("" for none)."""
    kind: Kind = "gauge"
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    rl_only: bool = False
    """A step metric that means something in RL steps only (masks, drift, reward): None in
    supervised steps, and not tracked there."""


def _step(unit: str, help: str, series: str = "", *, kind: Kind = "gauge",
          labels: tuple[str, ...] = (), buckets: tuple[float, ...] = (), rl_only: bool = False,
          default: Any = None) -> Any:
    """A `StepMetrics` field and its definition (the name is the field's)."""
    spec = dict(unit=unit, help=help, series=series, kind=kind, labels=labels, buckets=buckets,
                rl_only=rl_only)
    return field(default=default, metadata={"metric": spec})


@dataclass
class StepMetrics:
    """One optimizer step, as the trainer reports it (`TrainerEngine.step`); a field is None
    where the step did not measure it (an RL-only metric in a supervised step)."""

    step: int = _step("steps", "Optimizer steps taken, all stages together",
                      "kiln_train_step", labels=("stage",), default=0)
    policy_version: int = _step("version", "Policy version a component currently holds",
                                "kiln_policy_version", labels=("component",), default=0)
    loss: float = _step("loss", "Loss of the last optimizer step", "kiln_train_loss",
                        labels=("stage",), default=0.0)
    grad_norm: float = _step("norm", "Gradient norm of the last optimizer step (before clipping)",
                             "kiln_train_grad_norm", default=0.0)
    lr: float = _step("lr", "Learning rate of the step", default=0.0)
    sequences: int = _step("sequences", "Trajectories trained on in the step", default=0)
    tokens: int = _step("tokens", "Tokens trained on (loss-masked)", "kiln_train_tokens_total",
                        kind="counter", default=0)
    step_seconds: float = _step("seconds", "Wall time of one optimizer step",
                                "kiln_train_step_seconds", kind="histogram",
                                buckets=SECONDS_BUCKETS, default=0.0)
    tokens_per_second: float = _step(
        "tokens/s", "Tokens (all positions, prompt included) per second, last step",
        "kiln_trainer_tokens_per_second", default=0.0)
    wait_seconds: float = _step("seconds", "Time the trainer waited for the step's batch "
                                "(what rollout autoscaling reads)",
                                "kiln_trainer_idle_seconds_total", kind="counter", default=0.0)
    reward_mean: float | None = _step("reward", "Mean reward of the last training batch",
                                      "kiln_reward_mean", rl_only=True)
    ratio_mask_frac: float | None = _step(
        "fraction", "Fraction of trained tokens masked by the double-sided ratio mask",
        "kiln_ratio_mask_fraction", rl_only=True)
    icepop_mask_frac: float | None = _step(
        "fraction", "Fraction of trained tokens masked by IcePop", "kiln_icepop_mask_fraction",
        rl_only=True)
    ratio_only_frac: float | None = _step(
        "fraction", "Fraction of trained tokens masked by the ratio mask alone",
        "kiln_ratio_only_mask_fraction", rl_only=True)
    icepop_only_frac: float | None = _step(
        "fraction", "Fraction of trained tokens masked by IcePop alone",
        "kiln_icepop_only_mask_fraction", rl_only=True)
    both_masked_frac: float | None = _step(
        "fraction", "Fraction of trained tokens masked by both masks", "kiln_both_masks_fraction",
        rl_only=True)
    kept_frac: float | None = _step(
        "fraction", "Fraction of trained tokens that carry gradient", rl_only=True)
    ratio_mean: float | None = _step(
        "ratio", "Mean importance ratio of the tokens that carry gradient", rl_only=True)
    mismatch_abs: float | None = _step(
        "nats", "Mean |train log-prob - inference log-prob| of the same policy version",
        "kiln_logprob_mismatch_abs_mean", rl_only=True)
    mismatch_kl: float | None = _step(
        "nats", "KL(inference || train) estimate over trained tokens",
        "kiln_logprob_mismatch_kl", rl_only=True)
    kl_ref: float | None = _step(
        "nats", "KL(policy || reference) estimate per trained token (rl.klCoef)", "kiln_kl_ref",
        rl_only=True)
    dense_kl: float | None = _step(
        "nats", "Forward KL from the teacher's top k per trained token (dense distillation)",
        "kiln_dense_kl", rl_only=True)
    routing_flip_frac: float | None = _step(
        "fraction", "MoE: fraction of (token, layer) pairs of the last step whose trainer top-k "
        "differs from the experts rollout recorded (replayed or not); measured in supervised "
        "steps too, on demonstrations rollout generated", "kiln_moe_routing_flip_fraction")
    routing_straddle_frac: float | None = _step(
        "fraction", "MoE with routing replayed: fraction of trained tokens left out of the loss "
        "because the weights changed inside their generation, so the routing recorded for them "
        "is a newer version's", "kiln_moe_routing_straddle_fraction", rl_only=True)
    correction_mask_frac: float | None = _step(
        "fraction", "Fraction of trained tokens dropped by the rollout correction's mask "
        "(rl.correction)", "kiln_correction_mask_fraction", rl_only=True)
    correction_weight_mean: float | None = _step(
        "ratio", "Mean rollout-correction weight of the tokens it kept (rl.correction)",
        rl_only=True)
    staleness: dict[int, int] = field(default_factory=dict, metadata={"metric": dict(
        unit="trajectories", help="Trajectories of the step by staleness (versions behind the "
        "trainer when the buffer served them)", series="", kind="gauge", labels=(), buckets=(),
        rl_only=True)})

    def scalars(self, *, rl: bool) -> dict[str, float]:
        """The step's numbers by name, for trackers: measured ones only, the RL-only ones for RL
        steps only (in supervised steps they mean nothing), the staleness counts summed up as
        `staleness_mean` and `staleness_max`."""
        out = {m.name: float(getattr(self, m.name)) for m in STEP.values()
               if m.name != "staleness" and getattr(self, m.name) is not None
               and (rl or not m.rl_only)}
        n = sum(self.staleness.values())
        if rl and n:
            out["staleness_mean"] = sum(k * v for k, v in self.staleness.items()) / n
            out["staleness_max"] = float(max(k for k, v in self.staleness.items() if v))
        return out

    def record(self) -> dict[str, Any]:
        """As a JSON record (metrics.jsonl, checkpoints): every field under its name."""
        out = dataclasses.asdict(self)
        out["staleness"] = {str(k): v for k, v in self.staleness.items()}
        return out

    @classmethod
    def from_record(cls, rec: dict[str, Any] | None) -> StepMetrics:
        """The inverse of `record`; keys it does not know (an older trainer's) are ignored."""
        rec = dict(rec or {})
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in rec.items() if k in known and k != "staleness"}
        staleness = {int(k): int(v) for k, v in (rec.get("staleness") or {}).items()}
        return cls(**values, staleness=staleness)


def _step_metrics() -> dict[str, Metric]:
    return {f.name: Metric(name=f.name, **f.metadata["metric"]) for f in fields(StepMetrics)}


STEP: dict[str, Metric] = _step_metrics()
"""The fields of `StepMetrics`, by name."""

DERIVED: dict[str, Metric] = {m.name: m for m in (
    Metric("staleness_mean", "versions", "Mean staleness of the step's trajectories",
           rl_only=True),
    Metric("staleness_max", "versions", "Largest staleness among the step's trajectories",
           rl_only=True),
)}
"""Step metrics computed from the fields (`StepMetrics.scalars`)."""

_S = Metric
SERIES: dict[str, Metric] = {m.name: m for m in (
    _S("service_up", "bool", "1 while the service is serving", "kiln_service_up",
       labels=("service",)),
    _S("rpc_requests", "calls", "RPCs handled", "kiln_rpc_requests_total", "counter",
       ("method", "code")),
    _S("rpc_duration", "seconds", "RPC handling time", "kiln_rpc_duration_seconds", "histogram",
       ("method",), (0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60)),
    # --- policy versions and off-policy drift
    _S("trajectory_staleness", "versions", "Trainer version minus the oldest policy version of a "
       "trajectory, when served for training", "kiln_trajectory_staleness", "histogram",
       buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32)),
    _S("freshness_tau", "versions", "The freshness bound tau of the running RL stage, as the "
       "trainer configures the buffer with it (absent in supervised stages: no bound)",
       "kiln_freshness_tau", labels=("stage",)),
    _S("dropped_stale", "trajectories", "Trajectories dropped by freshness control (tau)",
       "kiln_trajectories_dropped_stale_total", "counter"),
    # --- trainer
    _S("checkpoint_seconds", "seconds", "Wall time of writing one trainer checkpoint",
       "kiln_trainer_checkpoint_seconds", "histogram", buckets=SECONDS_BUCKETS + (300,)),
    _S("nonfinite_steps", "updates", "Optimizer updates skipped because the loss or the gradient "
       "norm was not finite (reason: loss or grad); never applied",
       "kiln_trainer_nonfinite_steps_total", "counter", ("stage", "reason")),
    # --- weight sync
    _S("sync_seconds", "seconds", "Publish-to-applied time of one weight version on one replica",
       "kiln_weight_sync_seconds", "histogram", buckets=(0.01,) + SECONDS_BUCKETS),
    _S("sync_bytes", "bytes", "Weight bytes streamed to replicas",
       "kiln_weight_sync_bytes_total", "counter"),
    _S("sync_failures", "transfers", "Rejected transfers (checksum, truncation)",
       "kiln_weight_sync_failures_total", "counter", ("reason",)),
    # --- buffer
    _S("buffer_depth", "trajectories", "Trajectories waiting to be trained on",
       "kiln_buffer_depth"),
    _S("buffer_leased", "trajectories", "Trajectories in served batches not yet acknowledged",
       "kiln_buffer_leased"),
    _S("batches_redelivered", "batches", "Batches served again after their lease ended without "
       "an acknowledgement", "kiln_buffer_batches_redelivered_total", "counter"),
    _S("buffer_write_errors", "writes", "Writes of the buffer's log that failed (the call was "
       "refused, nothing stored)", "kiln_buffer_write_errors_total", "counter", ("errno",)),
    _S("buffer_unconsumed_bytes", "bytes", "Bytes of trajectories waiting or leased (bounded by "
       "spec.buffer.capacityBytes)", "kiln_buffer_unconsumed_bytes"),
    _S("accepted", "trajectories", "Trajectories accepted by the buffer",
       "kiln_trajectories_accepted_total", "counter"),
    _S("served", "trajectories", "Trajectories served for training",
       "kiln_trajectories_served_total", "counter"),
    _S("teacher_score_seconds", "seconds", "Time to have a group of trajectories scored by the "
       "teacher (on-policy distillation)", "kiln_teacher_score_seconds", "histogram",
       buckets=(0.01,) + SECONDS_BUCKETS[:-1]),
    _S("reward_model_seconds", "seconds", "Time to have one episode scored by its task set's "
       "outcome model and judge (rewardRules)", "kiln_reward_model_seconds", "histogram",
       buckets=(0.01,) + SECONDS_BUCKETS[:-1]),
    _S("judge_unparsed", "verdicts", "Judge verdicts whose final line is not `SCORE: n/10` "
       "(scored 0, never guessed)", "kiln_judge_verdicts_unparsed_total", "counter"),
    _S("teacher_scored_tokens", "tokens", "Tokens scored by the teacher (on-policy "
       "distillation)", "kiln_teacher_scored_tokens_total", "counter"),
    _S("swarm_subagents", "subagents", "Subagents created per orchestrator episode (agent swarm "
       "stages)", "kiln_swarm_subagents", "histogram", buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64)),
    _S("swarm_critical_path_steps", "steps", "Longest chain of dependent model calls per "
       "orchestrator episode", "kiln_swarm_critical_path_steps", "histogram",
       buckets=STEPS_BUCKETS),
    _S("swarm_total_steps", "steps", "Model calls per orchestrator episode, its subagents' "
       "included", "kiln_swarm_total_steps", "histogram", buckets=STEPS_BUCKETS),
    # --- rollout
    _S("rollout_tokens", "tokens", "Tokens generated by rollout", "kiln_rollout_tokens_total",
       "counter"),
    _S("episodes", "episodes", "Finished episodes", "kiln_rollout_episodes_total", "counter",
       ("outcome",)),
    _S("engine_requests", "calls", "Generate calls the inference engine has in progress",
       "kiln_rollout_engine_requests"),
    _S("engine_idle_seconds", "seconds", "Time the inference engine had no generate call in "
       "progress", "kiln_rollout_engine_idle_seconds_total", "counter"),
    _S("episode_reward", "reward", "Reward of finished episodes", "kiln_rollout_reward",
       "histogram", buckets=(0, 0.25, 0.5, 0.75, 1)),
    # --- the rollout fleet's router (its OpenAI endpoint's front door)
    _S("router_requests", "calls", "Calls the router forwarded, by the replica instance that "
       "served them, how it was chosen (episode: the episode's own replica; conversation: by "
       "the conversation's root; new: least loaded; any) and the HTTP status",
       "kiln_router_requests_total", "counter", ("replica", "placement", "code")),
    _S("router_refusals", "calls", "Calls the router answered itself (reason: replica_gone, "
       "no_replica, unauthenticated, too_large)", "kiln_router_refusals_total", "counter",
       ("reason",)),
    _S("router_replica_load", "episodes", "Open episodes plus calls in flight of each rollout "
       "replica, as the router places new episodes by", "kiln_router_replica_load",
       labels=("replica",)),
    _S("router_replicas", "replicas", "Rollout replicas the router knows, by state (serving, "
       "draining, down)", "kiln_router_replicas", labels=("state",)),
    # --- sandbox
    _S("sandbox_start_seconds", "seconds", "Time to create a sandbox",
       "kiln_sandbox_start_seconds", "histogram", ("backend",),
       (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)),
    _S("sandbox_failures", "operations", "Sandbox operations that failed",
       "kiln_sandbox_failures_total", "counter", ("backend", "reason")),
    _S("sandbox_active", "sandboxes", "Sandboxes currently alive", "kiln_sandbox_active",
       labels=("backend",)),
    # --- certificates
    _S("certificate_expiry", "seconds", "When the certificate a service serves with expires "
       "(Unix time); the operator renews it at two thirds of its lifetime",
       "kiln_certificate_expiry_timestamp_seconds", labels=("component",)),
    # --- the operator
    _S("operator_reconciles", "reconciliations", "RLJob reconciliations by outcome",
       "kiln_operator_reconciles_total", "counter", ("result",)),
    _S("operator_jobs", "jobs", "RLJobs known to the operator, by phase", "kiln_operator_jobs",
       labels=("phase",)),
)}
"""The Prometheus series that are not a step's field, by name."""

ALL: dict[str, Metric] = {**STEP, **DERIVED, **SERIES}

STATUS: dict[str, dict[str, Metric]] = {
    "rollout": {m.name: m for m in (
        Metric("mean_reward", "reward", "Mean reward of rollout's recent episodes (its pass rate "
               "where rewards are 0 or 1)"),
        Metric("tokens_per_second", "tokens/s", "Tokens rollout generates per second"),
        Metric("in_flight", "episodes", "Episodes rollout has in progress"),
        Metric("policy_version", "version", "Policy version rollout samples from"),
    )},
    "buffer": {m.name: m for m in (
        Metric("depth", "trajectories", "Trajectories waiting to be trained on"),
        Metric("dropped_stale", "trajectories", "Trajectories dropped by freshness control"),
        Metric("max_staleness", "versions", "Largest staleness in an acknowledged batch"),
    )},
    "eval": {m.name: m for m in (
        Metric("greedy_success", "fraction", "Held-out success, greedy decoding"),
        Metric("sampled_success", "fraction", "Held-out success, sampled at the stage's "
               "temperature"),
    )},
}
"""What the stage driver tracks besides the trainer's steps, by tracker prefix: fields of the
rollout and buffer status records and of an evaluation (`kiln.control.records`), under the same
names (`rollout/<name>`, `buffer/<name>`, `eval/<task set>/<name>`)."""

PASS_AT_K = Metric("pass_at_k", "fraction", "Held-out pass@k: the chance that one of k sampled "
                   "attempts at a task succeeds, estimated without bias from eval.samples "
                   "attempts (kiln.evaluation); tracked as eval/<task set>/pass_at_k/<k>")
"""An evaluation's pass@k, one value per k (1, 2, 4, ... up to its samples per task)."""

PROGRESS: dict[str, Metric] = {m.name: m for m in (
    Metric("stage_index", "stages", "Position of the running stage in spec.stages (0-based)"),
    Metric("stage_step", "steps", "Optimizer steps the running stage has taken"),
    Metric("steps_left", "steps", "Optimizer steps left in the job: the running stage's and "
           "every later stage's"),
)}
"""The job's progress as the stage driver tracks it (`progress/<name>`), every poll."""


def series_metric(series: str) -> Metric:
    """The metric exported as Prometheus series `series`."""
    for m in ALL.values():
        if m.series == series:
            return m
    raise KeyError(f"no metric is exported as {series!r} (kiln.metrics defines every series)")


def prometheus(m: Metric) -> Any:
    """The prometheus_client collector of `m` (registered in the default registry: build each
    once per process)."""
    import prometheus_client

    if not m.series:
        raise ValueError(f"metric {m.name!r} is not exported to Prometheus")
    # prometheus_client adds `_total` to a counter's samples itself.
    name = m.series.removesuffix("_total") if m.kind == "counter" else m.series
    if m.kind == "histogram":
        return prometheus_client.Histogram(name, m.help, list(m.labels), buckets=m.buckets)
    cls = prometheus_client.Counter if m.kind == "counter" else prometheus_client.Gauge
    return cls(name, m.help, list(m.labels))
