"""gRPC servicer for `kiln.v1.Environment`: translates protobuf <-> `EpisodeManager` calls."""
from __future__ import annotations

import grpc

from kiln.protos.kiln.v1 import env_pb2, env_pb2_grpc

from .episodes import EpisodeError, EpisodeManager


class EnvironmentServicer(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager

    async def ListTaskSets(self, request, context):
        return env_pb2.ListTaskSetsResponse(task_sets=[
            env_pb2.TaskSetInfo(name=name, env=env, size=len(tasks))
            for name, (env, tasks) in self.manager.task_sets.items()])

    async def OpenEpisode(self, request, context):
        try:
            eid, task = self.manager.open(request.task_set, request.index, owner=request.owner,
                                          max_actions=request.max_actions)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return env_pb2.Episode(episode_id=eid, task_id=task.id, env="chain", prompt=task.prompt,
                               stop=self.manager.stop_strings())

    async def Step(self, request, context):
        try:
            out = await self.manager.step(request.episode_id, request.action)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return env_pb2.StepResult(observation=out.observation, done=out.done, reward=out.reward,
                                  reward_parts=out.reward_parts, verifier_output=out.verifier_output,
                                  flags=out.flags)

    async def CloseEpisode(self, request, context):
        await self.manager.close(request.episode_id)
        return env_pb2.CloseEpisodeResponse()

    async def Demonstrate(self, request, context):
        try:
            task, segments, reward, output = self.manager.demonstrate(
                request.task_set, request.index, request.seed)
        except EpisodeError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return env_pb2.Demonstration(
            task_id=task.id, reward=reward, verifier_output=output,
            segments=[env_pb2.Segment(text=t, trained=tr) for t, tr in segments])
