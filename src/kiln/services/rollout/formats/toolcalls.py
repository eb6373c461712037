"""Reading tool calls out of a model's reply text, per model family, and writing them back (for
demonstrations), plus the check of a call's arguments against its tool's JSON schema.

- `hermes` (Qwen, Hermes, most ChatML models): each call is `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`; text around the calls is the reply's content.
- `llama3` (Llama 3.1+ JSON tool calling): the whole reply is one JSON object `{"name": ...,
  "parameters": {...}}`, optionally after `<|python_tag|>`.
- `glm45` (GLM-4.5, 4.6, 4.7): each call is `<tool_call>NAME` then, per argument,
  `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`, then `</tool_call>`; a value is written
  as it is when it is a string and as JSON otherwise, so it is read back by the tool's schema (a
  parameter typed `string` as written, any other as JSON).

A reply without calls is a final answer; a reply that looks like a call but does not parse, or
names an unknown tool, or whose arguments do not fit the tool's schema, is unparseable (the
environment decides what that costs).

Not covered: Mistral's `[TOOL_CALLS]` and other families' formats; parallel calls in llama3.
"""
from __future__ import annotations

import json
import re
from typing import Any

from kiln.env import ToolCall, ToolSpec
from kiln.episode import Action

FORMATS = ("hermes", "llama3", "glm45")
_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def schema_problem(value: Any, schema: dict[str, Any], path: str = "arguments") -> str | None:
    """Why `value` does not fit the JSON schema `schema` (types, required, enum, pattern,
    length), or None. Covers the subset tool schemas use."""
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool,
             "integer": int, "number": (int, float)}
    if kind in types:
        ok = isinstance(value, types[kind]) and not (kind in ("integer", "number")
                                                      and isinstance(value, bool))
        if not ok:
            return f"{path} must be a {kind}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}"
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return f"{path} does not match {schema['pattern']!r}"
        if len(value) > schema.get("maxLength", len(value)):
            return f"{path} is longer than {schema['maxLength']} characters"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                return f"{path} lacks {key!r}"
        props = schema.get("properties", {})
        for key, item in value.items():
            if key in props:
                problem = schema_problem(item, props[key], f"{path}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{path} has an unknown key {key!r}"
    return None


def checked(calls: list[ToolCall], tools: list[ToolSpec]) -> str | None:
    """Why these calls cannot be run with `tools`, or None."""
    by_name = {t.name: t for t in tools}
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r} (tools: {', '.join(by_name)})"
        problem = schema_problem(call.arguments, tool.parameters)
        if problem:
            return f"{call.name}: {problem}"
    return None


def _as_call(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call must be a JSON object with a string `name`")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models quote the arguments object
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"the `{args_key}` of a tool call must be a JSON object")
    return ToolCall(obj["name"], args)


def _glm_call(block: str, tools: list[ToolSpec]) -> ToolCall:
    """One GLM-4.5 call's inside (`NAME<arg_key>...`), its values read by the tool's schema."""
    name = block.split("<arg_key>", 1)[0].strip()
    if not name or "<" in name:
        raise ValueError("a GLM tool call must start with the tool's name")
    rest = block[len(block.split("<arg_key>", 1)[0]):]
    if _GLM_ARG_RE.sub("", rest).strip():
        raise ValueError(f"{name}: arguments must be <arg_key>K</arg_key><arg_value>V</arg_value> pairs")
    props = next((t.parameters.get("properties", {}) for t in tools if t.name == name), {})
    args: dict[str, Any] = {}
    for key, value in _GLM_ARG_RE.findall(rest):
        key = key.strip()
        if props.get(key, {}).get("type") == "string":
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value  # the schema check says what was expected
    return ToolCall(name, args)


def parse(text: str, fmt: str, tools: list[ToolSpec]) -> Action:
    """The action a reply's text asks for, in tool-call format `fmt`."""
    try:
        if fmt in ("hermes", "glm45"):
            blocks = _HERMES_RE.findall(text)
            if not blocks:
                if "<tool_call>" in text:
                    return Action(content=text, unparseable=True,
                                  problem="a <tool_call> block is not closed")
                return Action(content=text.strip())
            calls = ([_as_call(json.loads(b), "arguments") for b in blocks] if fmt == "hermes"
                     else [_glm_call(b, tools) for b in blocks])
            content = _HERMES_RE.sub("", text).strip()
        elif fmt == "llama3":
            body = text.strip().removeprefix("<|python_tag|>").strip()
            if not body.startswith("{"):
                return Action(content=text.strip())
            calls, content = [_as_call(json.loads(body), "parameters")], ""
        else:
            raise ValueError(f"tool-call format {fmt!r} is not one of {FORMATS}")
    except json.JSONDecodeError as exc:
        return Action(content=text, unparseable=True, problem=f"tool call is not JSON: {exc.msg}")
    except ValueError as exc:
        return Action(content=text, unparseable=True, problem=str(exc))
    problem = checked(calls, tools)
    if problem:
        return Action(calls, content, unparseable=True, problem=problem)
    return Action(calls, content)


def render(calls: list[ToolCall], content: str, fmt: str) -> str:
    """A reply's text with these calls, as the model is to write it (demonstrations)."""
    if fmt == "hermes":
        blocks = "".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n"
                         "</tool_call>" for c in calls)
        return (content + "\n" + blocks if content and blocks else content + blocks)
    if fmt == "glm45":
        blocks = "".join(
            f"<tool_call>{c.name}\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>"
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n"
                for k, v in c.arguments.items()) + "</tool_call>" for c in calls)
        return (content + "\n" + blocks if content and blocks else content + blocks)
    if fmt == "llama3":
        if len(calls) > 1:
            raise ValueError("llama3 tool calls are one per reply")
        if calls:
            return json.dumps({"name": calls[0].name, "parameters": calls[0].arguments})
        return content
    raise ValueError(f"tool-call format {fmt!r} is not one of {FORMATS}")
