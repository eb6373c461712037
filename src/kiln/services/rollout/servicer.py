"""gRPC servicers of `kiln.v1.Rollout`: `RolloutServicer` translates protobuf <-> `Producer`
calls; `TeacherServicer` is a frozen deployment's (a rollout pinned to a checkpoint: a
teacher's Score, a swarm's subagents' Generate, and GetStatus; everything else
UNIMPLEMENTED)."""
from __future__ import annotations

import time

import grpc

from kiln.control import wire as control_wire
from kiln.control.records import Evaluation, RolloutMode, RolloutStatus
from kiln.protos.kiln.v1 import rollout_pb2, rollout_pb2_grpc
from kiln.services.rollout import wire
from kiln.services.rollout.engine import Engine
from kiln.services.rollout.producer import Mode, Producer


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, producer: Producer, task_sets: dict[str, tuple[str, int]]) -> None:
        self.producer = producer
        self.task_sets = task_sets

    def status(self) -> RolloutStatus:
        p = self.producer
        rewards = list(p.recent_rewards)
        return RolloutStatus(
            mode=p.mode.mode, stage=p.mode.stage, policy_version=p.engine.policy_version,
            episodes=p.episodes, tokens_generated=p.tokens,
            tokens_per_second=p.tokens_per_second(),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0, in_flight=p.in_flight,
            engine_fingerprint=p.engine.fingerprint, shipped=p.shipped,
            stopped_stale=p.stopped_stale, generating=p.engine.generating,
            teacher_seconds=p.teacher_seconds, teacher_tokens=p.teacher_tokens,
            eval_tasks_done=p.eval_progress[0], eval_tasks=p.eval_progress[1])

    async def SetMode(self, request, context):
        req = control_wire.mode_from_proto(request)
        unknown = [t for t in req.task_sets if t not in self.task_sets]
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"task_sets: {unknown} not served (known: {sorted(self.task_sets)})")
        if req.mode == RolloutMode.EXPLORE and req.group_size < 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group_size: must be >= 2 to explore")
        self.producer.set_mode(Mode.of(req, {t: size for t, (_, size) in self.task_sets.items()}))
        return control_wire.rollout_status_to_proto(self.status())

    async def GetStatus(self, request, context):
        return control_wire.rollout_status_to_proto(self.status())

    async def Score(self, request, context):
        return await _score(self.producer.engine, request, context)

    async def Evaluate(self, request, context):
        if request.task_set not in self.task_sets:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"task_set: {request.task_set!r} not served (known: {sorted(self.task_sets)})")
        start = time.monotonic()
        version = self.producer.engine.policy_version
        n, greedy, sampled, path, answered, counts = await self.producer.evaluate(
            request.task_set, self.task_sets[request.task_set][1], max_tasks=request.max_tasks,
            samples=request.samples, greedy=request.greedy)
        return control_wire.evaluation_to_proto(Evaluation(version, n, greedy, sampled,
                                                        time.monotonic() - start, path, answered,
                                                        counts))


class TeacherServicer(rollout_pb2_grpc.RolloutServicer):
    """A teacher: its engine's weights never change (no weight-sync subscription)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Score(self, request, context):
        return await _score(self.engine, request, context)

    async def Generate(self, request, context):
        """A frozen deployment's completion (a swarm's subagents)."""
        try:
            sampling = wire.sampling_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        gen = await self.engine.generate(list(request.token_ids), sampling)
        return rollout_pb2.GenerateResponse(
            token_ids=gen.token_ids, logprobs=gen.logprobs, finish_reason=gen.finish_reason,
            policy_version=max(gen.versions, default=self.engine.policy_version))

    async def GetStatus(self, request, context):
        return control_wire.rollout_status_to_proto(RolloutStatus(
            policy_version=self.engine.policy_version, engine_fingerprint=self.engine.fingerprint))


async def _score(engine: Engine, request, context):
    try:
        sequences = wire.sequences_from_proto(request)
        if request.top_k > wire.MAX_TOP_K:
            raise ValueError(f"top_k: {request.top_k}, at most {wire.MAX_TOP_K}")
        version = engine.policy_version
        topk = None
        if request.top_k:
            scored = await engine.score_topk(sequences, request.top_k)
            logprobs, topk = [s[0] for s in scored], [(s[1], s[2]) for s in scored]
        else:
            logprobs = await engine.score(sequences)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if engine.policy_version != version:
        # Weights changed while scoring: some rows may be the new version's.
        await context.abort(grpc.StatusCode.ABORTED, "the weights changed while scoring; retry")
    return wire.score_response(logprobs, version, topk)
