"""The vLLM rollout engine: log-probs match a transformers forward pass, weights change in a
running engine with exact per-token versions, and a version published through the weight-sync
service reaches the engine. One engine (~20 s to start) is shared by the module."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.control.channels import CHANNEL_OPTIONS
from kiln.services.common.server import Registration, create_server
from kiln.models.tiny import make_tiny_model, train_tokenizer
from kiln.models.megatron_model import choice_logits
from kiln.services.rollout.engine import EngineSettings, SamplingOptions, ToolChoiceRule
from kiln.services.rollout.vllm_engine import VllmEngine
from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer

pytestmark = pytest.mark.slow

TEXTS = [f"call add({i}, {i * 3}) -> {i * 4}; answer {i % 7}" for i in range(200)]
ATOL = 1e-4  # fp32


class Env:
    def __init__(self, root: Path) -> None:
        tok = train_tokenizer(TEXTS, root / "tok", vocab_size=320)
        self.dirs = [make_tiny_model(root / f"v{s}", tok, seed=s) for s in range(3)]
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(VllmEngine.start(EngineSettings(
            model=str(self.dirs[0]), dtype="float32", kv_cache_bytes=64 << 20, seed=0,
            max_model_len=512)))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def weights(self, i: int) -> list[tuple[str, torch.Tensor]]:
        return list(load_file(str(self.dirs[i] / "model.safetensors")).items())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("engine_vllm"))
    yield e
    e.run(e.engine.close())
    e.loop.close()


_models: dict[Path, torch.nn.Module] = {}


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: list[int],
                       temperature: float = 1.0) -> torch.Tensor:
    if model_dir not in _models:
        _models[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(_models[model_dir](input_ids=seq).logits[0].float() / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[pos, torch.tensor(tokens)]


def assert_matches(env: Env, prompt, gen, version_dirs: dict[int, Path]) -> None:
    got = torch.tensor(gen.logprobs)
    for version, mdir in version_dirs.items():
        idx = [i for i, v in enumerate(gen.versions) if v == version]
        if idx:
            ref = reference_logprobs(mdir, prompt, gen.token_ids)
            diff = (got[idx] - ref[idx]).abs().max().item()
            assert diff < ATOL, f"version {version}: max |logprob diff| {diff}"


def test_concurrent_generation_logprobs_match_transformers(env: Env) -> None:
    eng = env.engine
    prompts = [[1, 5 + i, 9, 12 + i] for i in range(8)]

    async def main():
        return await asyncio.gather(*[
            eng.generate(p, SamplingOptions(temperature=1.0, max_tokens=24, seed=i))
            for i, p in enumerate(prompts)])

    gens = env.run(main())
    assert "vllm-" in eng.fingerprint and "dtype=float32" in eng.fingerprint
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
        assert set(g.versions) == {0}
        assert g.finish_reason in ("length", "stop")
        assert_matches(env, p, g, {0: env.dirs[0]})
    again = env.run(eng.generate(prompts[0], SamplingOptions(temperature=1.0, max_tokens=24, seed=0)))
    assert again.token_ids == gens[0].token_ids  # same seed, same weights: same tokens


def test_apply_weights_mid_generation_tags_every_token_exactly(env: Env) -> None:
    eng = env.engine
    prompts = [[1, 20 + i, 30] for i in range(4)]

    async def main():
        tasks = [asyncio.create_task(eng.generate(p, SamplingOptions(
            temperature=1.0, max_tokens=400, seed=i))) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.15)
        await eng.apply_weights(1, env.weights(1))
        gens = await asyncio.gather(*tasks)
        with pytest.raises(ValueError):
            await eng.apply_weights(1, env.weights(2))  # not newer
        return gens

    gens = env.run(main())
    assert eng.policy_version == 1
    assert any(0 in g.versions and 1 in g.versions for g in gens), [set(g.versions) for g in gens]
    for p, g in zip(prompts, gens):
        assert g.versions == sorted(g.versions)
        assert_matches(env, p, g, {0: env.dirs[0], 1: env.dirs[1]})


def test_published_version_reaches_engine_and_changes_logprobs(env: Env) -> None:
    eng = env.engine
    prompt = [1, 9, 10, 11]
    greedy = SamplingOptions(temperature=0, max_tokens=16)

    async def main():
        before = await eng.generate(prompt, greedy)
        servicer = WeightSyncServicer()
        server, port = await create_server("127.0.0.1:0", [Registration(
            pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            receiver = ws.make_receiver(ch, "vllm-0", eng.apply_weights, applied_policy_version=eng.policy_version)
            sub = asyncio.create_task(ws.subscribe_and_apply(ch, "vllm-0", eng.apply_weights,
                                                             receiver=receiver))
            await ws.publish(ch, eng.policy_version + 1, env.weights(2), bucket_bytes=64 << 10)
            await asyncio.wait_for(receiver.wait_applied(2), 30)
            after = await eng.generate(prompt, greedy)
            sub.cancel()
            await asyncio.gather(sub, return_exceptions=True)
            state = servicer.store.replicas["vllm-0"]
        await server.stop(0)
        return before, after, state

    before, after, state = env.run(main())
    assert eng.policy_version == 2 and (state.applied_policy_version, state.last_ok) == (2, True)
    assert set(after.versions) == {2}
    assert_matches(env, prompt, after, {2: env.dirs[2]})
    # The new weights give different log-probs for the old continuation.
    old_under_new = reference_logprobs(env.dirs[2], prompt, before.token_ids)
    assert (old_under_new - torch.tensor(before.logprobs)).abs().max() > 1e-2


def test_score_matches_the_reference_model(env: Env) -> None:
    """vLLM's Score (prompt log-probs): entry t is log p(token t | tokens < t) of the served
    version, as transformers computes it; entry 0 is 0."""
    eng = env.engine
    seqs = [[1, 9, 10, 11, 12, 30, 31], [4, 5], [7]]
    rows = env.run(eng.score(seqs))
    mdir = env.dirs[eng.policy_version] if eng.policy_version < len(env.dirs) else None
    assert mdir is not None
    for seq, row in zip(seqs, rows):
        assert len(row) == len(seq) and row[0] == 0.0
        if len(seq) > 1:
            ref = reference_logprobs(mdir, seq[:1], seq[1:])
            assert (torch.tensor(row[1:]) - ref).abs().max().item() < ATOL
    with pytest.raises(ValueError, match="outside"):
        env.run(eng.score([[1, 10**6]]))


def test_a_version_that_does_not_fit_is_refused_whole_and_the_old_one_served(env: Env) -> None:
    """A version with one weight of the wrong shape, or one weight missing, or an unknown one:
    refused before anything is reloaded; the engine serves the old version on, exactly."""
    eng = env.engine
    weights = env.weights(1)
    names = [n for n, _ in weights]
    bad = names[len(names) // 2]
    cut = [(n, t[..., :-1].contiguous() if n == bad else t) for n, t in weights]
    short = [(n, t) for n, t in weights if n != bad]
    extra = [*weights, ("model.layers.99.mlp.up_proj.weight", weights[0][1])]
    prompt, greedy = [1, 2, 3, 4], SamplingOptions(max_tokens=8, temperature=0.0)
    version = eng.policy_version

    async def main():
        before = await eng.generate(prompt, greedy)
        for version_tensors, why in ((cut, "has shape"), (short, "lacks"), (extra, "not in the served")):
            with pytest.raises(ValueError, match=why):
                await eng.apply_weights(version + 1, version_tensors)
        return before, await eng.generate(prompt, greedy)

    before, after = env.run(main())
    assert eng.policy_version == version
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert set(after.versions) == {version}


def test_a_reload_that_fails_part_way_never_generates_again(env: Env, monkeypatch) -> None:
    """Last in this module: it breaks the shared engine on purpose. A version that passes the
    check but whose reload still fails part-way (here: the check is bypassed) leaves a mix no
    version names; the engine refuses to generate rather than serve it (the rollout service
    then exits to be restarted)."""
    from kiln.services.rollout import vllm_engine
    from kiln.services.rollout.engine import EngineBroken

    eng = env.engine
    weights = env.weights(1)
    names = [n for n, _ in weights]
    bad = names[len(names) // 2]  # past the first weights, which load
    broken = [(n, t[..., :-1].contiguous() if n == bad and t.dim() == 2 else t) for n, t in weights]
    monkeypatch.setattr(vllm_engine, "check_version", lambda v, tensors, shapes: list(tensors))

    async def main():
        with pytest.raises(EngineBroken, match="failed part-way"):
            await eng.apply_weights(eng.policy_version + 1, broken)
        with pytest.raises(EngineBroken):
            await eng.generate([1, 2, 3], SamplingOptions(max_tokens=4))

    version = eng.policy_version
    env.run(main())
    assert eng.policy_version == version  # not relabelled


def test_a_tempered_engine_records_logprobs_at_the_sampling_temperature_and_its_choices(env: Env) -> None:
    # Its own engine: the log-prob mode is engine-wide (vLLM's `logprobs_mode`).
    eng = env.run(VllmEngine.start(EngineSettings(
        model=str(env.dirs[0]), dtype="float32", kv_cache_bytes=64 << 20, seed=0,
        max_model_len=512, tempered_logprobs=True)))
    prompts = [[1, 5 + i, 9, 12 + i] for i in range(4)]

    async def main():
        # Sampled and greedy requests in the same batches.
        return await asyncio.gather(
            *[eng.generate(p, SamplingOptions(temperature=2.0, max_tokens=24, seed=i))
              for i, p in enumerate(prompts)],
            eng.generate(prompts[0], SamplingOptions(temperature=0.0, max_tokens=24)))

    try:
        *hot, greedy = env.run(main())
        assert eng.fingerprint.endswith("logprobs=tempered")
        for p, g in zip(prompts, hot):
            got, ref = torch.tensor(g.logprobs), reference_logprobs(env.dirs[0], p, g.token_ids, 2.0)
            assert (got - ref).abs().max().item() < ATOL
            raw = reference_logprobs(env.dirs[0], p, g.token_ids)
            assert (got - raw).abs().max().item() > 100 * ATOL  # not the raw distribution's
        got = torch.tensor(greedy.logprobs)
        assert (got - reference_logprobs(env.dirs[0], prompts[0], greedy.token_ids)).abs().max().item() < ATOL
        check_tool_choices(env, eng)
    finally:
        env.run(eng.close())


def check_tool_choices(env: Env, eng: VllmEngine) -> None:
    """A request with a `ToolChoiceRule` (rollout.sampling.toolChoiceTemperature): after each
    opening the token is one of its choices, recorded under softmax(logits / Tc) over them
    alone (what the trainer computes); every other token as the request's temperature says."""
    prompt = [1, 6, 9, 13]

    async def first() -> list[int]:  # a seeded draw: the same seed draws it again below
        return (await eng.generate(prompt, SamplingOptions(temperature=2.0, max_tokens=1, seed=5))).token_ids

    opening = tuple(env.run(first()))
    # After the opening one of 30, 31, 32; after each of those, one of its own pair.
    rule = ToolChoiceRule(((opening, (30, 31, 32), 4.0),
                           *(((*opening, k), (k + 10, k + 20), 1.5) for k in (30, 31, 32))))
    gen = env.run(eng.generate(prompt, SamplingOptions(temperature=2.0, max_tokens=16, seed=5,
                                                       tool_choice=rule)))
    chosen = {i: (ids, temp) for i, ids, temp in rule.positions(gen.token_ids)}
    assert gen.token_ids[0] == opening[0] and 1 in chosen and 2 in chosen
    seq = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = _models[env.dirs[0]](input_ids=seq).logits[0].float()
    for i, tok in enumerate(gen.token_ids):
        row = logits[len(prompt) + i - 1]
        if i in chosen:
            ids, temp = chosen[i]
            assert tok in ids
            ref = torch.log_softmax(choice_logits(row, torch.tensor(ids), 2.0 / temp, 2.0), -1)
        else:
            ref = torch.log_softmax(row / 2.0, -1)
        assert abs(gen.logprobs[i] - float(ref[tok])) < ATOL, i
    # An empty opening is the reply's first token (act or answer) and no later one.
    rule = ToolChoiceRule((((), (40, 41, 42), 4.0),))
    gen = env.run(eng.generate(prompt, SamplingOptions(temperature=2.0, max_tokens=8, seed=7,
                                                       tool_choice=rule)))
    assert [i for i, _, _ in rule.positions(gen.token_ids)] == [0]
    assert gen.token_ids[0] in (40, 41, 42)
    ref = torch.log_softmax(choice_logits(logits[len(prompt) - 1], torch.tensor((40, 41, 42)),
                                          2.0 / 4.0, 2.0), -1)
    assert abs(gen.logprobs[0] - float(ref[gen.token_ids[0]])) < ATOL
