"""The agent loop end to end in one process: a real (tiny, random) model through the torch
engine, real chain episodes whose tool calls run in bubblewrap sandboxes, the real tokenizer.

The environment is used in-process (`LocalEnvClient` over an `EpisodeManager`) instead of over
gRPC; its gRPC servicer is a thin translation tested by the `kiln run` integration test.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kiln.api.validate import load_job
from kiln.env import ToolCall
from kiln.episode import Action
from kiln.models.tiny import make_tiny_model, train_tokenizer
from kiln.services.rollout.agent import Limits, demonstration_trajectory, run_episode
from kiln.services.rollout.engine import EngineSettings, SamplingOptions
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.torch_engine import TorchEngine
from kiln.services.sandbox.client import LocalEnvClient
from kiln.services.sandbox.environments import chain
from kiln.services.sandbox.episodes import EpisodeManager

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    tok_dir = train_tokenizer(chain.corpus_for_tokenizer(300), root / "tok", vocab_size=320,
                              special_tokens=list(chain.SPECIAL_TOKENS))
    model = make_tiny_model(root / "model", tok_dir, hidden_size=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=128, seed=0)
    job = load_job(REPO / "deploy" / "examples" / "quickstart.yaml")
    return model, make_format("tags", AutoTokenizer.from_pretrained(str(model))), job


def test_episode_records_versions_masks_and_reward(setup):
    model, fmt, job = setup

    async def main():
        engine = await TorchEngine.start(EngineSettings(model=str(model), dtype="float32", seed=1))
        env = LocalEnvClient(EpisodeManager(job, base_dir=REPO, owner="test-agent"))
        sampling = SamplingOptions(temperature=1.0, max_tokens=16)
        trajs = [t for ts in await asyncio.gather(*[
            run_episode(engine, env, fmt, task_set="chain-train", index=i, sampling=sampling,
                        limits=Limits(max_turns=3, max_tokens_per_turn=16, max_total_tokens=128),
                        group_id="g") for i in range(4)]) for t in ts]
        assert len(trajs) == 4  # one segment each: nothing rewrote a context
        demo = await env.demonstrate("chain-train", 0, seed=0)
        return trajs, demonstration_trajectory(demo, fmt, version=engine.policy_version)

    trajs, demo = asyncio.run(main())
    for t in trajs:
        t.check()  # spans cover every generated token, in order
        assert t.prompt_len > 0 and not any(t.loss_mask[: t.prompt_len])
        assert t.reward in (0.0, 1.0)
        assert t.group_id == "g"
        assert all(v == 0 for v in t.versions_per_token() if v >= 0)
        generated = [i for i, m in enumerate(t.loss_mask) if m]
        assert generated and all(t.logp_infer[i] <= 0 for i in generated)
        assert len(t.tokens) <= 128 + 16
    # The demonstration: actions trained on, observations (computed by the real tool) not.
    text_by_mask = {0: [], 1: []}
    for tokid, m in zip(demo.tokens, demo.loss_mask):
        text_by_mask[m].append(tokid)
    trained = fmt.tokenizer.decode(text_by_mask[1], skip_special_tokens=False)
    untrained = fmt.tokenizer.decode(text_by_mask[0], skip_special_tokens=False)
    assert "<call>" in trained and "<answer>" in trained and "<obs>" not in trained
    assert "<obs>" in untrained and "<task>" in untrained


def _reply(fmt, episode, text: str) -> Action:
    """A reply the model could have sampled, read by the tags format as rollout reads it."""
    return fmt.conversation(episode).read_reply(fmt.tokenizer.encode(text, add_special_tokens=False))


def test_episode_steps_through_the_sandboxed_tool(setup):
    """Drive an episode with the solver's own actions: outputs come from the sandbox."""
    _, fmt, job = setup

    async def main():
        m = EpisodeManager(job, base_dir=REPO, owner="test-agent2")
        task = m.task("chain-train", 5)
        ep = m.open("chain-train", 5)
        outputs, out = [], None
        current = str(task.start)
        for i in range(task.repeats):
            # Both tools: `step V` is the calculator on V + the task's step.
            text = f"<call>step {current}</call>" if i % 2 == 0 else f"<call>calc {current}{task.step}</call>"
            out = await m.step(ep.episode_id, _reply(fmt, ep, text))
            assert not out.done
            outputs.append(out.outputs[0].content)
            current = outputs[-1]
        out = await m.step(ep.episode_id, _reply(fmt, ep, f"<answer>{current}</answer>"))
        await m.close(ep.episode_id)
        return task, outputs, out

    task, outputs, out = asyncio.run(main())
    assert outputs[-1] == str(task.answer)
    assert out.done and out.reward == 1.0


