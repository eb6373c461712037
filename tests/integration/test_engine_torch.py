"""The transformers implementation of EngineProtocol: log-probs and versions are exact."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln.models.tiny import make_tiny_model, train_tokenizer
from kiln.services.rollout.engine import EngineSettings, SamplingOptions
from kiln.services.rollout.torch_engine import TorchEngine

TEXTS = [f"call add({i}, {i * 3}) -> {i * 4}; answer {i % 7}" for i in range(200)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine_torch")
    tok = train_tokenizer(TEXTS, root / "tok", vocab_size=320)
    return (make_tiny_model(root / "v0", tok, seed=0), make_tiny_model(root / "v1", tok, seed=1))


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[pos, torch.tensor(tokens)]


def test_weights_change_mid_generation_with_exact_versions(models) -> None:
    v0, v1 = models

    async def main():
        engine = await TorchEngine.start(EngineSettings(model=str(v0), dtype="float32", seed=3))
        # Every request runs its full 40 tokens (no end-of-sequence), and the new weights land
        # once each request has decoded a few tokens, however slow the machine is.
        engine.eos_token_ids = set()
        forwards = 0
        inner = engine._forward

        def counting_forward(*args):
            nonlocal forwards
            forwards += 1
            return inner(*args)

        engine._forward = counting_forward
        prompts = [[1, 5 + i, 9, 12] for i in range(3)]
        sampling = SamplingOptions(temperature=1.0, max_tokens=40, stop_token_ids=())
        tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
        while forwards < 3 * len(prompts):
            await asyncio.sleep(0.01)
        await engine.apply_weights(1, load_file(str(v1 / "model.safetensors")).items())
        gens = await asyncio.gather(*tasks)
        with pytest.raises(ValueError):
            await engine.apply_weights(1, [])
        # Part of a version is refused whole: nothing of it is served under its number.
        part = list(load_file(str(v0 / "model.safetensors")).items())[:3]
        before = {n: t.clone() for n, t in engine._params.items()}
        with pytest.raises(ValueError, match="weights for version 2 lack"):
            await engine.apply_weights(2, part)
        assert engine.policy_version == 1
        assert all(torch.equal(before[n], t) for n, t in engine._params.items())
        return engine, prompts, gens

    engine, prompts, gens = asyncio.run(main())
    assert engine.policy_version == 1
    assert any(0 in g.versions and 1 in g.versions for g in gens), [g.versions for g in gens]
    for prompt, g in zip(prompts, gens):
        assert g.versions == sorted(g.versions)
        for version, mdir in ((0, v0), (1, v1)):
            idx = [i for i, v in enumerate(g.versions) if v == version]
            if not idx:
                continue
            ref = reference_logprobs(mdir, prompt, g.token_ids)
            got = torch.tensor(g.logprobs)
            assert torch.allclose(got[idx], ref[idx], atol=1e-4), (version, got[idx] - ref[idx])


def test_greedy_is_deterministic_and_stops(models) -> None:
    v0, _ = models

    async def main():
        engine = await TorchEngine.start(EngineSettings(model=str(v0), dtype="float32"))
        a = await engine.generate([1, 7, 8], SamplingOptions(temperature=0, max_tokens=12))
        b = await engine.generate([1, 7, 8], SamplingOptions(temperature=0, max_tokens=12))
        stop = a.token_ids[3]
        c = await engine.generate([1, 7, 8], SamplingOptions(temperature=0, max_tokens=12,
                                                             stop_token_ids=(stop,)))
        return a, b, c, stop

    a, b, c, stop = asyncio.run(main())
    assert a == b and a.finish_reason in ("length", "stop")
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop
    assert c.token_ids == a.token_ids[:a.token_ids.index(stop) + 1]


def test_score_gives_each_tokens_logprob_over_grpc(models) -> None:
    """Score: entry t is log p(token t | tokens < t) under the served weights (the reference
    model's, exactly), through the Rollout service's Score RPC and its client; malformed or
    oversized requests are INVALID_ARGUMENT."""
    import grpc

    from kiln.protos.kiln.v1 import rollout_pb2, rollout_pb2_grpc
    from kiln.control.channels import CHANNEL_OPTIONS
    from kiln.services.common.server import Registration, create_server
    from kiln.services.rollout import wire
    from kiln.services.rollout.agent import Limits
    from kiln.services.rollout.producer import Producer, ProducerConfig
    from kiln.services.rollout.servicer import RolloutServicer

    v0, _ = models
    seqs = [[1, 5, 9, 12, 40, 41], [3, 7], [11]]

    async def main():
        engine = await TorchEngine.start(EngineSettings(model=str(v0), dtype="float32", seed=0))
        direct = await engine.score(seqs)
        # Only the engine of the producer is used by Score.
        producer = Producer(ProducerConfig(SamplingOptions(), Limits(1, 1, 16), max_concurrent=1),
                            engine, None, None, None)
        server, port = await create_server("127.0.0.1:0", [Registration(
            rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(producer, {}),
            "kiln.v1.Rollout")])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            resp = await stub.Score(wire.score_request(seqs))
            topk = await stub.Score(wire.score_request(seqs, top_k=3))
            errors = []
            for bad, k in (([[1, 99999]], 0), ([[]], 0), ([[1] * (wire.MAX_SCORE_TOKENS + 1)], 0),
                           ([[1, 5]], wire.MAX_TOP_K + 1)):
                try:
                    await stub.Score(wire.score_request(bad, top_k=k))
                except grpc.aio.AioRpcError as exc:
                    errors.append((exc.code(), exc.details()))
        await server.stop(0)
        return direct, resp, topk, errors

    direct, resp, topk, errors = asyncio.run(main())
    assert resp.policy_version == 0
    got = [list(r.logprobs) for r in resp.sequences]
    for seq, row, d in zip(seqs, got, direct):
        assert len(row) == len(seq) and row[0] == 0.0
        assert row == pytest.approx(d, abs=1e-6)  # float32 on the wire
        if len(seq) > 1:
            ref = reference_logprobs(v0, seq[:1], seq[1:])
            assert torch.allclose(torch.tensor(row[1:]), ref, atol=1e-5)
    assert [c for c, _ in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert "[99999] are outside [0, " in errors[0][1] and "empty" in errors[1][1]
    assert "at most 1048576" in errors[2][1] and "top_k: 65, at most 64" in errors[3][1]
    # With a top k: the same per-token log-probs, and the 3 most likely in each place as the
    # reference model ranks them.
    model = AutoModelForCausalLM.from_pretrained(str(v0), dtype=torch.float32).eval()
    for seq, row, d in zip(seqs, topk.sequences, direct):
        assert list(row.logprobs) == pytest.approx(d, abs=1e-6)
        assert list(row.topk_ids[:3]) == [0] * 3 and len(row.topk_ids) == 3 * len(seq)
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
        for t in range(1, len(seq)):
            want = full[t - 1].topk(3)
            assert list(row.topk_ids[3 * t:3 * t + 3]) == want.indices.tolist()
            assert list(row.topk_logprobs[3 * t:3 * t + 3]) == pytest.approx(want.values.tolist(), abs=1e-5)
