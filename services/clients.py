"""gRPC implementations of the driver's control Protocols (trainer, rollout, buffer).

Blocking clients with plain dicts as results: the driver runs in the launcher's main thread and
only polls. A lost reply is retried where the call is idempotent (all of these are).
"""
from __future__ import annotations

from typing import Any

import grpc

from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.server import CHANNEL_OPTIONS

_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _call(fn, req, *, timeout: float, attempts: int = 5):
    for attempt in range(attempts):
        try:
            return fn(req, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() not in _RETRY or attempt == attempts - 1:
                raise


class TrainerClient:
    def __init__(self, address: str) -> None:
        self.stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))

    def start_stage(self, name: str) -> None:
        _call(self.stub.RunStage, trainer_pb2.RunStageRequest(stage=name), timeout=30)

    def status(self) -> dict[str, Any]:
        s = _call(self.stub.GetTrainerStatus, trainer_pb2.TrainerStatusRequest(), timeout=30)
        m = dict(s.last_metrics)
        return {
            "stage": s.stage, "step": s.stage_step, "global_step": s.step, "version": s.policy_version,
            "stage_done": s.stage_done, "failed": s.stage_failed, "message": s.message,
            "loss": m.get("loss"), "reward": m.get("reward_mean"), "grad_norm": m.get("grad_norm"),
            "ratio_mask": m.get("ratio_mask_frac"), "icepop_mask": m.get("icepop_mask_frac"),
            "mismatch_abs": m.get("mismatch_abs"), "mismatch_kl": m.get("mismatch_kl"),
            "tokens_per_second": m.get("tokens_per_s"), "step_seconds": m.get("step_time_s"),
            "staleness_counts": {k.removeprefix("staleness_"): v for k, v in m.items()
                                 if k.startswith("staleness_")},
        }


class RolloutClient:
    def __init__(self, address: str) -> None:
        self.stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))

    def set_mode(self, mode: int, *, stage: str, task_sets: list[str], group_size: int,
                 synchronous: bool, batch_size: int, seed: int) -> None:
        _call(self.stub.SetMode, rollout_pb2.SetModeRequest(
            mode=mode, stage=stage, task_sets=task_sets, group_size=group_size,
            synchronous=synchronous, batch_size=batch_size, seed=seed), timeout=30)

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> dict[str, Any]:
        r = _call(self.stub.Evaluate, rollout_pb2.EvaluateRequest(
            task_set=task_set, samples=samples, greedy=greedy), timeout=3600, attempts=1)
        return {"policy_version": r.policy_version, "tasks": r.tasks, "greedy_success": r.greedy_success,
                "sampled_success": r.sampled_success, "seconds": r.seconds}

    def status(self) -> dict[str, Any]:
        s = _call(self.stub.GetStatus, rollout_pb2.RolloutStatusRequest(), timeout=30)
        return {"mode": s.mode, "stage": s.stage, "policy_version": s.policy_version,
                "episodes": s.episodes, "tokens": s.tokens_generated,
                "tokens_per_second": s.tokens_per_second, "mean_reward": s.mean_reward,
                "in_flight": s.in_flight, "shipped": s.shipped}


class BufferStatusClient:
    def __init__(self, address: str) -> None:
        self.stub = buffer_pb2_grpc.BufferStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))

    def status(self) -> dict[str, Any]:
        s = _call(self.stub.GetStatus, buffer_pb2.GetStatusRequest(), timeout=30)
        return {"depth": s.depth, "ready": s.ready, "accepted": s.accepted, "served": s.served,
                "dropped_stale": s.dropped_stale, "max_staleness": max(0, s.max_staleness),
                "trainer_version": s.trainer_version}


def connect(addresses: dict[str, str]) -> tuple[TrainerClient, RolloutClient, BufferStatusClient]:
    return (TrainerClient(addresses["trainer"]), RolloutClient(addresses["rollout"]),
            BufferStatusClient(addresses["buffer"]))
