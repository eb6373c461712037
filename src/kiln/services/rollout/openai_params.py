"""The fields of the endpoint's requests, checked before they are acted on: a completion's
sampling fields before the engine sees them, and a reward call's reward and group.

Every field the endpoint knows is checked for its type and range, as vLLM's OpenAI server checks
them, and a bad one gets a 400 naming it (`RequestError`, whose `param` the server returns in
OpenAI's error shape). A value that asks for something the endpoint does not do (penalties,
`top_k`, `top_logprobs`, a JSON `response_format`, stop strings, `n` > 1, a forced tool) is
refused the same way rather than accepted and ignored: a scaffold that relies on it learns at
once. Why not implement them: the reply is trained on as sampled, so everything that shapes the
sampling distribution must be what the trainer's log-probs assume; stop strings would end a
reply inside a token. Fields the API has that do not touch sampling (`user`, `metadata`,
`store`, ...) and fields the endpoint does not know are ignored, as vLLM ignores them.

A client's `seed` is checked (an integer within int64) and passed on only to an engine that can
honour it: vLLM on a CPU kills its engine ("CPU Generator does not use offset") when a seeded
request's prefill is split over steps, which concurrent requests cause, so there it is dropped.
OpenAI documents seeds as best effort; a broken engine is no effort at all.
"""
from __future__ import annotations

import math
from typing import Any

from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.openai_messages import RequestError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: Fields refused unless they carry the value that means "off" (or are absent): value -> why.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0, 0.0), "penalties are not applied (the reply is trained on as "
                                   "sampled from the model's own distribution)"),
    "frequency_penalty": ((0, 0.0), "penalties are not applied (the reply is trained on as "
                                    "sampled from the model's own distribution)"),
    "repetition_penalty": ((1, 1.0), "penalties are not applied"),
    "top_k": ((-1, 0), "only top_p truncates the distribution here"),
    "min_p": ((0, 0.0), "only top_p truncates the distribution here"),
    "logit_bias": (({},), "logit biases are not applied"),
    "top_logprobs": ((0,), "only the sampled token's log-prob is returned (logprobs: true)"),
    "n": ((1,), "send one request per sample (each its own episode)"),
    "best_of": ((1,), "send one request per sample"),
    "stop": (("", ()), "stop sequences are not supported; a reply ends at the model's "
                       "end-of-turn token, so the tokens trained on are the tokens sampled"),
    "parallel_tool_calls": ((True,), "the model decides how many tools it calls"),
    "echo": ((False,), "the prompt is not echoed"),
    "functions": ((), "use tools"),
    "function_call": ((), "use tools"),
}


def _number(body: dict[str, Any], name: str, low: float, high: float, *,
            low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name}: expected a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        lo = "(" if low_open else "["
        raise RequestError(f"{name}: {value!r} is outside {lo}{low:g}, {high:g}]", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: expected an integer, got {value!r}", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name}: {value!r} is outside [{low}, {high}]", param=name)
    return value


def _unsupported(body: dict[str, Any]) -> None:
    for name, (off, why) in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value in off or (isinstance(value, list) and not value and () in off):
            continue
        raise RequestError(f"{name}: {value!r} is not supported: {why}", param=name)
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise RequestError(f"tool_choice: {choice!r} is not supported: only 'auto' (the model "
                           "decides whether to call a tool; its reply is trained on as sampled)",
                           param="tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError(f"response_format: {fmt!r} is not supported: only {{'type': 'text'}} "
                           "(no constrained decoding)", param="response_format")


def check_request(body: dict[str, Any]) -> None:
    """RequestError naming the first field of `body` that is of the wrong type or range, or
    that asks for what the endpoint does not do."""
    for name in ("stream", "logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"{name}: expected true or false, got {body[name]!r}", param=name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user: expected a string, got {body['user']!r}", param="user")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _integer(body, "top_logprobs", 0, 20)
    _integer(body, "n", 1, 128)
    _integer(body, "seed", INT64_MIN, INT64_MAX)
    for name in ("max_tokens", "max_completion_tokens"):
        _integer(body, name, 1, INT64_MAX)
    _unsupported(body)


def sampling_options(body: dict[str, Any], default_max_tokens: int, *,
                     honours_seeds: bool = True) -> tuple[SamplingOptions, bool]:
    """The request's sampling (checked by `check_request`), and whether it named its
    max_tokens (a reply asked to be longer than the context allows is then refused, as vLLM
    refuses it; unnamed, it is cut to fit)."""
    check_request(body)
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return SamplingOptions(temperature=1.0 if temperature is None else float(temperature),
                           top_p=1.0 if top_p is None else float(top_p),
                           max_tokens=asked or default_max_tokens,
                           seed=body.get("seed") if honours_seeds else None), asked is not None


def check_reward(reward: Any, parts: Any, group_size: Any, group_id: str, *,
                 reward_range: list[float], stage: int | None) -> tuple[float, dict[str, float], int]:
    """The reward call's (reward, reward parts, group size), or RequestError naming the field.
    `stage`: the group size of the stage being trained (a reward must use it); None: any."""
    low, high = reward_range
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise RequestError("reward: expected a number")
    if not (math.isfinite(reward) and low <= reward <= high):
        raise RequestError(f"reward: {reward!r} is outside this job's reward range [{low:g}, "
                           f"{high:g}] (rollout.openai.rewardRange)")
    parts = parts or {}
    if not isinstance(parts, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in parts.values()):
        raise RequestError("reward_parts: expected an object of finite numbers")
    size = (stage or 1) if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise RequestError("group_size: expected a positive integer")
    if stage is not None and size != stage:
        raise RequestError(f"group_size: {size} is not the group size of the stage being "
                           f"trained ({stage}); send whole groups of {stage}")
    if size > 1 and not group_id:
        raise RequestError(f"group_id: a group of {size} needs an id its members share")
    return float(reward), {str(k): float(v) for k, v in parts.items()}, size
