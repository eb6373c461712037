"""The rollout service's clients: `RolloutClient`, the control floor's (set the mode, run
evaluations, read the status: the stage driver's side, `kiln.control.clients`) with scoring
added (a teacher's or a reward model's side), blocking; and the asynchronous ones a rollout
uses to reach a frozen deployment (`TeacherScorer`, `FrozenEngine`). SetMode, GetStatus and
Score are idempotent and retried on transient errors, an evaluation is not (it is long, and its
result is recorded by the caller)."""
from __future__ import annotations

from kiln.control.channels import aio_channel
from kiln.control.clients import RolloutControlClient
from kiln.control.retry import call_until, call_with_retry
from kiln.protos.kiln.v1 import rollout_pb2_grpc
from kiln.services.rollout import wire

__all__ = ["FrozenEngine", "RolloutClient", "TeacherScorer"]

# How long a frozen deployment's callers wait for it to serve: as long as a pod's startup probe
# lets a model load, and on a cluster one made by a stage starts only when that stage is done.
FROZEN_WAIT_S = 900.0


class RolloutClient(RolloutControlClient):
    def score(self, sequences: list[list[int]], *, timeout: float = 300.0) -> tuple[list[list[float]], int]:
        """(per-token log-probs of each sequence, the policy version that scored them)."""
        resp = call_with_retry(self.stub().Score, wire.score_request(sequences), timeout=timeout)
        return [list(r.logprobs) for r in resp.sequences], resp.policy_version


class TeacherScorer:
    """A frozen deployment's Score, asynchronous, over mutual TLS (its certificate's identity is
    `teacher`): what a student's rollout calls for a teacher's, a reference's or an outcome
    model's log-probs. Retried for up to `wait_s` while the deployment starts, restarts or
    loads: on a cluster one made by a stage starts only when that stage is done."""

    def __init__(self, address: str, *, wait_s: float = FROZEN_WAIT_S) -> None:
        self.channel = aio_channel(address, "teacher")
        self._stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.wait_s = wait_s

    async def __call__(self, sequences: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of each sequence (entry 0 is 0)."""
        resp = await self._score(wire.score_request(sequences))
        return [list(r.logprobs) for r in resp.sequences]

    async def topk(self, sequences: list[list[int]], k: int) -> list[tuple[list[float], list[int], list[float]]]:
        """Per sequence: its per-token log-probs, and the k most likely ids in each place and
        their log-probs (k entries per token)."""
        resp = await self._score(wire.score_request(sequences, top_k=k))
        return [(list(r.logprobs), list(r.topk_ids), list(r.topk_logprobs)) for r in resp.sequences]

    async def _score(self, request):
        return await call_until(self._stub.Score, request, timeout=300, wait_s=self.wait_s)

    async def close(self) -> None:
        await self.channel.close()


class FrozenEngine:
    """The agent loop's `Engine` over a frozen deployment's Generate (a swarm's subagents: a
    rollout pinned to a checkpoint, `kiln-rollout --teacher DIR`), asynchronous, over mutual
    TLS, retried while the deployment starts or restarts (it may wait for an earlier stage to
    make its checkpoint). `policy_version` is the version its last answer came from."""

    fingerprint = "frozen"

    def __init__(self, address: str, *, wait_s: float = FROZEN_WAIT_S) -> None:
        self._channel = aio_channel(address, "teacher")
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self.wait_s = wait_s
        self.policy_version = 0

    async def generate(self, prompt, sampling):
        from kiln.services.rollout.engine import Generation

        # A repeated Generate after a lost reply only samples again: harmless to retry.
        resp = await call_until(self._stub.Generate, wire.generate_request(prompt, sampling),
                                timeout=300, wait_s=self.wait_s)
        self.policy_version = resp.policy_version
        ids = list(resp.token_ids)
        return Generation(ids, list(resp.logprobs), [resp.policy_version] * len(ids),
                          resp.finish_reason)

    async def close(self) -> None:
        await self._channel.close()
