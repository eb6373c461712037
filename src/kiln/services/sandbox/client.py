"""The sandbox service's client for episodes: how rollout plays an environment.

`EnvClient` is the protocol the agent loop uses: open an episode (its messages and tools), send
what each model reply asked for (`Action`), get the tools' outputs or the end of the episode. `GrpcEnvClient` is the rollout service's, over
`kiln.v1.Environment`; `LocalEnvClient` calls an in-process `EpisodeManager` the same way, so an
agent loop runs in one process in tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import grpc

from kiln.episode import Action, Demonstration, EpisodeInfo, StepResult
from kiln.protos.kiln.v1 import env_pb2, env_pb2_grpc
from kiln.services.sandbox import wire

if TYPE_CHECKING:
    from kiln.services.sandbox.episodes import EpisodeManager

__all__ = ["Action", "Demonstration", "EnvClient", "EpisodeInfo", "GrpcEnvClient",
           "LocalEnvClient", "StepResult"]


class EnvClient(Protocol):
    async def task_sets(self) -> dict[str, tuple[str, int]]:
        """Task set name -> (environment type, number of tasks)."""
        ...

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo: ...
    async def open_subtask(self, parent_episode_id: str, role: str, instructions: str, task: str,
                           max_actions: int) -> EpisodeInfo:
        """A subagent's episode: the sub-task the environment makes of `task` (assigned by the
        orchestrator of `parent_episode_id`). ValueError when it cannot make one."""
        ...
    async def step(self, episode_id: str, action: Action) -> StepResult: ...
    async def close(self, episode_id: str) -> None: ...
    async def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration: ...


class GrpcEnvClient:
    def __init__(self, channel: grpc.aio.Channel, *, owner: str = "rollout",
                 timeout: float = 60.0) -> None:
        self.stub = env_pb2_grpc.EnvironmentStub(channel)
        self.owner = owner
        self.timeout = timeout

    async def task_sets(self) -> dict[str, tuple[str, int]]:
        resp = await self.stub.ListTaskSets(env_pb2.ListTaskSetsRequest(), timeout=self.timeout)
        return {t.name: (t.env, t.size) for t in resp.task_sets}

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo:
        ep = await self.stub.OpenEpisode(env_pb2.OpenEpisodeRequest(
            task_set=task_set, index=index, owner=self.owner, max_actions=max_actions),
            timeout=self.timeout)
        return wire.episode_from_proto(ep)

    async def open_subtask(self, parent_episode_id: str, role: str, instructions: str, task: str,
                           max_actions: int) -> EpisodeInfo:
        try:
            ep = await self.stub.OpenSubtask(env_pb2.OpenSubtaskRequest(
                parent_episode_id=parent_episode_id, role=role, instructions=instructions,
                task=task, owner=self.owner, max_actions=max_actions), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            raise
        return wire.episode_from_proto(ep)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        r = await self.stub.Step(wire.action_to_proto(episode_id, action), timeout=self.timeout)
        return wire.step_from_proto(r)

    async def close(self, episode_id: str) -> None:
        await self.stub.CloseEpisode(env_pb2.CloseEpisodeRequest(episode_id=episode_id),
                                     timeout=self.timeout)

    async def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration:
        d = await self.stub.Demonstrate(
            env_pb2.DemonstrateRequest(task_set=task_set, index=index, seed=seed),
            timeout=self.timeout)
        return wire.demonstration_from_proto(d)


class LocalEnvClient:
    """`EnvClient` over an `EpisodeManager` in this process."""

    def __init__(self, manager: "EpisodeManager", *, owner: str = "local") -> None:
        self.manager = manager
        self.owner = owner

    async def task_sets(self) -> dict[str, tuple[str, int]]:
        return self.manager.task_set_sizes()

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo:
        return self.manager.open(task_set, index, owner=self.owner, max_actions=max_actions)

    async def open_subtask(self, parent_episode_id: str, role: str, instructions: str, task: str,
                           max_actions: int) -> EpisodeInfo:
        return await self.manager.open_subtask(parent_episode_id, role, instructions, task,
                                         owner=self.owner, max_actions=max_actions)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        return await self.manager.step(episode_id, action)

    async def close(self, episode_id: str) -> None:
        await self.manager.close(episode_id)

    async def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration:
        return await self.manager.demonstrate(task_set, index, seed)
