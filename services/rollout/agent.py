"""The agent loop: one episode from prompt to reward, as a token-level trajectory.

    prompt -> [generate one action -> env.step(action) -> append observation] * n -> reward

The model's actions are the engine's own token ids (never re-tokenized), each with the log-prob
the engine sampled it with and the policy version it was generated under; the environment's
observations are tokenized and appended with loss mask 0 and no version. The environment (its
tool calls, sandboxes and verifier) lives behind the sandbox's `EnvClient`, which speaks text;
the engine behind `Engine` (`engine.py`). Both are Protocols with a gRPC/vLLM implementation and
in-process ones for tests.

Thinking modes (`Limits.thinking`): `interleaved` and `preserved` let the model open a `<think>`
block before any action and keep every block in the context (the trajectory is the literal
token sequence the model saw, so nothing is rewritten between turns; within one task's tool
loop the two modes coincide). `off` writes an empty `<think></think>` before each action, as
chat templates do to switch reasoning off: those tokens are context (loss mask 0, no version),
not generated. `turn-level` is not implemented (the job spec rejects it).

Not covered: scheduling many episodes and shipping them (`producer.py`).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from kiln.episode import Demonstration, StepResult
from kiln.services.rollout.engine import Engine, SamplingOptions
from kiln.services.sandbox.client import EnvClient
from kiln.trajectory import Trajectory, spans_from_versions


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...
    def convert_tokens_to_ids(self, token: str) -> int: ...


@dataclass
class Limits:
    """What bounds and shapes an episode."""

    max_turns: int = 8
    max_tokens_per_turn: int = 64
    max_total_tokens: int = 1024
    thinking: str = "interleaved"
    """`interleaved`, `preserved` or `off` (see the module doc)."""

    def __post_init__(self) -> None:
        if self.thinking not in THINKING_MODES:
            raise ValueError(f"thinking={self.thinking!r} is not one of {THINKING_MODES}")


THINKING_MODES = ("interleaved", "preserved", "off")
#: Written before each action when thinking is off.
EMPTY_THINK = "<think></think>"


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def stop_token_ids(tokenizer: Tokenizer, stop: list[str]) -> list[int]:
    """The environment's stop strings must each be one token of the tokenizer."""
    ids = []
    for s in stop:
        tok = encode(tokenizer, s)
        if len(tok) != 1:
            raise ValueError(f"stop string {s!r} is {len(tok)} tokens in this tokenizer; "
                             "the environment's tags must be special tokens")
        ids.append(tok[0])
    return ids


async def run_episode(engine: Engine, env: EnvClient, tokenizer: Tokenizer, *, task_set: str,
                      index: int, sampling: SamplingOptions, limits: Limits, group_id: str = "",
                      ) -> Trajectory:
    """Play one episode; always closes the environment's episode, even on error."""
    ep = await env.open(task_set, index, limits.max_turns)
    try:
        stops = stop_token_ids(tokenizer, ep.stop)
        tokens = encode(tokenizer, ep.prompt)
        prompt_len = len(tokens)
        mask = [0] * prompt_len
        logp = [0.0] * prompt_len
        versions = [-1] * prompt_len
        result = StepResult()
        flags: list[str] = []
        index_hashes: list[int] = []
        prefill = encode(tokenizer, EMPTY_THINK) if limits.thinking == "off" else []
        for _turn in range(limits.max_turns):
            budget = min(limits.max_tokens_per_turn, limits.max_total_tokens - len(tokens) - len(prefill))
            if budget <= 0:
                flags.append("truncated")
                break
            tokens += prefill
            mask += [0] * len(prefill)
            logp += [0.0] * len(prefill)
            versions += [-1] * len(prefill)
            gen = await engine.generate(tokens, dataclasses.replace(
                sampling, max_tokens=budget, stop_token_ids=tuple(stops)))
            tokens += gen.token_ids
            mask += [1] * len(gen.token_ids)
            logp += gen.logprobs
            versions += gen.versions
            # Each generation's hashes cover the whole sequence so far; the last one's win.
            index_hashes = list(gen.index_hashes) or index_hashes
            action = tokenizer.decode(prefill + list(gen.token_ids), skip_special_tokens=False)
            result = await env.step(ep.episode_id, action)
            if result.done:
                break
            obs = encode(tokenizer, result.observation)
            tokens += obs
            mask += [0] * len(obs)
            logp += [0.0] * len(obs)
            versions += [-1] * len(obs)
        else:
            flags.append("max_turns")
        if not result.done:
            # Out of budget before the model answered: reward 0, as the verifier gives for
            # "no answer"; the flag says why.
            result = StepResult(reward=0.0, reward_parts={"answered": 0.0}, verifier_output="no answer")
        traj = Trajectory(
            id=uuid.uuid4().hex, task_id=ep.task_id, group_id=group_id or uuid.uuid4().hex,
            env=ep.env, tokens=tokens, loss_mask=mask, logp_infer=logp,
            version_spans=spans_from_versions(versions), prompt_len=prompt_len,
            reward=result.reward, reward_parts=dict(result.reward_parts),
            verifier_output=result.verifier_output, flags=flags + list(result.flags),
            sandbox_image_digest=result.sandbox_image_digest,
            engine_fingerprint=engine.fingerprint, index_hashes=index_hashes,
            created_at=time.time())
        return traj
    finally:
        await env.close(ep.episode_id)


def demonstration_trajectory(demo: Demonstration, tokenizer: Tokenizer, *, version: int,
                             group_id: str = "") -> Trajectory:
    """An expert episode as a trajectory: actions trained on, prompt and observations not.

    The tokens are attributed to the current policy version so freshness control treats
    demonstrations like fresh data; `logp_infer` is 0 (SFT does not use it).
    """
    tokens: list[int] = []
    mask: list[int] = []
    prompt_len = 0
    for i, (text, trained) in enumerate(demo.segments):
        ids = encode(tokenizer, text)
        if i == 0:
            prompt_len = len(ids)
        tokens += ids
        mask += [int(trained)] * len(ids)
    versions = [version if m else -1 for m in mask]
    traj = Trajectory(
        id=uuid.uuid4().hex, task_id=demo.task_id, group_id=group_id or uuid.uuid4().hex,
        env="demonstration", tokens=tokens, loss_mask=mask, logp_infer=[0.0] * len(tokens),
        version_spans=spans_from_versions(versions), prompt_len=prompt_len, reward=demo.reward,
        verifier_output=demo.verifier_output, flags=["demonstration"], created_at=time.time())
    return traj
