"""The environment's side of an episode, as rollout and sandbox both see it, torch-free.

An episode is one task played through an environment's tools: rollout opens it (`EpisodeInfo`:
the prompt and the strings an action stops at), sends each action the model generated and gets
a `StepResult` back (the observation to append, or the end of the episode with its reward), and
for SFT asks for a `Demonstration` (the environment's scripted solver's episode). The wire form
is `kiln.v1.Environment` (protos/kiln/v1/env.proto); the sandbox service serves it and
`kiln.services.sandbox.client` is its client.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpisodeInfo:
    episode_id: str
    task_id: str
    env: str
    prompt: str
    """Text the model starts from."""
    stop: list[str]
    """An action ends at the first of these strings (each one token of the model's tokenizer)."""


@dataclass
class StepResult:
    """What one action led to: an observation, or the end of the episode and its reward."""

    observation: str = ""
    """Text to append after the action (never trained on); empty when `done`."""
    done: bool = False
    reward: float = 0.0
    """Set when `done`."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    verifier_output: str = ""
    flags: list[str] = field(default_factory=list)
    """E.g. `invalid_action`, `max_actions`, `tests_modified`."""
    sandbox_image_digest: str = ""


@dataclass
class Demonstration:
    """An expert episode, as text segments; actions are trained on, the rest is not."""

    task_id: str
    segments: list[tuple[str, bool]]
    """(text, trained) in order: the prompt first (never trained), then actions (trained) and
    observations (not)."""
    reward: float
    verifier_output: str
