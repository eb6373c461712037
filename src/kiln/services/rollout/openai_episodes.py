"""Episodes played by an outside agent through the OpenAI chat-completions API, stitched into
trajectories.

An agent scaffold (any OpenAI-SDK or LiteLLM client) sends the whole conversation with every
call, as the API has it. Kiln keeps, per episode, the token sequence the
model has actually seen: the first call's messages rendered with the chat template, then for
each call the engine's sampled reply tokens as they were sampled, and the tokens of whatever
messages the caller added after that reply (tool results, a user's next message), rendered as
the difference between two renderings of the template (`formats.chat`). Nothing the model
sampled is ever re-tokenized, so the stitched trajectory's trained tokens are exactly the
sampled ones, with the engine's log-probs and policy versions.

A call whose history is not the previous call's history plus the reply Kiln gave plus new
non-assistant messages (the scaffold truncated or rewrote the context, or wrote an assistant
turn itself) starts a new *segment*: a fresh rendering of its messages, trained on from there.
Each segment becomes its own trajectory; the episode's reward goes to all of them, and they
share the episode's group.

Episodes belong to callers. `open` issues an episode id (random, unguessable) to the caller
(the API key's id, `openai_auth.py`) and refuses one past `maxOpenEpisodes` per caller; every
later call on the episode must come from the same caller, and to any other it does not exist
(`UnknownEpisode`). A caller's groups are its own too: the group id is prefixed with the
caller id, so no caller can add members to another's group.

`finish` (the reward call) checks the reward (finite, within `rewardRange`), its parts and the
group size (the stage's, where the run has stages) before it touches the episode: a refused
reward leaves the episode open, to be rewarded again. It then turns the episode into
trajectories and hands them to the sink (the buffer in a run, a JSONL file for `kiln serve`);
if the sink fails, the episode stays open too. An episode without a call for `idleSeconds` is
closed (`drop_idle`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from kiln.api.openai_endpoint import OpenAIEndpointSpec
from kiln.env import ToolSpec
from kiln.episode import EpisodeInfo
from kiln.routing import RoutedExperts, merge_routing
from kiln.services.rollout.engine import Engine, SamplingOptions
from kiln.services.rollout.formats.chat import ChatConversation, ChatFormat
from kiln.trajectory import Trajectory, spans_from_versions

Sink = Callable[[list[Trajectory], int], Awaitable[None]]
"""Takes an episode's trajectories and the size of the group they belong to."""


class RequestError(ValueError):
    """The request is wrong (HTTP 400); the message names the field. Retrying it unchanged
    will not help."""


class UnknownEpisode(KeyError):
    """No such episode of this caller (HTTP 404): never opened, another caller's, finished, or
    closed after being idle."""


class TooManyEpisodes(RuntimeError):
    """The caller holds `maxOpenEpisodes` open episodes (HTTP 429): reward or delete one first."""


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


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as the chat template takes it."""
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if m["calls"]:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in m["calls"]]
    if m["role"] == "tool":
        out["tool_call_id"], out["name"] = m["tool_call_id"], m["name"]
    return out


@dataclass
class Reply:
    """One call's answer: the assistant message to return and what the engine sampled."""

    message: dict[str, Any]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int


@dataclass
class _Segment:
    conv: ChatConversation
    seen: list[dict[str, Any]]
    """The normalized history the model has seen, including its last reply."""
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    routed: RoutedExperts | None = None
    """MoE: the experts chosen for this segment's positions, merged over its generations."""

    def context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