def test_invalid_action_and_turn_budget_end_with_zero_reward(setup):
    _, fmt, job = setup

    async def main():
        m = EpisodeManager(job, base_dir=REPO, owner="test-agent3")
        ep = m.open("chain-train", 1)
        bad = await m.step(ep.episode_id, _reply(fmt, ep, "hello</call>"))
        ep2 = m.open("chain-train", 1, max_actions=2)
        # `step` takes an integer: this call does not fit the tool's schema.
        misfit = _reply(fmt, ep2, "<call>step 1+1</call>")
        first = await m.step(ep2.episode_id, Action([ToolCall("calc", {"expression": "1+1"})]))
        second = await m.step(ep2.episode_id, _reply(fmt, ep2, "<call>calc 2+2</call>"))
        with pytest.raises(ValueError):
            await m.step(ep2.episode_id, _reply(fmt, ep2, "<call>calc 3+3</call>"))
        await m.close_all()
        return bad, misfit, first, second

    bad, misfit, first, second = asyncio.run(main())
    assert bad.done and bad.reward == 0.0 and "invalid_action" in bad.flags
    assert misfit.unparseable and "does not match" in misfit.problem
    assert first.outputs[0].content == "2" and not first.done
    assert second.done and second.reward == 0.0 and "max_actions" in second.flags


def test_demonstrations_are_fixed_per_task_and_asked_for_once(setup):
    """SFT revisits a finite pool: each task's demonstration comes from the environment (and
    its sandboxes) once; later draws reuse it under a fresh trajectory id."""
    from kiln.services.rollout.producer import DEMONSTRATE, Mode, Producer, ProducerConfig

    model, fmt, job = setup

    class CountingEnv(LocalEnvClient):
        calls: list[int] = []

        async def demonstrate(self, task_set, index, seed):
            self.calls.append(index)
            return await super().demonstrate(task_set, index, seed)

    class Collect:  # the one buffer call a producer makes
        def __init__(self):
            self.got = []

        async def put_async(self, trajectories, group_size=None, *, still_wanted=lambda: True):
            self.got.extend(trajectories)
            return True

    class Versioned:  # the producer reads only the engine's version when demonstrating
        policy_version = 0

    async def main():
        env, sink = CountingEnv(EpisodeManager(job, base_dir=REPO, owner="test-demo")), Collect()
        config = ProducerConfig(sampling=SamplingOptions(), max_concurrent=4,
                                limits=Limits(max_turns=8, max_tokens_per_turn=24, max_total_tokens=200))
        producer = Producer(config, Versioned(), env, fmt, sink)
        producer.start()
        producer.set_mode(Mode(DEMONSTRATE, stage="sft", task_sets=[("chain-train", 3)], seed=1))
        while len(sink.got) < 12:
            await asyncio.sleep(0.01)
        await producer.stop()
        return env.calls, sink.got

    calls, got = asyncio.run(main())
    assert sorted(calls) == sorted(set(calls)) and set(calls) <= {0, 1, 2}
    assert len({t.id for t in got}) == len(got)
    by_task: dict[str, list[int]] = {}
    for t in got:
        assert by_task.setdefault(t.task_id, t.tokens) == t.tokens
    assert len(by_task) == len(set(calls))


def test_thinking_off_writes_an_empty_block_before_each_action(setup):
    from kiln.services.rollout.formats.tags import EMPTY_THINK

    model, fmt, job = setup

    async def main():
        engine = await TorchEngine.start(EngineSettings(model=str(model), dtype="float32", seed=2))
        env = LocalEnvClient(EpisodeManager(job, base_dir=REPO, owner="test-think"))
        return [t for ts in await asyncio.gather(*[
            run_episode(engine, env, fmt, task_set="chain-train", index=i,
                        sampling=SamplingOptions(temperature=1.0, max_tokens=16),
                        limits=Limits(max_turns=3, max_tokens_per_turn=16, max_total_tokens=128,
                                      thinking="off"))
            for i in range(3)]) for t in ts]

    fmt = make_format("tags", fmt.tokenizer, thinking="off")
    block = fmt.tokenizer.encode(EMPTY_THINK, add_special_tokens=False)
    for t in asyncio.run(main()):
        t.check()
        # Every run of generated tokens starts right after the empty block, which is context.
        starts = [i for i in range(1, len(t.tokens)) if t.loss_mask[i] and not t.loss_mask[i - 1]]
        assert starts
        for i in starts:
            assert t.tokens[i - len(block):i] == block
            assert not any(t.loss_mask[i - len(block):i])
    with pytest.raises(ValueError, match="thinking"):
        Limits(thinking="sometimes")
