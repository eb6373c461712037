"""The tags format: a plain-text protocol without a chat template, for models trained on it.

    <task>37 *7%97+5 x4</task>          the task's text (the user message) is the prompt
    <call>step 37</call>                a reply that calls a tool: NAME, a space, its argument
    <obs>70</obs>                       the tool's output
    <answer>45</answer>                 a reply that answers (the episode ends)

A reply may start with `<think>...</think>`. A tool's one argument is the first required
property of its schema, and must fit it. Every tag is one token of the tokenizer, and a reply
stops at `</call>` or `</answer>`.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from kiln.env import ToolCall, ToolSpec
from kiln.episode import Action, EpisodeInfo, ToolOutput
from kiln.services.rollout.formats.toolcalls import checked

STOP_TAGS = ("</call>", "</answer>")
#: Written before each reply when thinking is off.
EMPTY_THINK = "<think></think>"
_THINK = r"(?:<think>[^<]*</think>)?"
_CALL_RE = re.compile(_THINK + r"<call>([A-Za-z_]\w*) (.*)</call>", re.S)
_ANSWER_RE = re.compile(_THINK + r"<answer>([^<]*)</answer>")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _argument_name(tool: ToolSpec) -> str:
    required = tool.parameters.get("required") or list(tool.parameters.get("properties", {}))
    if not required:
        raise ValueError(f"tool {tool.name!r} takes no argument; the tags format needs one")
    return required[0]


class TagsConversation:
    restarted = False

    def __init__(self, fmt: "TagsFormat", episode: EpisodeInfo) -> None:
        self.fmt, self.episode = fmt, episode
        self.tools = {t.name: t for t in episode.tools}

    def prompt(self) -> list[int]:
        return _encode(self.fmt.tokenizer, "".join(m.content for m in self.episode.messages
                                                   if m.role == "user"))

    def action_prefix(self) -> list[int]:
        return list(self.fmt.prefix)

    def read_reply(self, token_ids: list[int]) -> Action:
        text = self.fmt.tokenizer.decode(self.fmt.prefix + list(token_ids),
                                         skip_special_tokens=False).strip()
        if m := _ANSWER_RE.fullmatch(text):
            return Action(content=m.group(1).strip())
        if m := _CALL_RE.fullmatch(text):
            name, arg = m.group(1), m.group(2)
            tool = self.tools.get(name)
            if tool is None:
                return Action(content=text, unparseable=True, problem=f"unknown tool {name!r}")
            # The argument is taken as written; its schema (a pattern) says what fits.
            call = ToolCall(name, {_argument_name(tool): arg})
            problem = checked([call], list(self.tools.values()))
            if problem:
                return Action(content=text, unparseable=True, problem=problem)
            return Action([call])
        return Action(content=text, unparseable=True,
                      problem=f"not one <call>NAME ARG</call> or <answer>TEXT</answer>: {text[:80]!r}")

    def tool_choice(self, offered: Collection[str] | None = None) -> list[tuple[list[int], list[int], str]]:
        """Where a reply chooses among known tokens, among which, and what it chooses
        (`rollout.sampling.toolChoiceTemperature`):
        - after `<call>`, the first tokens of the tools' names ("tool": the tool-choice
          temperature);
        - a reply's first token, `<call>` or `<answer>` (or `<think>` where it may think), and
          every later token of a call whose argument enumerates its values (a JSON-schema
          `enum`: its calls `NAME VALUE</call>` are a finite set), among those that keep it
          one of them, the closing tag after a whole value being a choice of one ("argument":
          the reply's own temperature).
        So a call cannot come out malformed in a context its policy never saw (`wait all`
        trailing off into text after more assignments than its demonstrations made). Answering
        is not explored at the tool-choice temperature: tried at every turn, it ended episodes
        early, and the penalties on those partial answers taught the policy not to write what
        a right one says. `offered`: the tools the episode offers now (`StepResult.tools`;
        None: all of them); the others are not among the names after `<call>`."""
        enc = lambda text: _encode(self.fmt.tokenizer, text)  # noqa: E731
        names = [n for n in self.tools if offered is None or n in offered]
        if not names:
            raise ValueError(f"the episode offers none of its tools ({', '.join(self.tools)}); a "
                             "reply that chooses its tool needs at least one")
        opening = list(self.fmt.call_opening)
        close = self.fmt.stop_token_ids[STOP_TAGS.index("</call>")]
        starts = ["<call>", "<answer>"] + (["<think>"] if self.fmt.thinking != "off" else [])
        out = [([], sorted(enc(tag)[0] for tag in starts), "argument"),
               (opening, sorted({enc(name)[0] for name in names}), "tool")]
        closed, free = [], []  # every call of an enumerated tool; names of the others
        for name, tool in self.tools.items():
            values = tool.parameters.get("properties", {}).get(_argument_name(tool), {}).get("enum")
            if values:
                closed += [enc(f"{name} {v}") + [close] for v in values]
            else:
                free.append(enc(name))
        # Every proper prefix past the name's first token (the tool choice above) opens a
        # choice among the tokens that can follow it, unless it is, or runs past, the whole
        # name of a tool whose argument is free text.
        following: dict[tuple[int, ...], set[int]] = {}
        for seq in closed + free:
            for n in range(1, len(seq)):
                following.setdefault(tuple(seq[:n]), set()).add(seq[n])
        for prefix, ids in following.items():
            if not any(prefix[:len(f)] == tuple(f) for f in free):
                out.append((opening + list(prefix), sorted(ids), "argument"))
        return out

    def observation(self, outputs: list[ToolOutput]) -> list[int]:
        return _encode(self.fmt.tokenizer, "".join(f"<obs>{o.content}</obs>" for o in outputs))


class TagsFormat:
    name = "tags"

    def __init__(self, tokenizer: Any, *, thinking: str = "interleaved") -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = []
        for tag in STOP_TAGS:
            ids = _encode(tokenizer, tag)
            if len(ids) != 1:
                raise ValueError(f"tool-call format tags: {tag!r} is {len(ids)} tokens in this "
                                 "tokenizer; the format's tags must be single (special) tokens")
            self.stop_token_ids.append(ids[0])
        self.prefix = _encode(tokenizer, EMPTY_THINK) if thinking == "off" else []
        self.thinking = thinking
        self.call_opening = _encode(tokenizer, "<call>")

    def conversation(self, episode: EpisodeInfo) -> TagsConversation:
        return TagsConversation(self, episode)

    def reply_ids(self, content: str, tool_calls: list[ToolCall]) -> list[int]:
        if len(tool_calls) > 1:
            raise ValueError("the tags format takes one tool call per reply")
        if tool_calls:
            (call,) = tool_calls
            value = next(iter(call.arguments.values()), "")
            return _encode(self.tokenizer, f"<call>{call.name} {value}</call>")
        return _encode(self.tokenizer, f"<answer>{content}</answer>")
