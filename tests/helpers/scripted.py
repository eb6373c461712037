"""A scripted engine and a one-call environment for the rollout format tests: the engine
"samples" the ids it is given, so a test knows exactly which tokens were sampled."""
from __future__ import annotations

from kiln.env import string_tool
from kiln.episode import EpisodeInfo, Message, StepResult, ToolOutput
from kiln.services.rollout.engine import Generation, SamplingOptions

BASH = string_tool("bash", "Run a command.", command="the command")
EPISODE = EpisodeInfo("e1", "t1", "terminal",
                      [Message("system", "Be brief."), Message("user", "Count the files.")], [BASH])


class ScriptedEngine:
    """An engine that 'samples' a fixed sequence of replies (the ids given), so the test knows
    exactly which tokens were sampled. The one stand-in here: the code under test is the agent
    loop and the format."""

    policy_version = 3
    fingerprint = "scripted"

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_token_ids, sampling: SamplingOptions) -> Generation:
        self.prompts.append(list(prompt_token_ids))
        ids = self.replies.pop(0)
        return Generation(ids, [-0.5] * len(ids), [self.policy_version] * len(ids), "stop")


class OneCallEnv:
    """An environment client: one bash call, then an answer ends the episode."""

    def __init__(self) -> None:
        self.actions = []

    async def open(self, task_set, index, max_actions):
        return EPISODE

    async def step(self, episode_id, action):
        self.actions.append(action)
        if action.tool_calls:
            return StepResult([ToolOutput(c.id, c.name, "exit code 0\nstdout:\n3") for c in action.tool_calls])
        return StepResult(done=True, reward=1.0)

    async def close(self, episode_id):
        pass