@dataclass
class _Episode:
    episode_id: str
    caller: str
    tools: list[ToolSpec] = field(default_factory=list)
    segments: list[_Segment] = field(default_factory=list)
    calls: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ExternalEpisodes:
    """Per-episode state of the OpenAI endpoint; see the module doc."""

    def __init__(self, engine: Engine, fmt: ChatFormat, sink: Sink, *,
                 max_tokens_per_turn: int, max_total_tokens: int,
                 settings: OpenAIEndpointSpec | None = None,
                 stage_group_size: Callable[[], int] | None = None) -> None:
        """`stage_group_size`: the group size of the stage being trained (a reward call must
        use it); None: any (`kiln serve`, which trains nothing)."""
        if not isinstance(fmt, ChatFormat):
            raise ValueError("the OpenAI endpoint needs a chat-template format (hermes or llama3); "
                             "the tags format has no chat messages")
        self.engine, self.fmt, self.sink = engine, fmt, sink
        self.max_tokens_per_turn, self.max_total_tokens = max_tokens_per_turn, max_total_tokens
        self.settings = settings or OpenAIEndpointSpec()
        self.idle_seconds = self.settings.idle_seconds
        self.stage_group_size = stage_group_size
        self._episodes: dict[str, _Episode] = {}
        self._open: dict[str, int] = {}
        """Caller -> its open episodes."""
        self.dropped_idle = 0
        # Rendering a long history (parse, compare, chat template) one at a time, off the
        # event loop: a tokenizer is not safe to share between threads.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="openai-render")

    def __len__(self) -> int:
        return len(self._episodes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the rendering thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def open(self, caller: str) -> str:
        """A new episode of `caller`: its id."""
        if self._open.get(caller, 0) >= self.settings.max_open_episodes:
            raise TooManyEpisodes(f"this API key holds {self.settings.max_open_episodes} open "
                                  "episodes (rollout.openai.maxOpenEpisodes); reward or delete "
                                  "one first")
        episode_id = "ep-" + secrets.token_hex(16)
        self._episodes[episode_id] = _Episode(episode_id, caller)
        self._open[caller] = self._open.get(caller, 0) + 1
        return episode_id

    def _get(self, caller: str, episode_id: str) -> _Episode:
        ep = self._episodes.get(episode_id)
        if ep is None or ep.caller != caller:
            raise UnknownEpisode(episode_id)
        return ep

    def _close(self, ep: _Episode) -> None:
        if self._episodes.pop(ep.episode_id, None) is not None:
            self._open[ep.caller] -= 1
            if not self._open[ep.caller]:
                del self._open[ep.caller]

    async def complete(self, caller: str, episode_id: str, messages: Any, tools: Any, *,
                       sampling: SamplingOptions, offload: bool = False) -> Reply:
        """Sample the next assistant reply of `episode_id` (opened by `open`). `offload`: render
        the history on the rendering thread (a long one)."""
        if not episode_id:
            raise RequestError("name the episode: open one with POST /v1/kiln/episodes and send "
                               "its id in an X-Kiln-Episode header or the `user` field")
        ep = self._get(caller, episode_id)
        async with ep.lock:
            if self._episodes.get(episode_id) is not ep:
                raise UnknownEpisode(episode_id)  # finished while this call waited
            ep.last_used = time.monotonic()
            prepare = self._prepare
            seg, history = (await self.offload(prepare, ep, messages, tools) if offload
                            else prepare(ep, messages, tools))
            budget = min(sampling.max_tokens, self.max_tokens_per_turn,
                         self.max_total_tokens - len(seg.tokens))
            if budget <= 0:
                raise RequestError(f"episode {episode_id!r} has used its {self.max_total_tokens} "
                                   "tokens (rollout.sampling.maxTotalTokens); send its reward")
            prompt_tokens = len(seg.tokens)
            gen = await self.engine.generate(seg.tokens, dataclasses.replace(
                sampling, max_tokens=budget, stop_token_ids=tuple(self.fmt.stop_token_ids)))
            seg.tokens += gen.token_ids
            seg.mask += [1] * len(gen.token_ids)
            seg.logp += gen.logprobs
            seg.versions += gen.versions
            seg.routed = merge_routing(seg.routed, gen.routed_experts)
            action = seg.conv.read_reply(gen.token_ids)
            ep.calls += 1
            calls = [{"id": f"call_{ep.calls}_{i}", "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments_json()}}
                     for i, c in enumerate(action.tool_calls)] if not action.unparseable else []
            message: dict[str, Any] = {"role": "assistant",
                                       "content": action.content if action.content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            seg.seen = history + normalized([message])
            finish = "tool_calls" if calls else gen.finish_reason
            return Reply(message, list(gen.token_ids), list(gen.logprobs), list(gen.versions),
                         finish, prompt_tokens)

    def _prepare(self, ep: _Episode, messages: Any,
                 tools: Any) -> tuple[_Segment, list[dict[str, Any]]]:
        """The segment this call extends (`_continue`) and the call's normalized history."""
        history = normalized(messages)
        return self._continue(ep, history, tools_from_openai(tools)), history

    def _continue(self, ep: _Episode, history: list[dict[str, Any]],
                  tools: list[ToolSpec]) -> _Segment:
        """The segment this call extends, with the new messages' tokens appended; or a new one."""
        seg = ep.segments[-1] if ep.segments else None
        if (seg is not None and tools == ep.tools and history[:len(seg.seen)] == seg.seen
                and len(history) > len(seg.seen)
                and all(m["role"] != "assistant" for m in history[len(seg.seen):])):
            seg.context(seg.conv.append([_template_message(m) for m in history[len(seg.seen):]]))
            return seg
        ep.tools = tools
        # A history with earlier turns in it is rendered as the template writes it; those turns
        # are context (mask 0), whoever wrote them.
        info = EpisodeInfo(ep.episode_id, "", "openai", [], tools)
        conv = self.fmt.conversation(info, [_template_message(m) for m in history])
        seg = _Segment(conv, history)
        seg.context(conv.prompt())
        seg.prompt_len = len(seg.tokens)
        ep.segments.append(seg)
        return seg

    def check_reward(self, reward: Any, parts: Any, group_size: Any,
                     group_id: str) -> tuple[float, dict[str, float], int]:
        """The reward call's (reward, reward parts, group size), or RequestError naming the field."""
        low, high = self.settings.reward_range
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
        stage = self.stage_group_size() if self.stage_group_size is not None else None
        size = (stage or 1) if group_size is None else group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise RequestError("group_size: expected a positive integer")
        if stage is not None and size != stage:
            raise RequestError(f"group_size: {size} is not the group size of the stage being "
                               f"trained ({stage}); send whole groups of {stage}")
        if size > 1 and not group_id:
            raise RequestError(f"group_id: a group of {size} needs an id its members share")
        return float(reward), {str(k): float(v) for k, v in parts.items()}, size

    async def finish(self, caller: str, episode_id: str, reward: float, *, task_id: str = "",
                     group_id: str = "", group_size: int = 1,
                     reward_parts: dict[str, float] | None = None) -> list[Trajectory]:
        """End the episode with its reward (checked by `check_reward`): its trajectories, also
        handed to the sink. If the sink fails the episode stays open."""
        ep = self._get(caller, episode_id)
        async with ep.lock:
            if self._episodes.get(episode_id) is not ep:
                raise UnknownEpisode(episode_id)
            # The caller's own group namespace: no caller can complete another's group.
            group = f"{caller}/{group_id}" if group_id else uuid.uuid4().hex
            trajs = [Trajectory(
                id=uuid.uuid4().hex, task_id=task_id or episode_id, group_id=group, env="openai",
                tokens=s.tokens, loss_mask=s.mask, logp_infer=s.logp,
                version_spans=spans_from_versions(s.versions), prompt_len=s.prompt_len,
                reward=float(reward), reward_parts=dict(reward_parts or {}),
                flags=["external"] + ([f"segment:{i}"] if len(ep.segments) > 1 else []),
                engine_fingerprint=self.engine.fingerprint, routed_experts=s.routed,
                created_at=time.time())
                for i, s in enumerate(ep.segments) if any(s.mask)]
            if trajs:
                await self.sink(trajs, group_size)
            self._close(ep)
        return trajs

    def abandon(self, caller: str, episode_id: str) -> None:
        self._close(self._get(caller, episode_id))

    def drop_idle(self) -> int:
        """Close episodes idle for longer than `idle_seconds`; how many were closed."""
        now = time.monotonic()
        stale = [e for e in self._episodes.values()
                 if now - e.last_used > self.idle_seconds and not e.lock.locked()]
        for e in stale:
            self._close(e)
        self.dropped_idle += len(stale)
        return len(stale)
