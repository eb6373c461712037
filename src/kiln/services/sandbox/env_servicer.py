"""gRPC servicer for `kiln.v1.Environment`: translates protobuf <-> `EpisodeManager` calls."""
from __future__ import annotations

import grpc

from kiln.protos.kiln.v1 import env_pb2, env_pb2_grpc
from kiln.services.sandbox import wire
from kiln.services.sandbox.episodes import EpisodeError, EpisodeManager, SubtaskRefused


class EnvironmentServicer(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager

    async def ListTaskSets(self, request, context):
        return env_pb2.ListTaskSetsResponse(task_sets=[
            env_pb2.TaskSetInfo(name=name, env=env, size=size)
            for name, (env, size) in self.manager.task_set_sizes().items()])

    async def OpenEpisode(self, request, context):
        try:
            episode = self.manager.open(request.task_set, request.index, owner=request.owner,
                                        max_actions=request.max_actions)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return wire.episode_to_proto(episode)

    async def OpenSubtask(self, request, context):
        try:
            episode = await self.manager.open_subtask(
                request.parent_episode_id, request.role, request.instructions, request.task,
                owner=request.owner, max_actions=request.max_actions)
        except SubtaskRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return wire.episode_to_proto(episode)

    async def Step(self, request, context):
        try:
            action = wire.action_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            out = await self.manager.step(request.episode_id, action)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return wire.step_to_proto(out)

    async def CloseEpisode(self, request, context):
        await self.manager.close(request.episode_id)
        return env_pb2.CloseEpisodeResponse()

    async def Demonstrate(self, request, context):
        try:
            demo = await self.manager.demonstrate(request.task_set, request.index, request.seed)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return wire.demonstration_to_proto(demo)
