"""The chain environment's text protocol: its special tokens, the grammar of one action, and how a
tool action becomes a calculator call."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tasks import ChainTask

#: Special tokens of the protocol; a tokenizer must keep each one a single token.
SPECIAL_TOKENS = (
    "<pad>", "<task>", "</task>", "<think>", "</think>",
    "<call>", "</call>", "<obs>", "</obs>", "<answer>", "</answer>",
)
#: Generation of one action stops after either of these.
STOP_TAGS = ("</call>", "</answer>")
#: Episodes end (reward 0) after this many actions without an answer.
MAX_ACTIONS = 8

#: Longest expression the calculator accepts (keeps results small and evaluation instant).
MAX_EXPR_CHARS = 64


@dataclass(frozen=True)
class Call:
    expr: str


@dataclass(frozen=True)
class Step:
    """`step V`: apply the task's step to V."""

    value: str


@dataclass(frozen=True)
class Answer:
    value: str


@dataclass(frozen=True)
class Invalid:
    reason: str


_THINK = r"(?:<think>[^<]*</think>)?"
_CALL_RE = re.compile(_THINK + r"<call>calc ([0-9+\-*/%% ()]{1,%d})</call>" % MAX_EXPR_CHARS)
_STEP_RE = re.compile(_THINK + r"<call>step (-?[0-9]{1,12})</call>")
_ANSWER_RE = re.compile(_THINK + r"<answer>([^<]{0,32})</answer>")


def parse_action(text: str) -> Call | Step | Answer | Invalid:
    """One generated action (up to and including its stop tag) -> what the agent asked for."""
    text = text.strip()
    if m := _STEP_RE.fullmatch(text):
        return Step(m.group(1))
    if m := _CALL_RE.fullmatch(text):
        return Call(m.group(1).strip())
    if m := _ANSWER_RE.fullmatch(text):
        return Answer(m.group(1).strip())
    return Invalid(f"not one <call>step N</call>, <call>calc EXPR</call> or <answer>N</answer>: "
                   f"{text[:80]!r}")


def tool_call(task: "ChainTask", action: Call | Step) -> Call:
    """The calculator call a tool action amounts to in `task`: `step V` is `calc V` + the
    task's step."""
    return Call(f"{action.value}{task.step}") if isinstance(action, Step) else action
