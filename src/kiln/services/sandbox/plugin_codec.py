"""What the sandbox service and a plugin worker say to each other, as JSON-ready data.

A plugin worker (`plugin_host.py`) runs a job's environment or reward plugin in a confined
process; the service (`plugins.py`) talks to it over a pipe, one JSON object per line. This
module turns the environment interface's values (tool specs and calls, tool results, grades,
scripted turns, transcripts, exec results) into plain data and back. Only data crosses: never
pickles, so nothing the worker sends can run code in the service. Decoding is strict in the
service's direction: the worker runs code the service does not trust, so a value of the wrong
shape is refused with PluginFailure, never coerced into something that could reach training.

Not covered: the transport and the calls (`plugins.py`, `plugin_host.py`).
"""
from __future__ import annotations

import base64
import math
from dataclasses import asdict
from typing import Any

from kiln.env import AssistantTurn, Grade, ToolCall, ToolResult, ToolSpec
from kiln.episode import ToolOutput, Turn

#: Longest line either side accepts: a file of the sandbox service's largest request (16 MiB)
#: in base64, with room for the envelope.
MAX_LINE_BYTES = 24 << 20


class PluginFailure(RuntimeError):
    """The plugin raised, answered with something malformed, or its worker died. Not
    retryable as is: the plugin (or the job's reference to it) must be fixed."""


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise PluginFailure(f"{what}: expected a string from the plugin, got {type(value).__name__}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PluginFailure(f"{what}: expected a finite number from the plugin, got {value!r:.80}")
    return float(value)


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise PluginFailure(f"{what}: expected a list from the plugin, got {type(value).__name__}")
    return value


def _dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise PluginFailure(f"{what}: expected an object from the plugin, got {type(value).__name__}")
    return value


# -- environment values -----------------------------------------------------------------------
def tool_spec_out(spec: ToolSpec) -> dict:
    return {"name": spec.name, "description": spec.description, "parameters": spec.parameters}


def tool_spec_in(data: Any) -> ToolSpec:
    data = _dict(data, "tool")
    return ToolSpec(_str(data.get("name"), "tool.name"),
                    _str(data.get("description", ""), "tool.description"),
                    _dict(data.get("parameters", {"type": "object", "properties": {}}),
                          "tool.parameters"))


def tool_call_out(call: ToolCall) -> dict:
    return {"name": call.name, "arguments": call.arguments, "id": call.id}


def tool_call_in(data: Any) -> ToolCall:
    data = _dict(data, "tool call")
    return ToolCall(_str(data.get("name"), "call.name"), _dict(data.get("arguments", {}), "call.arguments"),
                    _str(data.get("id", ""), "call.id"))


def tool_result_out(result: ToolResult) -> dict:
    return {"output": result.output, "done": result.done, "answer": result.answer}


def tool_result_in(data: Any) -> ToolResult:
    data = _dict(data, "tool result")
    answer = data.get("answer")
    return ToolResult(_str(data.get("output"), "result.output"), bool(data.get("done", False)),
                      None if answer is None else _str(answer, "result.answer"))


def grade_out(grade: Grade) -> dict:
    return {"reward": grade.reward, "parts": grade.parts, "output": grade.output,
            "flags": grade.flags}


def grade_in(data: Any) -> Grade:
    data = _dict(data, "grade")
    parts = {_str(k, "grade.parts key"): _float(v, f"grade.parts[{k}]")
             for k, v in _dict(data.get("parts", {}), "grade.parts").items()}
    return Grade(_float(data.get("reward"), "grade.reward"), parts,
                 _str(data.get("output", ""), "grade.output"),
                 [_str(f, "grade.flags") for f in _list(data.get("flags", []), "grade.flags")])


def turn_out(turn: Turn) -> dict:
    return {"content": turn.content, "tool_calls": [tool_call_out(c) for c in turn.tool_calls],
            "outputs": [asdict(o) for o in turn.outputs]}


def turn_in(data: dict) -> Turn:
    return Turn(data["content"], [tool_call_in(c) for c in data["tool_calls"]],
                [ToolOutput(**o) for o in data["outputs"]])


def assistant_turn_out(turn: AssistantTurn) -> dict:
    return {"content": turn.content, "tool_calls": [tool_call_out(c) for c in turn.tool_calls],
            "outputs": turn.outputs}


def assistant_turn_in(data: Any) -> AssistantTurn:
    data = _dict(data, "scripted turn")
    outputs = data.get("outputs")
    return AssistantTurn(_str(data.get("content", ""), "turn.content"),
                         [tool_call_in(c) for c in _list(data.get("tool_calls", []), "turn.tool_calls")],
                         None if outputs is None else
                         [_str(o, "turn.outputs") for o in _list(outputs, "turn.outputs")])


# -- sandbox values ----------------------------------------------------------------------------
def blob_out(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def blob_in(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def exec_result_out(result: Any) -> dict:
    return asdict(result)
