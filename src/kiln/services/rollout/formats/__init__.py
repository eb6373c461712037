"""How an episode becomes tokens: the model's own format for prompts, replies, tool calls and
tool outputs.

A `Format` is made once per engine (`make_format`); each episode gets a `Conversation` from it,
which renders the opening, reads each reply the model sampled into an `Action` (tool calls, a
final answer, or unparseable), and renders the tools' outputs as the tokens appended after it.
The sampled tokens themselves are never re-tokenized: a conversation only adds the tokens around
them, so the trajectory's tokens are exactly the tokens the engine sampled.

Formats:
- `tags` (`tags.py`): no chat template; the prompt is the task's text, a call is
  `<call>NAME ARG</call>`, an answer `<answer>TEXT</answer>`, an output `<obs>TEXT</obs>`; the
  quickstart's tiny models are trained for it;
- `hermes`, `llama3`, `glm45` (`chat.py`): the tokenizer's chat template (with `tools=`)
  renders the conversation, and replies carry the family's tool calls (`toolcalls.py`).
`choose_format` picks one for a model when the job says `auto`.
"""
from __future__ import annotations

from typing import Any, Protocol

from kiln.episode import Action, Demonstration, EpisodeInfo, ToolOutput

FORMAT_NAMES = ("tags", "hermes", "llama3", "glm45")
THINKING_MODES = ("interleaved", "preserved", "turn-level", "off")


class Conversation(Protocol):
    def prompt(self) -> list[int]:
        """The episode's opening, ready for the first reply."""

    def action_prefix(self) -> list[int]:
        """Context written before each reply (an empty think block when thinking is off);
        not sampled, not trained on."""

    def read_reply(self, token_ids: list[int]) -> Action:
        """Take the tokens the model sampled for one reply (after `action_prefix`)."""

    def observation(self, outputs: list[ToolOutput]) -> list[int]:
        """The tokens that follow the last reply: its tools' outputs, and whatever the format
        writes before the next reply. With turn-level thinking, after a reply that thought, the
        whole context re-rendered without its thoughts instead, and `restarted` is set."""

    restarted: bool
    """The last `observation` returned a new context rather than tokens to append."""

    # A format whose replies name their tool right after a fixed opening also has
    # `tool_choice() -> [(opening ids, token ids, "tool" | "argument"), ...]`: where a reply
    # chooses a tool's name (among their first tokens) or writes a call whose argument is
    # enumerated (among the tokens that keep it valid), in the tags format. `rollout.sampling.toolChoiceTemperature` needs it.


class Format(Protocol):
    name: str
    stop_token_ids: list[int]
    """A reply ends at the first of these (kept in the reply)."""

    def conversation(self, episode: EpisodeInfo) -> Conversation: ...

    def reply_ids(self, content: str, tool_calls: list) -> list[int]:
        """The tokens of a scripted reply (demonstrations), as the model is to sample them."""


def demonstration_tokens(fmt: Format, demo: Demonstration) -> tuple[list[int], list[int], int]:
    """(tokens, loss mask, prompt length) of an expert episode: its replies are trained on,
    the prompt, prefixes and tool outputs are not."""
    episode = EpisodeInfo("demonstration", demo.task_id, "", demo.messages, demo.tools)
    conv = fmt.conversation(episode)
    tokens = conv.prompt()
    prompt_len = len(tokens)
    mask = [0] * prompt_len
    for i, turn in enumerate(demo.turns):
        prefix = conv.action_prefix()
        reply = fmt.reply_ids(turn.content, turn.tool_calls)
        conv.read_reply(reply)
        tokens += prefix + reply
        mask += [0] * len(prefix) + [1] * len(reply)
        if turn.tool_calls and i < len(demo.turns) - 1:
            obs = conv.observation(turn.outputs)
            tokens += obs
            mask += [0] * len(obs)
    return tokens, mask, prompt_len


def choose_format(setting: str, tokenizer: Any, model_type: str = "") -> str:
    """The format to use: `setting` unless it is `auto`, which means the tokenizer's chat
    template when it renders tools (the family's tool calls: glm45 for a template that writes
    GLM's `<arg_key>`, llama3 for Llama models, hermes otherwise), else `tags`."""
    if setting != "auto":
        if setting not in FORMAT_NAMES:
            raise ValueError(f"tool-call format {setting!r} is not one of {('auto', *FORMAT_NAMES)}")
        return setting
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" not in template:
        return "tags"
    if "<arg_key>" in template:
        return "glm45"
    return "llama3" if model_type == "llama" else "hermes"


def thinks_on(turn: int, think_every: int) -> bool:
    """Turn-level thinking: whether the model may think on `turn` (0-based): the first turn,
    and every `think_every`-th after it (0: the first alone)."""
    return turn == 0 or (think_every > 0 and turn % think_every == 0)


def make_format(name: str, tokenizer: Any, *, thinking: str = "interleaved",
                think_every: int = 0) -> Format:
    if thinking not in THINKING_MODES:
        raise ValueError(f"thinking={thinking!r} is not one of {THINKING_MODES}")
    if name == "tags":
        if thinking == "turn-level":
            raise ValueError("thinking 'turn-level' needs a chat-template format (hermes or "
                             "llama3): the tags format has no turns to re-render")
        from kiln.services.rollout.formats.tags import TagsFormat
        return TagsFormat(tokenizer, thinking=thinking)
    if name in ("hermes", "llama3", "glm45"):
        from kiln.services.rollout.formats.chat import ChatFormat
        return ChatFormat(tokenizer, name, thinking=thinking, think_every=think_every)
    raise ValueError(f"tool-call format {name!r} is not one of {FORMAT_NAMES}")
