"""The Trainer gRPC servicer over a real in-process server and channel."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.codec import to_proto
from kiln.services.common.server import Registration, create_server
from kiln.services.common.tiny_model import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.servicer import SERVICE_NAME, TrainerServicer, add_to_server
from kiln.trajectory import Trajectory, VersionSpan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("svc") / "m", hidden_size=64, intermediate_size=128)


def _traj(i: int) -> Trajectory:
    rng = random.Random(i)
    tokens = [rng.randrange(4, 300) for _ in range(9)]
    return Trajectory(id=f"t{i}", task_id="x", group_id="g", tokens=tokens, loss_mask=[0] * 3 + [1] * 6,
                      logp_infer=[0.0] * 3 + [-5.7] * 6, version_spans=[VersionSpan(3, 9, 0)], advantage=1.0)


async def _serve(engine: TrainerEngine):
    servicer = TrainerServicer(engine)
    server, port = await create_server("127.0.0.1:0", [Registration(add_to_server, servicer, SERVICE_NAME)])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, trainer_pb2_grpc.TrainerStub(channel), servicer


def test_rpcs_against_the_engine(model_dir: Path, tmp_path: Path) -> None:
    engine = TrainerEngine(TrainerConfig(
        model_dir=model_dir, checkpoint_dir=tmp_path / "ckpt", optimizer=OptimizerConfig(lr=1e-3)))
    seqs = [_traj(0).tokens, _traj(1).tokens[:5]]
    expected = engine.logprobs(seqs)

    async def scenario() -> None:
        server, channel, stub, servicer = await _serve(engine)
        try:
            # Two requests on one stream: one response each, in order.
            async def requests():
                yield trainer_pb2.LogprobsRequest(sequences=[
                    trainer_pb2.TokenSequence(id="a", tokens=seqs[0]),
                    trainer_pb2.TokenSequence(id="b", tokens=seqs[1]),
                ])
                yield trainer_pb2.LogprobsRequest(sequences=[trainer_pb2.TokenSequence(id="c", tokens=seqs[1])])
            responses = [r async for r in stub.ComputeLogprobs(requests())]
            assert [[s.id for s in r.sequences] for r in responses] == [["a", "b"], ["c"]]
            got = list(responses[0].sequences[0].logprobs)
            assert len(got) == len(seqs[0]) and max(abs(x - y) for x, y in zip(got, expected[0])) < 1e-6
            assert list(responses[1].sequences[0].logprobs) == list(responses[0].sequences[1].logprobs)

            step = await stub.TrainStep(trainer_pb2.TrainStepRequest(
                trajectories=[to_proto(_traj(i)) for i in range(3)], kind=trainer_pb2.STEP_KIND_SFT, stage="warmup"))
            assert step.step == 1 and step.metrics["tokens"] == 18 and step.metrics["loss"] > 0
            rl = await stub.TrainStep(trainer_pb2.TrainStepRequest(trajectories=[to_proto(_traj(0))]))
            assert rl.step == 2 and "ratio_mask_frac" in rl.metrics

            status = await stub.NewVersion(trainer_pb2.NewVersionRequest())
            assert status.policy_version == 1 and status.step == 2 and status.stage == "warmup"
            saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
            assert saved.step == 2 and Path(saved.path).name == "step_00000002" and Path(saved.path).is_dir()
            status = await stub.GetTrainerStatus(trainer_pb2.TrainerStatusRequest())
            assert status.last_checkpoint == saved.path and status.last_metrics["step"] == 2
            # Nothing new since: shutdown writes no second checkpoint.
            assert await servicer.final_checkpoint() is None

            bad = _traj(0)
            bad.tokens[4] = 999_999
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.TrainStep(trainer_pb2.TrainStepRequest(trajectories=[to_proto(bad)]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.TrainStep(trainer_pb2.TrainStepRequest())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_save_checkpoint_without_directory_is_failed_precondition(model_dir: Path) -> None:
    engine = TrainerEngine(TrainerConfig(model_dir=model_dir))

    async def scenario() -> None:
        server, channel, stub, _ = await _serve(engine)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())
