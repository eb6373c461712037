"""Every Prometheus metric Kiln exports, in one place.

The Grafana dashboard and the PrometheusRule alerts in charts/kiln are written against these
names; defining them once keeps the services, the chart and the tests in agreement. A process
only exports the metrics it touches (prometheus_client registers them all, but unlabelled
series of a service that never sets them stay at their zero value).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SERVICE_UP = Gauge("kiln_service_up", "1 while the service is serving", ["service"])

# --- policy versions and off-policy drift ---------------------------------------------------
POLICY_VERSION = Gauge(
    "kiln_policy_version", "Policy version a component currently holds", ["component"])
STALENESS = Histogram(
    "kiln_trajectory_staleness",
    "Trainer version minus the oldest policy version of a trajectory, when served for training",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
FRESHNESS_TAU = Gauge(
    "kiln_freshness_tau", "The freshness bound tau the buffer applies (absent: no bound)")
DROPPED_STALE = Counter(
    "kiln_trajectories_dropped_stale_total", "Trajectories dropped by freshness control (tau)")
RATIO_MASK_FRACTION = Gauge(
    "kiln_ratio_mask_fraction", "Fraction of trained tokens masked by the double-sided ratio mask")
ICEPOP_MASK_FRACTION = Gauge(
    "kiln_icepop_mask_fraction", "Fraction of trained tokens masked by IcePop")
MISMATCH_ABS = Gauge(
    "kiln_logprob_mismatch_abs_mean",
    "Mean |train log-prob - inference log-prob| of the same policy version")
MISMATCH_KL = Gauge(
    "kiln_logprob_mismatch_kl", "KL(inference || train) estimate over trained tokens")
ROUTING_FLIP_FRACTION = Gauge(
    "kiln_moe_routing_flip_fraction",
    "MoE: fraction of (token, layer) pairs of the last step whose trainer top-k differs from "
    "the experts rollout recorded (replayed or not)")

# --- trainer ----------------------------------------------------------------------------------
TRAIN_STEP = Gauge("kiln_train_step", "Optimizer steps taken in the current stage", ["stage"])
TRAIN_LOSS = Gauge("kiln_train_loss", "Loss of the last optimizer step", ["stage"])
GRAD_NORM = Gauge("kiln_train_grad_norm", "Gradient norm of the last optimizer step")
TRAIN_TOKENS = Counter("kiln_train_tokens_total", "Tokens trained on (loss-masked)")
STEP_SECONDS = Histogram(
    "kiln_train_step_seconds", "Wall time of one optimizer step",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
TRAINER_IDLE_SECONDS = Counter(
    "kiln_trainer_idle_seconds_total", "Time the trainer waited for a batch")
REWARD_MEAN = Gauge("kiln_reward_mean", "Mean reward of the last training batch")
TRAINER_TOKENS_PER_SECOND = Gauge(
    "kiln_trainer_tokens_per_second", "Tokens (all positions, prompt included) per second, last step")
CHECKPOINT_SECONDS = Histogram(
    "kiln_trainer_checkpoint_seconds", "Wall time of writing one trainer checkpoint",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))

# --- weight sync -----------------------------------------------------------------------------
SYNC_SECONDS = Histogram(
    "kiln_weight_sync_seconds", "Publish-to-applied time of one weight version on one replica",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
SYNC_BYTES = Counter("kiln_weight_sync_bytes_total", "Weight bytes streamed to replicas")
SYNC_FAILURES = Counter(
    "kiln_weight_sync_failures_total", "Rejected transfers (checksum, truncation)", ["reason"])

# --- buffer ------------------------------------------------------------------------------------
BUFFER_DEPTH = Gauge("kiln_buffer_depth", "Trajectories waiting to be trained on")
TEACHER_SCORE_SECONDS = Histogram(
    "kiln_teacher_score_seconds", "Time to have a group of trajectories scored by the teacher "
    "(on-policy distillation)", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
REWARD_MODEL_SECONDS = Histogram(
    "kiln_reward_model_seconds", "Time to have one episode scored by its task set's outcome "
    "model and judge (rewardRules)", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
TEACHER_SCORED_TOKENS = Counter("kiln_teacher_scored_tokens_total",
                                "Tokens scored by the teacher (on-policy distillation)")
_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SWARM_SUBAGENTS = Histogram("kiln_swarm_subagents", "Subagents created per orchestrator episode "
                            "(agent swarm stages)", buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64))
SWARM_CRITICAL_PATH = Histogram("kiln_swarm_critical_path_steps", "Longest chain of dependent "
                                "model calls per orchestrator episode", buckets=_STEPS)
SWARM_TOTAL_STEPS = Histogram("kiln_swarm_total_steps", "Model calls per orchestrator episode, "
                              "its subagents' included", buckets=_STEPS)
BUFFER_WRITE_ERRORS = Counter("kiln_buffer_write_errors_total",
                              "Writes of the buffer's log that failed (the call was refused, "
                              "nothing stored)", ["errno"])
BUFFER_BYTES = Gauge("kiln_buffer_unconsumed_bytes",
                     "Bytes of trajectories waiting or leased (bounded by spec.buffer.capacityBytes)")
ACCEPTED = Counter("kiln_trajectories_accepted_total", "Trajectories accepted by the buffer")
SERVED = Counter("kiln_trajectories_served_total", "Trajectories served for training")

# --- rollout -----------------------------------------------------------------------------------
ROLLOUT_TOKENS = Counter("kiln_rollout_tokens_total", "Tokens generated by rollout")
EPISODES = Counter("kiln_rollout_episodes_total", "Finished episodes", ["outcome"])
ROLLOUT_ENGINE_REQUESTS = Gauge("kiln_rollout_engine_requests",
                                "Generate calls the inference engine has in progress")
ROLLOUT_ENGINE_IDLE = Counter("kiln_rollout_engine_idle_seconds_total",
                              "Time the inference engine had no generate call in progress")
EPISODE_REWARD = Histogram(
    "kiln_rollout_reward", "Reward of finished episodes", buckets=(0, 0.25, 0.5, 0.75, 1))

# --- sandbox -----------------------------------------------------------------------------------
SANDBOX_START_SECONDS = Histogram(
    "kiln_sandbox_start_seconds", "Time to create a sandbox", ["backend"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
SANDBOX_FAILURES = Counter(
    "kiln_sandbox_failures_total", "Sandbox operations that failed", ["backend", "reason"])
SANDBOX_ACTIVE = Gauge("kiln_sandbox_active", "Sandboxes currently alive", ["backend"])
