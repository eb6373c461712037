"""Scripted agent swarms on the real `wide` environment, for the swarm tests: the job, a
tokenizer trained on the job's tasks (the tags format's special tokens included), the episode
manager whose sub-tasks' shell calls run in bubblewrap sandboxes, and two scripted policies (a
function of the decoded context) -- the orchestrator replaying a script of calls and the
subagents following their chain -- so that each test knows which calls were made and in which
order; `play` runs one swarm episode with them, `swarm_producer` a job's rollout producer."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

from transformers import AutoTokenizer

from kiln.api.spec import RLJob
from kiln.models.tiny import train_tokenizer
from kiln.services.rollout.agent import Limits
from kiln.services.rollout.engine import Generation, SamplingOptions
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.swarm import Subagents, run_swarm_episode
from kiln.services.sandbox.client import LocalEnvClient
from kiln.services.sandbox.environments.chain import SPECIAL_TOKENS as TAGS
from kiln.services.sandbox.environments.wide import WideEnvironment, WideLookupEnvironment
from kiln.services.sandbox.episodes import EpisodeManager
from kiln.swarm import Parl

WIDTH = 3


def job_doc(**swarm) -> dict:
    stage = {"name": "swarm", "type": "rl", "tasks": ["wide"]}
    if swarm:
        stage["swarm"] = swarm
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "swarm"},
            "spec": {"model": {"path": "m"},
                     "tasks": [{"name": "wide", "env": "wide", "generate": {"count": 4, "numSteps": WIDTH}},
                               {"name": "parts", "env": "wide-lookup", "generate": {"count": 4}}],
                     "stages": [{"name": "subagents", "type": "sft", "tasks": ["parts"]}, stage]}}


def train_swarm_tokenizer(directory: Path):
    """A tokenizer trained in `directory` on the job's two task sets (the `tok` fixture)."""
    job = RLJob.model_validate(job_doc())
    envs = [(WideEnvironment(), None), (WideLookupEnvironment(), None)]
    texts, words = [], []
    for (env, _), spec in zip(envs, job.spec.tasks):
        tasks = env.generate_tasks(spec.generate)
        texts += env.tokenizer_corpus(tasks)
        words += env.tokenizer_words(tasks)
    path = train_tokenizer(texts, directory, vocab_size=400,
                           special_tokens=list(TAGS) + sorted(set(words)), split_digits=True)
    return AutoTokenizer.from_pretrained(str(path))


def episode_manager(base_dir: Path) -> EpisodeManager:
    """The job's episode manager under `base_dir` (the `manager` fixture)."""
    return EpisodeManager(RLJob.model_validate(job_doc()), base_dir=base_dir, owner="swarm-test")


class Scripted:
    """An engine whose reply is `policy(context text)`; counts generations running at once."""

    fingerprint = "scripted"

    def __init__(self, tok, policy, delay: float = 0.0, version: int = 0) -> None:
        self.tok, self.policy, self.delay, self.policy_version = tok, policy, delay, version
        self.running = self.peak = self.calls = 0

    async def generate(self, prompt, sampling):
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.calls += 1
        try:
            await asyncio.sleep(self.delay)
            reply = self.policy(self.tok.decode(prompt, skip_special_tokens=False))
        finally:
            self.running -= 1
        ids = self.tok.encode(reply, add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), [self.policy_version] * len(ids), "stop")


class Recording(Scripted):
    """A scripted engine that keeps the tool-choice rule of every request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rules = []

    async def generate(self, prompt, sampling):
        self.rules.append(sampling.tool_choice)
        return await super().generate(prompt, sampling)


def subagent_policy(text: str) -> str:
    """Follow the chain: cat the start, then each value read, then answer the last."""
    start, hops = map(int, re.search(r"end of (\d+), (\d+) hops", text).groups())
    seen = re.findall(r"<obs>(\d+)</obs>", text)
    if len(seen) < hops:
        return f"<call>bash cat notes/{seen[-1] if seen else start}</call>"
    return f"<answer>{seen[-1]}</answer>"


def orchestrator(script: list[str]):
    """Replies in order; `ANSWER` becomes the ends read from the waits, in s1, s2, ... order."""
    def policy(text: str) -> str:
        reply = script[len(re.findall(r"</call>", text))]
        if reply == "ANSWER":
            ends = dict(re.findall(r"(s\d+): (\d+)", text))
            return f"<answer>{' '.join(ends[k] for k in sorted(ends))}</answer>"
        return reply
    return policy


def starts(manager) -> list[int]:
    return manager.task("wide", 0).starts


EPISODE = Limits(max_turns=12, max_tokens_per_turn=16, max_total_tokens=512)
"""The orchestrator's limits in these tests."""


def play(manager, tok, script, *, parl=Parl(0.5, 0.5, WIDTH), sub_engine=None, engine=None,
         max_subagents=8, delay=0.05, sampling=SamplingOptions(), budget=None,
         end_on_refusal=False, credit="episode", withdraw=False):
    fmt = make_format("tags", tok)
    sub_engine = sub_engine or Scripted(tok, subagent_policy, delay)
    subagents = Subagents(sub_engine, fmt, SamplingOptions(), Limits(max_turns=4, max_tokens_per_turn=16),
                          max_per_episode=max_subagents)
    engine = engine or Scripted(tok, orchestrator(script))
    trajs = asyncio.run(run_swarm_episode(
        engine, LocalEnvClient(manager), fmt, subagents, parl, task_set="wide", index=0,
        budget=budget, end_on_refusal=end_on_refusal, credit=credit, withdraw=withdraw,
        sampling=sampling, limits=EPISODE))
    return trajs[0], sub_engine


def swarm_producer(manager, tok, engine, settings, *, sampling=SamplingOptions(),
                   max_subagents=8):
    """The rollout producer of a job whose stage `swarm` has `settings`, on scripted engines."""
    from kiln.services.rollout.producer import Producer, ProducerConfig
    from kiln.services.rollout.swarm_run import SwarmRun
    fmt = make_format("tags", tok)
    subagents = Subagents(Scripted(tok, subagent_policy), fmt, SamplingOptions(),
                          Limits(max_turns=4, max_tokens_per_turn=16),
                          max_per_episode=max_subagents)
    return Producer(ProducerConfig(sampling=sampling, limits=EPISODE, max_concurrent=1),
                    engine, LocalEnvClient(manager), fmt, None,
                    extensions={"swarm": SwarmRun(settings, subagents, max_steps=8)})


def serial(manager) -> list[str]:
    return [r for k in range(1, len(starts(manager)) + 1)
            for r in (f"<call>assign {k}</call>", "<call>wait all</call>")
            ] + ["ANSWER"]


def parallel(manager) -> list[str]:
    # `next`: the k-th assignment takes the k-th chain (the example's demonstrations' form).
    return (["<call>assign next</call>" for _ in starts(manager)]
            + ["<call>wait all</call>", "ANSWER"])
