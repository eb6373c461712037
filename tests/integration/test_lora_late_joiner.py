"""A rollout replica that joins during a LoRA stage following full-weight stages: it starts from
the job's checkpoint, not the base the adapter was trained on, and the weight-sync service sends
it that base (the last version of complete weights) before the adapter. Real trainer engine,
real weight-sync servicer over loopback gRPC, real torch rollout engine with its adapter merge."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from kiln.api.loss import MaskedLoss
from kiln.api.model import LoraSpec
from kiln.control.channels import CHANNEL_OPTIONS
from kiln.models import lora, parallel
from kiln.models.tiny import make_tiny_checkpoint
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.common.server import Registration, create_server
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer
from kiln.trajectory import Trajectory, VersionSpan

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora-join") / "m", arch="qwen2", hidden_size=64,
                                num_layers=2, intermediate_size=128, tie_word_embeddings=False, seed=3,
                                texts=[f"compute {i} * {i + 3} and answer" for i in range(200)], vocab_size=320)


def _batch(n: int = 4) -> list[Trajectory]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        tokens = torch.randint(4, 300, (12,), generator=g).tolist()
        out.append(Trajectory(id=f"t{i}", task_id="t", group_id="g", tokens=tokens, loss_mask=[0] * 3 + [1] * 9,
                              logp_infer=[0.0] * 12, version_spans=[VersionSpan(3, 12, 0)],
                              reward=1.0 if i % 2 == 0 else -1.0))
    return out


async def _wait_for(cond, timeout: float = 60.0) -> bool:
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        return False
    return True


async def _join_late(channel, engine, trainer):
    """A replica subscribing now, from the job's checkpoint: it applies the trained base (version
    2), then the adapter (version 4), and serves what the trainer computes. Returns its receiver
    and subscription task."""
    receiver = ws.make_receiver(channel, "late", engine.apply_weights)
    subscription = asyncio.create_task(ws.subscribe_and_apply(channel, "late", engine.apply_weights,
                                                              receiver=receiver, reconnect_delay=0.05))
    reached = await _wait_for(lambda: receiver.applied_policy_version == 4 or receiver.rejected)
    try:
        assert reached and receiver.rejected == [] and receiver.applied == [2, 4]
        seqs = [t.tokens for t in _batch()]
        ours, theirs = trainer.logprobs(seqs), await engine.score(seqs)
        assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)) <= 1e-5
    except BaseException:
        subscription.cancel()
        await asyncio.gather(subscription, return_exceptions=True)
        raise
    return receiver, subscription


async def test_a_replica_joining_a_lora_stage_gets_the_trained_base_then_the_adapter(model_dir: Path) -> None:
    from kiln.services.rollout.engine import EngineSettings, start_engine

    trainer = TrainerEngine(TrainerConfig(model_dir=model_dir, micro_batch_size=2, loss=MaskedLoss(),
                                          optimizer=OptimizerConfig(lr=1e-2)), resume=False)
    servicer = WeightSyncServicer(commit_timeout=30)
    server, port = await create_server(
        "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    engine = await start_engine("torch", EngineSettings(model=str(model_dir), dtype="float32",
                                                        lora_scaling=LORA.scaling))
    subscription = None
    try:
        for version in (1, 2):  # full-weight stage: every weight trains, complete versions
            trainer.sft_step(_batch())
            await ws.publish(channel, version, trainer.named_hf_tensors())
        trainer.config = trainer.config.model_copy(update={"lora": LORA})  # the LoRA stage
        for version in (3, 4):
            trainer.sft_step(_batch())
            await ws.publish(channel, version, list(trainer.named_hf_tensors()))
        assert lora.BASE_DIGEST in dict(trainer.named_hf_tensors())  # adapter versions
        assert servicer.store.base.policy_version == 2

        receiver, subscription = await _join_late(channel, engine, trainer)

        trainer.sft_step(_batch())  # the next adapter follows without the base again
        await ws.publish(channel, 5, list(trainer.named_hf_tensors()))
        assert await _wait_for(lambda: receiver.applied_policy_version == 5)
        assert receiver.applied == [2, 4, 5] and receiver.rejected == []
        seqs = [t.tokens for t in _batch()]
        ours, theirs = trainer.logprobs(seqs), await engine.score(seqs)
        assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)) <= 1e-5
    finally:
        if subscription is not None:
            subscription.cancel()
            await asyncio.gather(subscription, return_exceptions=True)
        await channel.close()
        await server.stop(0)
        await engine.close()


async def test_a_restarted_weight_sync_gets_the_base_again_from_the_trainer(model_dir: Path) -> None:
    """Weight-sync restarts during the LoRA stage (a new, empty service): the trainer's
    publisher, told the adapter's trained base (`TrainerEngine.adapter_base`, as the stage
    runner wires it), has its adapter refused for want of a base, publishes the base at its own
    version, then the adapter; a replica that joins after the restart recovers as before."""
    from kiln.services.rollout.engine import EngineSettings, start_engine
    from kiln.services.trainer.publisher import GrpcWeightPublisher

    trainer = TrainerEngine(TrainerConfig(model_dir=model_dir, micro_batch_size=2, loss=MaskedLoss(),
                                          optimizer=OptimizerConfig(lr=1e-2)), resume=False)
    engine = await start_engine("torch", EngineSettings(model=str(model_dir), dtype="float32",
                                                        lora_scaling=LORA.scaling))
    servers, channels, subscription = [], [], None

    async def weight_sync():
        servicer = WeightSyncServicer(commit_timeout=30)
        server, port = await create_server(
            "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
        return servicer, channels[-1]

    try:
        _, first = await weight_sync()
        publisher = GrpcWeightPublisher(asyncio.get_running_loop(), first, bucket_bytes=1 << 20, timeout=30)
        publisher.adapter_base = trainer.adapter_base
        for version in (1, 2):  # full-weight stage
            trainer.sft_step(_batch())
            trainer.policy_version = version
            await asyncio.to_thread(publisher.publish, version, trainer.named_hf_tensors())
        trainer.config = trainer.config.model_copy(update={"lora": LORA})
        trainer.sft_step(_batch())  # the LoRA stage's first step puts the adapter on
        assert trainer.adapter_base()[0] == 2
        await asyncio.to_thread(publisher.publish, 3, list(trainer.named_hf_tensors()))

        restarted, second = await weight_sync()  # the service restarted: it holds nothing
        publisher.channel = second
        trainer.sft_step(_batch())
        await asyncio.to_thread(publisher.publish, 4, list(trainer.named_hf_tensors()))
        assert restarted.store.base.policy_version == 2 and restarted.store.policy_version == 4

        _, subscription = await _join_late(second, engine, trainer)
    finally:
        if subscription is not None:
            subscription.cancel()
            await asyncio.gather(subscription, return_exceptions=True)
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(0)
        await engine.close()
