"""The rollout service's client: set the mode, run evaluations, read the status (the stage
driver's side), score token sequences (a teacher's or a reward model's side). Blocking calls;
SetMode, GetStatus and Score are idempotent and retried on transient errors, an evaluation is
not (it is long, and its result is recorded by the caller)."""
from __future__ import annotations

from kiln import tls
from kiln.protos.kiln.v1 import rollout_pb2, rollout_pb2_grpc
from kiln.services.common.retry import call_with_retry
from kiln.services.common.server import CHANNEL_OPTIONS
from kiln.services.rollout import wire
from kiln.services.rollout.wire import Evaluation, ModeRequest, RolloutMode, RolloutStatus

__all__ = ["Evaluation", "ModeRequest", "RolloutClient", "RolloutMode", "RolloutStatus"]


class RolloutClient:
    def __init__(self, target: str) -> None:
        self._channel = tls.channel(target, "rollout", CHANNEL_OPTIONS)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        return wire.status_from_proto(call_with_retry(
            self._stub.SetMode, wire.mode_to_proto(mode), timeout=30))

    def evaluate(self, task_set: str, *, samples: int, greedy: bool,
                 max_tasks: int = 0) -> Evaluation:
        req = rollout_pb2.EvaluateRequest(task_set=task_set, samples=samples, greedy=greedy,
                                          max_tasks=max_tasks)
        return wire.evaluation_from_proto(self._stub.Evaluate(req, timeout=3600))

    def score(self, sequences: list[list[int]], *, timeout: float = 300.0) -> tuple[list[list[float]], int]:
        """(per-token log-probs of each sequence, the policy version that scored them)."""
        resp = call_with_retry(self._stub.Score, wire.score_request(sequences), timeout=timeout)
        return [list(r.logprobs) for r in resp.sequences], resp.policy_version

    def status(self) -> RolloutStatus:
        return wire.status_from_proto(call_with_retry(
            self._stub.GetStatus, rollout_pb2.RolloutStatusRequest(), timeout=30))

    def close(self) -> None:
        self._channel.close()
