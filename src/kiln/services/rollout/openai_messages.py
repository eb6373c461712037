"""The messages of a chat-completions request in the one shape the OpenAI endpoint compares and
renders, and the errors a request can be refused with.

`normalized` turns a request's messages into comparable records (role, text, tool calls by name
and parsed arguments, call id), so that a conversation sent back can be matched against the one
the model saw whatever the client changed in its formatting; `digests` names each prefix of
such a conversation that ends with a reply, which is how a request that names no episode finds
the one it continues (`openai_episodes.py`).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kiln.env import ToolSpec


class RequestError(ValueError):
    """The request is wrong (HTTP 400); the message names the field. Retrying it unchanged
    will not help. `param`: the field (the message's text before its first colon when not
    given); `code`: OpenAI's error code, where it has one."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        head = message.split(":", 1)[0]
        self.param = param if param is not None else (head if ":" in message and " " not in head
                                                      else None)
        self.code = code


class ContextOverflow(RequestError):
    """The conversation and the reply asked for do not fit the context (HTTP 400), worded as
    vLLM's server words it, which clients (litellm) recognise as a context-window error."""

    def __init__(self, limit: int, prompt: int, completion: int) -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="messages", code="context_length_exceeded")


def tools_from_openai(tools: Any) -> list[ToolSpec]:
    """The request's `tools` as ToolSpecs."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools: expected a list of {type: function, function: {...}}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}]: expected {{type: function, function: {{name, "
                               "description, parameters}}}")
        out.append(ToolSpec(fn["name"], fn.get("description") or "",
                            fn.get("parameters") or {"type": "object", "properties": {}}))
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones carry meaning here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{where}.content: only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}.content: expected a string or a list of text parts")


def _calls(message: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    """(name, arguments) of an assistant message's tool calls, comparable across requests."""
    out = []
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.tool_calls[{j}]: expected {{function: {{name, arguments}}}}")
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # compared as the string it is
        out.append((fn.get("name"), args))
    return out


def normalized(messages: Any) -> list[dict[str, Any]]:
    """The request's messages in one comparable shape (role, content text, calls, call id)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant", "tool"):
            raise RequestError(f"{where}.role: expected system, user, assistant or tool")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(m.get("content"), where),
                    "calls": _calls(m, where) if role == "assistant" else [],
                    "tool_call_id": m.get("tool_call_id") or "", "name": m.get("name") or ""})
    return out


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as the chat template takes it."""
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if m["calls"]:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in m["calls"]]
    if m["role"] == "tool":
        out["tool_call_id"], out["name"] = m["tool_call_id"], m["name"]
    return out


def digests(history: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(n, digest of history[:n]) for each n where history[n - 1] is a reply, of a normalized
    history."""
    h, out = hashlib.sha256(), []
    for i, m in enumerate(history):
        h.update(json.dumps(m, sort_keys=True, default=str).encode() + b"\0")
        if m["role"] == "assistant":
            out.append((i + 1, h.hexdigest()))
    return out
