"""The Prometheus collectors of the services, one per series of `kiln.metrics` (where every
metric is defined: name, unit, help, labels, buckets).

A process only exports the metrics it touches (prometheus_client registers them all, but
unlabelled series of a service that never sets them stay at their zero value). The operator's
own series are built in `kiln.operator.metrics`.
"""
from __future__ import annotations

from kiln.metrics import ALL, prometheus


def _series(name: str):  # type: ignore[no-untyped-def]
    return prometheus(ALL[name])


SERVICE_UP = _series("service_up")
RPC_TOTAL = _series("rpc_requests")
RPC_SECONDS = _series("rpc_duration")
CERTIFICATE_EXPIRY = _series("certificate_expiry")

# --- policy versions and off-policy drift ---------------------------------------------------
POLICY_VERSION = _series("policy_version")
STALENESS = _series("trajectory_staleness")
FRESHNESS_TAU = _series("freshness_tau")
DROPPED_STALE = _series("dropped_stale")
RATIO_MASK_FRACTION = _series("ratio_mask_frac")
ICEPOP_MASK_FRACTION = _series("icepop_mask_frac")
RATIO_ONLY_MASK_FRACTION = _series("ratio_only_frac")
ICEPOP_ONLY_MASK_FRACTION = _series("icepop_only_frac")
BOTH_MASKS_FRACTION = _series("both_masked_frac")
CORRECTION_MASK_FRACTION = _series("correction_mask_frac")
MISMATCH_ABS = _series("mismatch_abs")
MISMATCH_KL = _series("mismatch_kl")
ROUTING_FLIP_FRACTION = _series("routing_flip_frac")
ROUTING_STRADDLE_FRACTION = _series("routing_straddle_frac")
KL_REF = _series("kl_ref")
DENSE_KL = _series("dense_kl")

# --- trainer ----------------------------------------------------------------------------------
TRAIN_STEP = _series("step")
TRAIN_LOSS = _series("loss")
GRAD_NORM = _series("grad_norm")
TRAIN_TOKENS = _series("tokens")
STEP_SECONDS = _series("step_seconds")
TRAINER_IDLE_SECONDS = _series("wait_seconds")
REWARD_MEAN = _series("reward_mean")
TRAINER_TOKENS_PER_SECOND = _series("tokens_per_second")
CHECKPOINT_SECONDS = _series("checkpoint_seconds")
NONFINITE_STEPS = _series("nonfinite_steps")

# --- weight sync -----------------------------------------------------------------------------
SYNC_SECONDS = _series("sync_seconds")
SYNC_BYTES = _series("sync_bytes")
SYNC_FAILURES = _series("sync_failures")

# --- buffer ------------------------------------------------------------------------------------
BUFFER_DEPTH = _series("buffer_depth")
BUFFER_LEASED = _series("buffer_leased")
BATCHES_REDELIVERED = _series("batches_redelivered")
BUFFER_WRITE_ERRORS = _series("buffer_write_errors")
BUFFER_BYTES = _series("buffer_unconsumed_bytes")
ACCEPTED = _series("accepted")
SERVED = _series("served")
TEACHER_SCORE_SECONDS = _series("teacher_score_seconds")
REWARD_MODEL_SECONDS = _series("reward_model_seconds")
JUDGE_UNPARSED = _series("judge_unparsed")
TEACHER_SCORED_TOKENS = _series("teacher_scored_tokens")
SWARM_SUBAGENTS = _series("swarm_subagents")
SWARM_CRITICAL_PATH = _series("swarm_critical_path_steps")
SWARM_TOTAL_STEPS = _series("swarm_total_steps")

# --- rollout -----------------------------------------------------------------------------------
ROLLOUT_TOKENS = _series("rollout_tokens")
EPISODES = _series("episodes")
ROLLOUT_ENGINE_REQUESTS = _series("engine_requests")
ROLLOUT_ENGINE_IDLE = _series("engine_idle_seconds")
EPISODE_REWARD = _series("episode_reward")

# --- the rollout fleet's router ---------------------------------------------------------------
ROUTER_REQUESTS = _series("router_requests")
ROUTER_REFUSALS = _series("router_refusals")
ROUTER_REPLICA_LOAD = _series("router_replica_load")
ROUTER_REPLICAS = _series("router_replicas")

# --- sandbox -----------------------------------------------------------------------------------
SANDBOX_START_SECONDS = _series("sandbox_start_seconds")
SANDBOX_FAILURES = _series("sandbox_failures")
SANDBOX_ACTIVE = _series("sandbox_active")
