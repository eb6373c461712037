"""`EnvClient` over gRPC: the rollout side of `kiln.v1.Environment` (served by the sandbox)."""
from __future__ import annotations

import grpc

from kiln.protos.kiln.v1 import env_pb2, env_pb2_grpc

from .agent import Demonstration, EpisodeInfo, StepInfo


class GrpcEnvClient:
    def __init__(self, channel: grpc.aio.Channel, *, owner: str = "rollout", timeout: float = 60.0) -> None:
        self.stub = env_pb2_grpc.EnvironmentStub(channel)
        self.owner = owner
        self.timeout = timeout

    async def task_sets(self) -> dict[str, tuple[str, int]]:
        resp = await self.stub.ListTaskSets(env_pb2.ListTaskSetsRequest(), timeout=self.timeout)
        return {t.name: (t.env, t.size) for t in resp.task_sets}

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo:
        ep = await self.stub.OpenEpisode(env_pb2.OpenEpisodeRequest(
            task_set=task_set, index=index, owner=self.owner, max_actions=max_actions), timeout=self.timeout)
        return EpisodeInfo(ep.episode_id, ep.task_id, ep.env, ep.prompt, list(ep.stop))

    async def step(self, episode_id: str, action: str) -> StepInfo:
        r = await self.stub.Step(env_pb2.StepRequest(episode_id=episode_id, action=action),
                                 timeout=self.timeout)
        return StepInfo(r.observation, r.done, r.reward, dict(r.reward_parts), r.verifier_output,
                        list(r.flags), r.sandbox_image_digest)

    async def close(self, episode_id: str) -> None:
        await self.stub.CloseEpisode(env_pb2.CloseEpisodeRequest(episode_id=episode_id),
                                     timeout=self.timeout)

    async def demonstrate(self, task_set: str, index: int, seed: int) -> Demonstration:
        d = await self.stub.Demonstrate(env_pb2.DemonstrateRequest(task_set=task_set, index=index, seed=seed),
                                        timeout=self.timeout)
        return Demonstration(d.task_id, [(s.text, s.trained) for s in d.segments], d.reward, d.verifier_output)
