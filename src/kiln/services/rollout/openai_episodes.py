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

A caller that names no episode (a stock client) gets one issued (`Reply.episode_id`), indexed
by a digest of its conversation up to the last reply; a later call of the same caller whose
messages start with that conversation continues it. Past `maxOpenEpisodes` an issued episode
replaces the caller's least recently used issued one (such clients never send rewards).

A call changes its episode only once its generation has succeeded: the segment's tokens, its
conversation and any new segment are rolled back on any failure (the engine's, a context
overflow, a cancelled request), so a retry continues the episode as if the failed call had not
happened.

`finish` (the reward call) checks the reward (finite, within `rewardRange`), its parts and the
group size (the stage's, where the run has stages) before it touches the episode: a refused
reward leaves the episode open, to be rewarded again. It then turns the episode into
trajectories and hands them to the sink (the buffer in a run, a JSONL file for `kiln serve`);
if the sink fails, the episode stays open too. An episode without a call for `idleSeconds` is
closed (`drop_idle`).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
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
from kiln.services.rollout.openai_messages import (ContextOverflow, digests,
                                                   normalized, template_message,
                                                   tools_from_openai)
from kiln.trajectory import Trajectory, spans_from_versions

log = logging.getLogger("kiln.rollout.openai")

Sink = Callable[[list[Trajectory], int], Awaitable[None]]
"""Takes an episode's trajectories and the size of the group they belong to."""


class UnknownEpisode(KeyError):
    """No such episode of this caller (HTTP 404): never opened, another caller's, finished, or
    closed after being idle."""


class TooManyEpisodes(RuntimeError):
    """The caller holds `maxOpenEpisodes` open episodes (HTTP 429): reward or delete one first."""


@dataclass
class Reply:
    """One call's answer: the assistant message to return and what the engine sampled."""

    message: dict[str, Any]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int
    episode_id: str = ""


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
    issued: bool = False
    """Issued by the server to a call that named no episode: found again by its conversation."""
    key: str = ""
    """Issued episodes: the digest of the conversation its next call is expected to extend."""


class ExternalEpisodes:
    """Per-episode state of the OpenAI endpoint; see the module doc."""

    def __init__(self, engine: Engine, fmt: ChatFormat, sink: Sink, *,
                 max_tokens_per_turn: int, max_total_tokens: int,
                 settings: OpenAIEndpointSpec | None = None,
                 stage_group_size: Callable[[], int] | None = None) -> None:
        """`stage_group_size`: the group size of the stage being trained (a reward call must
        use it); None: any (`kiln serve`, which trains nothing)."""
        if not isinstance(fmt, ChatFormat):
            raise ValueError("the OpenAI endpoint needs a chat-template format (hermes, llama3 or glm45); "
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
        self.evicted = 0
        self.id_suffix = ""
        """Ends every episode id: `.<instance>` behind the fleet's router (`router.py`)."""
        self._by_conversation: dict[tuple[str, str], str] = {}
        """(caller, digest of a conversation up to its last reply) -> the issued episode."""
        # What `stalled_for` measures: generations in flight, and when one last started after
        # none was, or ended.
        self.in_flight = 0
        self._progress = time.monotonic()
        special = getattr(fmt.tokenizer, "all_special_tokens", None) or []
        self._special = sorted((t for t in special if t), key=len, reverse=True)
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
        episode_id = "ep-" + secrets.token_hex(16) + self.id_suffix
        self._episodes[episode_id] = _Episode(episode_id, caller)
        self._open[caller] = self._open.get(caller, 0) + 1
        return episode_id

    def _get(self, caller: str, episode_id: str) -> _Episode:
        ep = self._episodes.get(episode_id)
        if ep is None or ep.caller != caller:
            raise UnknownEpisode(episode_id)
        return ep

    def stalled_for(self) -> float:
        """Seconds since a generation last ended while some are in flight (0 with none in
        flight): an engine that takes requests and never answers them (wedged) stalls."""
        return time.monotonic() - self._progress if self.in_flight else 0.0

    def _close(self, ep: _Episode) -> None:
        if ep.key and self._by_conversation.get((ep.caller, ep.key)) == ep.episode_id:
            del self._by_conversation[(ep.caller, ep.key)]
        if self._episodes.pop(ep.episode_id, None) is not None:
            self._open[ep.caller] -= 1
            if not self._open[ep.caller]:
                del self._open[ep.caller]

    async def complete(self, caller: str, episode_id: str | None, messages: Any, tools: Any, *,
                       sampling: SamplingOptions, offload: bool = False,
                       exact_max_tokens: bool = False) -> Reply:
        """Sample the next assistant reply of `episode_id` (opened by `open`); with none, of the
        episode issued earlier whose conversation this one extends, else of a new one issued
        now (`Reply.episode_id`). `offload`: render the history on the rendering thread (a
        long one). `exact_max_tokens`: the caller named `sampling.max_tokens`, so a reply that
        cannot have that many tokens is refused (ContextOverflow) rather than cut.

        A call joins its episode only if its generation succeeds: on any failure the episode is
        left as it was, so the caller's retry (SDKs retry on their own) continues it."""
        if episode_id:
            ep = self._get(caller, episode_id)
        else:
            found = (await self.offload(self._find, caller, messages) if offload
                     else self._find(caller, messages))
            ep = found or self._issue(caller)
        episode_id = ep.episode_id
        async with ep.lock:
            if self._episodes.get(episode_id) is not ep:
                raise UnknownEpisode(episode_id)  # finished while this call waited
            ep.last_used = time.monotonic()
            undo = self._savepoint(ep)
            try:
                return await self._complete(ep, messages, tools, sampling, offload, exact_max_tokens)
            except BaseException:
                self._rollback(ep, undo)
                if ep.issued and not ep.segments:
                    self._close(ep)  # issued for this call alone: nothing of it to keep
                raise

    async def _complete(self, ep: _Episode, messages: Any, tools: Any, sampling: SamplingOptions,
                        offload: bool, exact_max_tokens: bool) -> Reply:
        prepare = self._prepare
        seg, history = (await self.offload(prepare, ep, messages, tools) if offload
                        else prepare(ep, messages, tools))
        prompt_tokens = len(seg.tokens)
        room = self.max_total_tokens - prompt_tokens
        if room <= 0 or (exact_max_tokens and sampling.max_tokens > room):
            raise ContextOverflow(self.max_total_tokens, prompt_tokens,
                                  sampling.max_tokens if exact_max_tokens else 1)
        budget = min(sampling.max_tokens, self.max_tokens_per_turn, room)
        if not self.in_flight:
            self._progress = time.monotonic()
        self.in_flight += 1
        try:
            gen = await self.engine.generate(seg.tokens, dataclasses.replace(
                sampling, max_tokens=budget, stop_token_ids=tuple(self.fmt.stop_token_ids)))
        finally:
            self.in_flight -= 1
            self._progress = time.monotonic()
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
        content = self._strip_special(action.content)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        seg.seen = history + normalized([message])
        if ep.issued:
            self._index(ep, seg.seen)
        finish = "tool_calls" if calls else gen.finish_reason
        return Reply(message, list(gen.token_ids), list(gen.logprobs), list(gen.versions),
                     finish, prompt_tokens, ep.episode_id)

    def _strip_special(self, text: str) -> str:
        """`text` without the tokenizer's special tokens (an end-of-turn token the model wrote
        mid-reply, a pad): they are markup, not content. The trained tokens keep them."""
        for t in self._special:
            text = text.replace(t, "")
        return text

    @staticmethod
    def _savepoint(ep: _Episode) -> tuple:
        """What `_rollback` needs to put `ep` back as it is now: a call only ever appends to
        its last segment (tokens, conversation) or adds segments."""
        seg = ep.segments[-1] if ep.segments else None
        if seg is None:
            return len(ep.segments), ep.tools, None
        conv = copy.copy(seg.conv)
        conv.messages = list(seg.conv.messages)
        return len(ep.segments), ep.tools, (seg, len(seg.tokens), conv, seg.seen, seg.routed)

    @staticmethod
    def _rollback(ep: _Episode, undo: tuple) -> None:
        n, ep.tools, last = undo
        del ep.segments[n:]
        if last is not None:
            seg, length, conv, seen, routed = last
            for name in ("tokens", "mask", "logp", "versions"):
                del getattr(seg, name)[length:]
            seg.conv, seg.seen, seg.routed = conv, seen, routed

    def _index(self, ep: _Episode, seen: list[dict[str, Any]]) -> None:
        if ep.key and self._by_conversation.get((ep.caller, ep.key)) == ep.episode_id:
            del self._by_conversation[(ep.caller, ep.key)]
        ep.key = digests(seen)[-1][1]
        self._by_conversation[(ep.caller, ep.key)] = ep.episode_id

    def _find(self, caller: str, messages: Any) -> _Episode | None:
        """The issued episode of `caller` whose conversation `messages` extends (the longest
        such), if any."""
        history = normalized(messages)
        for _, digest in reversed(digests(history)):
            ep = self._episodes.get(self._by_conversation.get((caller, digest), ""))
            if ep is not None and ep.caller == caller:
                return ep
        return None

    def _issue(self, caller: str) -> _Episode:
        """A new episode for a call that named none. Past `maxOpenEpisodes` the caller's least
        recently used issued episode is closed for it (a stock client never rewards, so its
        episodes would otherwise only free their slots after `idleSeconds`)."""
        if self._open.get(caller, 0) >= self.settings.max_open_episodes:
            idle = [e for e in self._episodes.values()
                    if e.caller == caller and e.issued and not e.lock.locked()]
            if idle:
                self._close(min(idle, key=lambda e: e.last_used))
                self.evicted += 1
        ep = self._episodes[self.open(caller)]
        ep.issued = True
        return ep

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
            seg.context(seg.conv.append([template_message(m) for m in history[len(seg.seen):]]))
            return seg
        ep.tools = tools
        # A history with earlier turns in it is rendered as the template writes it; those turns
        # are context (mask 0), whoever wrote them.
        info = EpisodeInfo(ep.episode_id, "", "openai", [], tools)
        conv = self.fmt.conversation(info, [template_message(m) for m in history])
        seg = _Segment(conv, history)
        seg.context(conv.prompt())
        seg.prompt_len = len(seg.tokens)
        ep.segments.append(seg)
        return seg

    async def finish(self, caller: str, episode_id: str, reward: float, *, task_id: str = "",
                     group_id: str = "", group_size: int = 1,
                     reward_parts: dict[str, float] | None = None) -> list[Trajectory]:
        """End the episode with its reward (checked by `openai_params.check_reward`): its trajectories, also
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
