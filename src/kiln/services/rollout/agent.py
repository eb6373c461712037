"""The agent loop: one episode from prompt to reward, as a token-level trajectory.

    prompt -> [sample one reply -> env.step(action) -> append the tools' outputs] * n -> reward

The model's replies are the engine's own token ids (never re-tokenized), each with the log-prob
the engine sampled it with and the policy version it was generated under; everything else (the
prompt, the tools' outputs, the format's framing) has loss mask 0 and no version. The model's
format (`formats/`: its chat template and tool-call syntax, or the plain tags protocol) turns
the episode into tokens and each reply into an action; the environment (its tools, sandboxes and
verifier) lives behind the sandbox's `EnvClient`; the engine behind `Engine` (`engine.py`).
Each is a Protocol with a gRPC or vLLM implementation and in-process ones for tests.

Thinking modes (`Limits.thinking`): `interleaved` and `preserved` let the model think before any
reply and keep every thought in the context (the trajectory is the literal token sequence the
model saw, so nothing is rewritten between turns; within one task's tool loop the two modes
coincide). `off` writes an empty think block before each reply, as chat templates do to switch
reasoning off: those tokens are context (loss mask 0, no version), not generated.
`turn-level` lets the model think on the turns the job's rule says (`formats.thinks_on`) and
drops each thought from later turns' context; the episode then has one segment per stretch
whose context only grew, each its own trajectory with the episode's reward and group (the
buffer's group is then counted in trajectories, so a group's baseline weighs a segmented
episode once per segment).

With `sampling.toolChoiceTemperature` each request also carries the episode's tool-choice rule
(where a reply names its tool or an enumerated argument, and among which tokens: the format's
`tool_choice`), and each trajectory records the tokens that were such choices. An environment
may withdraw tools as the episode goes (`StepResult.tools`): the next replies choose among the
rest.

Not covered: scheduling many episodes and shipping them (`producer.py`).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from kiln.episode import Demonstration, EpisodeInfo, StepResult
from kiln.routing import RoutedExperts, merge_routing
from kiln.services.rollout.engine import Engine, SamplingOptions, ToolChoiceRule
from kiln.services.rollout.formats import THINKING_MODES, Format, demonstration_tokens
from kiln.services.sandbox.client import EnvClient
from kiln.trajectory import ToolChoice, Trajectory, spans_from_versions


@dataclass
class Limits:
    """What bounds and shapes an episode."""

    max_turns: int = 8
    max_tokens_per_turn: int = 64
    max_total_tokens: int = 1024
    thinking: str = "interleaved"
    """`interleaved`, `preserved` or `off` (see the module doc); the format applies it."""

    def __post_init__(self) -> None:
        if self.thinking not in THINKING_MODES:
            raise ValueError(f"thinking={self.thinking!r} is not one of {THINKING_MODES}")


class EpisodeStale(Exception):
    """The episode was stopped before its next generation: its oldest token is already too old
    to be trained (freshness control would drop it), so finishing it would waste the engine."""


@dataclass
class _Segment:
    """One stretch of an episode whose context only grew: one trajectory."""

    tokens: list[int]
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    routed: RoutedExperts | None = None
    """MoE: the experts chosen for this segment's positions, merged over its generations."""
    choices: list[tuple[int, tuple[int, ...], float]] = field(default_factory=list)
    """(position, the tokens it was chosen among, at what temperature) of each token sampled
    as a choice (`ToolChoiceRule`)."""

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.mask, self.logp, self.versions = ([0] * self.prompt_len, [0.0] * self.prompt_len,
                                               [-1] * self.prompt_len)

    def context(self, ids: list[int]) -> None:
        self.tokens.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logp.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))


