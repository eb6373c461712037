"""The rollout engine behind the OpenAI chat-completions API, so that an existing agent scaffold
can act as the policy.

    POST /v1/kiln/episodes                 open an episode: {"episode_id": "ep-..."} (201)
    POST /v1/chat/completions              one reply of an episode (stream optional)
    POST /v1/kiln/episodes/{id}/reward     {"reward": 1.0, "task_id": ..., "group_id": ...,
                                            "group_size": 8, "reward_parts": {...}}
    DELETE /v1/kiln/episodes/{id}          drop an episode without training on it
    GET  /v1/models                        the one model served
    GET  /healthz                          liveness, the only route without a key

Every request but /healthz carries `Authorization: Bearer <key>` (`openai_auth.py`); without a
known key: 401. Episodes are issued by the server and bound to the key that opened them
(`openai_episodes.py`): another key gets a 404 for them. Every completion request names its
episode: an `X-Kiln-Episode` header, else the `user` field. Limits (`spec.rollout.openai`): a
body over `maxBodyBytes` gets a 413, an episode past `maxOpenEpisodes` per key a 429, a reward
outside `rewardRange` or not finite a 400 (the episode stays open); a body over 64 KiB is
parsed and rendered off the event loop.
`openai_episodes.ExternalEpisodes` keeps each episode's exact tokens; the reward call turns it
into trajectories. Besides the standard fields a response carries `kiln`: the sampled token ids,
their log-probs (of the raw model distribution; when the job samples at a temperature other
than 0 or 1, of the request's tempered one, and the trainer uses the job's temperature: send
that one) and policy versions. `logprobs: true` also fills the standard `choices[0].logprobs`.

Supported request fields: messages, tools, tool_choice (`auto` only: the model decides),
temperature, top_p, max_tokens / max_completion_tokens, seed, stream, logprobs, user. Refused
with a 400 naming the field: `n` > 1 (send n requests with their own episode ids), `stop`
strings (a reply ends at the model's end-of-turn token), other tool_choice values.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_episodes import (ExternalEpisodes, Reply, RequestError,
                                                   TooManyEpisodes, UnknownEpisode)

log = logging.getLogger("kiln.rollout.openai")
EPISODE_HEADER = "X-Kiln-Episode"
#: Bodies larger than this are parsed (and their history rendered) on the rendering thread.
OFFLOAD_BYTES = 64 << 10
CALLER = web.RequestKey("caller", str)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def _sampling(body: dict[str, Any], default_max_tokens: int) -> SamplingOptions:
    for name in ("temperature", "top_p"):
        if name in body and body[name] is not None and not isinstance(body[name], (int, float)):
            raise RequestError(f"{name}: expected a number")
    if body.get("n") not in (None, 1):
        raise RequestError("n: only 1 is supported (send one request per episode)")
    if body.get("tool_choice") not in (None, "auto"):
        raise RequestError("tool_choice: only 'auto' is supported (the model decides whether to "
                           "call a tool; its reply is trained on as sampled)")
    if body.get("stop"):
        raise RequestError("stop: stop sequences are not supported; a reply ends at the model's "
                           "end-of-turn token, so the tokens trained on are the tokens sampled")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError("max_tokens: expected a positive integer")
    temperature = body.get("temperature")
    try:
        return SamplingOptions(temperature=1.0 if temperature is None else float(temperature),
                               top_p=float(body.get("top_p") or 1.0), max_tokens=max_tokens,
                               seed=body.get("seed"))
    except ValueError as exc:
        raise RequestError(str(exc)) from None


class OpenAIServer:
    def __init__(self, episodes: ExternalEpisodes, *, model_name: str, tokenizer: Any,
                 keys: ApiKeys, host: str = "127.0.0.1", port: int = 0) -> None:
        self.episodes, self.model_name, self.tokenizer = episodes, model_name, tokenizer
        self.keys, self.host, self.port = keys, host, port
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.episodes.settings.max_body_bytes,
                              middlewares=[self._authenticate])
        app.add_routes([
            web.post("/v1/kiln/episodes", self.open_episode),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/kiln/episodes/{episode_id}/reward", self.reward),
            web.delete("/v1/kiln/episodes/{episode_id}", self.abandon),
            web.get("/v1/models", self.models),
            web.get("/healthz", self.healthz),
        ])
        return app

    async def start(self) -> int:
        """Listen; returns the port (the one the OS chose when `port` is 0)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._sweeper = asyncio.ensure_future(self._sweep())
        log.info("OpenAI endpoint at http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.episodes.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.episodes.idle_seconds / 4))
            if n := self.episodes.drop_idle():
                log.warning("closed %d episodes idle for over %.0f s without a reward", n,
                            self.episodes.idle_seconds)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path == "/healthz":
            return await handler(request)
        caller = self.keys.identify(request.headers.get("Authorization"))
        if caller is None:
            return web.json_response(
                {"error": {"message": "an API key is required: Authorization: Bearer <key>",
                           "type": "authentication_error"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        request[CALLER] = caller
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is larger than {self.episodes.settings.max_body_bytes} "
                          "bytes (rollout.openai.maxBodyBytes)", "request_too_large")

    async def _json(self, request: web.Request) -> tuple[dict[str, Any], bool]:
        """The body as a JSON object, and whether it is large (parsed off the event loop)."""
        raw = await request.read()
        heavy = len(raw) > OFFLOAD_BYTES
        try:
            body = await self.episodes.offload(json.loads, raw) if heavy else json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body, heavy

    async def open_episode(self, request: web.Request) -> web.Response:
        try:
            episode_id = self.episodes.open(request[CALLER])
        except TooManyEpisodes as exc:
            return _error(429, str(exc), "rate_limit_error")
        return web.json_response({"episode_id": episode_id}, status=201)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body, heavy = await self._json(request)
            episode_id = request.headers.get(EPISODE_HEADER) or body.get("user") or ""
            sampling = _sampling(body, self.episodes.max_tokens_per_turn)
            reply = await self.episodes.complete(request[CALLER], str(episode_id),
                                                 body.get("messages"), body.get("tools"),
                                                 sampling=sampling, offload=heavy)
        except RequestError as exc:
            return _error(400, str(exc))
        except UnknownEpisode:
            return _not_open(episode_id)
        except ValueError as exc:  # the template cannot keep this conversation token-exact
            return _error(422, str(exc))
        self.requests += 1
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        choice: dict[str, Any] = {"index": 0, "message": reply.message,
                                  "finish_reason": reply.finish_reason}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._logprobs(reply)}
        kiln = {"episode_id": episode_id, "token_ids": reply.token_ids,
                "logprobs": reply.logprobs, "policy_versions": reply.versions}
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.token_ids),
                 "total_tokens": reply.prompt_tokens + len(reply.token_ids)}
        if not body.get("stream"):
            return web.json_response({"id": cid, "object": "chat.completion", "created": created,
                                      "model": self.model_name, "choices": [choice],
                                      "usage": usage, "kiln": kiln})
        return await self._stream(request, cid, created, choice, usage, kiln)

    def _logprobs(self, reply: Reply) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(reply.token_ids, reply.logprobs):
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": []})
        return out

    async def _stream(self, request: web.Request, cid: str, created: int, choice: dict[str, Any],
                      usage: dict[str, Any], kiln: dict[str, Any]) -> web.StreamResponse:
        """The reply as server-sent events: generation is not incremental here, so the whole
        message comes in one delta, then the finish reason."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        head = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                        **({"logprobs": choice["logprobs"]} if "logprobs" in choice else {})}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": usage, "kiln": kiln}]
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def reward(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode_id"]
        try:
            body, _ = await self._json(request)
            group_id = str(body.get("group_id") or "")
            reward, parts, size = self.episodes.check_reward(
                body.get("reward"), body.get("reward_parts"), body.get("group_size"), group_id)
            trajs = await self.episodes.finish(
                request[CALLER], episode_id, reward, task_id=str(body.get("task_id") or ""),
                group_id=group_id, group_size=size, reward_parts=parts)
        except RequestError as exc:
            return _error(400, str(exc))
        except UnknownEpisode:
            return _not_open(episode_id)
        except ValueError as exc:  # the buffer refused the trajectories; the episode stays open
            return _error(400, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # the buffer is unreachable or full; the episode stays open
            log.warning("episode %s: its trajectories were not stored: %r", episode_id, exc)
            return _error(503, f"the trajectories could not be stored ({type(exc).__name__}); "
                          "the episode is still open: send its reward again", "server_error")
        return web.json_response({"episode_id": episode_id, "trajectories": [t.id for t in trajs],
                                  "tokens": sum(len(t.tokens) for t in trajs)})

    async def abandon(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode_id"]
        try:
            self.episodes.abandon(request[CALLER], episode_id)
        except UnknownEpisode:
            return _not_open(episode_id)
        return web.json_response({"episode_id": episode_id, "dropped": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kiln"}]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


def _not_open(episode_id: str) -> web.Response:
    return _error(404, f"episode {episode_id!r} is not open for this API key (never opened, "
                  "another key's, already rewarded, or closed after being idle)", "not_found_error")
