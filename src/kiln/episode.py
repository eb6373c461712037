"""An episode as rollout and the sandbox service both see it, torch-free.

An episode is one task played through an environment's tools: rollout opens it (`EpisodeInfo`:
the messages the model starts from and the tools on offer), sends what each reply asked for
(`Action`: tool calls, or a final answer) and gets a `StepResult` back (the tools' outputs, or
the end of the episode with its reward); for SFT it asks for a `Demonstration` (the
environment's scripted solution, its tool calls run for real). The wire form is
`kiln.v1.Environment` (src/kiln/protos/kiln/v1/env.proto); the sandbox service serves it and
`kiln.services.sandbox.client` is its client. How these become tokens is rollout's business
(`kiln.services.rollout.formats`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.env import ToolCall, ToolSpec


@dataclass
class Message:
    role: str
    """`system` or `user` (the episode's opening), `assistant`, `tool`."""
    content: str


@dataclass
class EpisodeInfo:
    episode_id: str
    task_id: str
    env: str
    messages: list[Message]
    """What the model starts from: an optional system message, then the task."""
    tools: list[ToolSpec]


@dataclass
class Action:
    """What one model reply asked for."""

    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    """The reply's text; the final answer when there are no tool calls."""
    unparseable: bool = False
    """The reply could not be read as tool calls or an answer; `problem` says why."""
    problem: str = ""


@dataclass
class ToolOutput:
    tool_call_id: str
    name: str
    content: str


@dataclass
class StepResult:
    """What one action led to: the tools' outputs, or the end of the episode and its reward."""

    outputs: list[ToolOutput] = field(default_factory=list)
    """One per tool call, to show the model (never trained on); empty when `done`."""
    done: bool = False
    reward: float = 0.0
    """Set when `done`."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    verifier_output: str = ""
    flags: list[str] = field(default_factory=list)
    """E.g. `invalid_action`, `max_actions`, `tests_modified`."""
    sandbox_image_digest: str = ""
    answer: str = ""
    """Set when `done`: the final answer the episode was graded on ("" when none)."""
    reference: str = ""
    """Set when `done`: the task's reference answer for a judge (`Environment.reference`), or ""."""
    tools: list[str] | None = None
    """The tools the episode offers from the next reply on, by name, when that changed (an
    agent swarm withdraws `assign` at its subagent limit, `SwarmSettings.withdraw_at_limit`);
    None: as before. It binds where replies choose their tool among tokens
    (`rollout.sampling.toolChoiceTemperature`): a tool left out is not among the choices."""


@dataclass
class Turn:
    """One assistant turn (of a demonstration, or of an episode's transcript) and what its tool
    calls returned."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """None: `content` is the final answer."""
    outputs: list[ToolOutput] = field(default_factory=list)


@dataclass
class Demonstration:
    """An expert episode: the assistant turns are trained on, the rest is not."""

    task_id: str
    messages: list[Message]
    tools: list[ToolSpec]
    turns: list[Turn]
    reward: float
    verifier_output: str