async def run_episode(engine: Engine, env: EnvClient, fmt: Format, *, task_set: str,
                      index: int, sampling: SamplingOptions, limits: Limits, group_id: str = "",
                      stale: Callable[[int], bool] | None = None,
                      score: Callable[[EpisodeInfo, StepResult], Awaitable[StepResult]] | None = None,
                      ) -> list[Trajectory]:
    """Play one episode: its trajectories, one per segment (one, unless turn-level thinking
    dropped a thought from the context), all with the episode's reward. Always closes the
    environment's episode, even on error.

    `stale(oldest)`, asked before every generation after the first with the oldest policy
    version among the episode's tokens, stops the episode (EpisodeStale) when it says True.
    `score(episode, result)`, when given, rescores the result of an episode that ended (the
    task set's reward models, `reward_models.py`)."""
    ep = await env.open(task_set, index, limits.max_turns)
    try:
        conv = fmt.conversation(ep)
        base, sampling = sampling, _with_tool_choice(sampling, conv, ep)
        rule = sampling.tool_choice
        seg = _Segment(conv.prompt())
        segments = [seg]
        result = StepResult()
        flags: list[str] = []
        index_hashes: list[int] = []
        oldest: int | None = None
        for turn in range(limits.max_turns):
            if stale is not None and oldest is not None and stale(oldest):
                raise EpisodeStale(f"{ep.task_id}: stopped before turn {turn + 1}, its first "
                                   f"tokens (version {oldest}) are too old to train on")
            prefix = conv.action_prefix()
            budget = min(limits.max_tokens_per_turn,
                         limits.max_total_tokens - len(seg.tokens) - len(prefix))
            if budget <= 0:
                flags.append("truncated")
                break
            seg.context(prefix)
            gen = await engine.generate(seg.tokens, dataclasses.replace(
                sampling, max_tokens=budget, stop_token_ids=tuple(fmt.stop_token_ids)))
            if rule is not None:
                seg.choices += [(len(seg.tokens) + i, ids, temp)
                                for i, ids, temp in rule.positions(gen.token_ids)]
            seg.tokens += gen.token_ids
            seg.mask += [1] * len(gen.token_ids)
            seg.logp += gen.logprobs
            seg.versions += gen.versions
            if gen.versions:
                oldest = min(gen.versions) if oldest is None else min(oldest, min(gen.versions))
            # Each generation's hashes cover the whole sequence so far; the last one's win.
            index_hashes = list(gen.index_hashes) or index_hashes
            seg.routed = merge_routing(seg.routed, gen.routed_experts)
            result = await env.step(ep.episode_id, conv.read_reply(gen.token_ids))
            if result.done:
                break
            if result.tools is not None and rule is not None:
                sampling = _with_tool_choice(base, conv, ep, result.tools)
                rule = sampling.tool_choice
            observed = conv.observation(result.outputs)
            if conv.restarted:
                seg = _Segment(observed)
                segments.append(seg)
            else:
                seg.context(observed)
        else:
            flags.append("max_turns")
        if not result.done:
            # Out of budget before the episode ended: reward 0, as the verifier gives for "no
            # answer"; the flag says why.
            result = StepResult(reward=0.0, reward_parts={"answered": 0.0}, verifier_output="no answer")
        elif score is not None:
            result = await score(ep, result)
        group = group_id or uuid.uuid4().hex
        many = len(segments) > 1
        return [Trajectory(
            id=uuid.uuid4().hex, task_id=ep.task_id, group_id=group,
            env=ep.env, tokens=s.tokens, loss_mask=s.mask, logp_infer=s.logp,
            version_spans=spans_from_versions(s.versions), prompt_len=s.prompt_len,
            reward=result.reward, reward_parts=dict(result.reward_parts),
            verifier_output=result.verifier_output,
            flags=flags + list(result.flags) + ([f"segment:{i}"] if many else []),
            sandbox_image_digest=result.sandbox_image_digest,
            engine_fingerprint=engine.fingerprint, index_hashes=index_hashes if s is seg else [],
            routed_experts=s.routed, created_at=time.time(),
            tool_choice=_recorded(s.choices))
            for i, s in enumerate(segments) if any(s.mask) or not many]
    finally:
        await env.close(ep.episode_id)


def _with_tool_choice(sampling: SamplingOptions, conv, ep: EpisodeInfo,
                      offered: list[str] | None = None) -> SamplingOptions:
    """`sampling` with this episode's tool-choice rule when the job sets a tool-choice
    temperature and the episode has tools; among the tools `offered` (`StepResult.tools`),
    when the environment has withdrawn some. A greedy request (evaluation) takes the rule's
    constraints alone: it decodes the policy that training sampled from."""
    if sampling.tool_choice_temperature is None or not ep.tools:
        return sampling
    choice = getattr(conv, "tool_choice", None)
    if choice is None:
        raise ValueError(f"sampling.toolChoiceTemperature: the {type(conv).__name__} format has no "
                         "single place where a reply names its tool; use toolCallFormat 'tags'")
    # Tool names at the tool-choice temperature, an argument's values at the request's own;
    # greedy requests take the argmax among them (recorded at temperature 1).
    if sampling.temperature == 0:
        temperature = {"tool": 1.0, "argument": 1.0}
    else:
        temperature = {"tool": sampling.tool_choice_temperature, "argument": sampling.temperature}
    choices = tuple((tuple(opening), tuple(ids), temperature[what])
                    for opening, ids, what in choice(offered))
    return dataclasses.replace(sampling, tool_choice=ToolChoiceRule(choices))


def _recorded(choices: list[tuple[int, tuple[int, ...], float]]) -> ToolChoice | None:
    if not choices:
        return None
    return ToolChoice([i for i, _, _ in choices], [t for _, ids, _ in choices for t in ids],
                      [len(ids) for _, ids, _ in choices], [temp for _, _, temp in choices])


def demonstration_trajectory(demo: Demonstration, fmt: Format, *, version: int,
                             group_id: str = "") -> Trajectory:
    """An expert episode as a trajectory: its replies trained on, prompt and outputs not.

    The tokens are attributed to the current policy version so freshness control treats
    demonstrations like fresh data; `logp_infer` is 0 (SFT does not use it).
    """
    tokens, mask, prompt_len = demonstration_tokens(fmt, demo)
    versions = [version if m else -1 for m in mask]
    return Trajectory(
        id=uuid.uuid4().hex, task_id=demo.task_id, group_id=group_id or uuid.uuid4().hex,
        env="demonstration", tokens=tokens, loss_mask=mask, logp_infer=[0.0] * len(tokens),
        version_spans=spans_from_versions(versions), prompt_len=prompt_len, reward=demo.reward,
        verifier_output=demo.verifier_output, flags=["demonstration"], created_at=time.time())
