"""The rollout engine behind the OpenAI chat-completions API, so that an existing agent scaffold
can act as the policy.

    POST /v1/kiln/episodes                 open an episode: {"episode_id": "ep-..."} (201)
    POST /v1/chat/completions              one reply of an episode (stream optional)
    POST /v1/kiln/episodes/{id}/reward     {"reward": 1.0, "task_id": ..., "group_id": ...,
                                            "group_size": 8, "reward_parts": {...}}
    DELETE /v1/kiln/episodes/{id}          drop an episode without training on it
    GET  /v1/models, /v1/models/{id}       the one model served (another id: 404)
    GET  /healthz                          liveness, the only route without a key: 503 once
                                           the engine is dead or wedged; with the replica's
                                           instance, whether it drains, and its open episodes
                                           and calls in flight (what the router places by)

Every request but /healthz carries `Authorization: Bearer <key>` (`openai_auth.py`); without a
known key: 401. Episodes are bound to the key that opened them (`openai_episodes.py`): another
key gets a 404 for them. A completion request names its episode in an `X-Kiln-Episode` header
(`user` is the API's end-user id and is never taken for one); a request that names none gets
one issued by the server, returned in the `X-Kiln-Episode` response header and in
`kiln.episode_id`, and a later request that sends that conversation back (the reply included)
continues it, so a stock client's episodes need no Kiln code. Limits (`spec.rollout.openai`):
a body over `maxBodyBytes` gets a 413, an episode past `maxOpenEpisodes` per key a 429 (an
issued one closes the key's least recently used issued episode instead), a reward outside
`rewardRange` or not finite a 400 (the episode stays open); a body over 64 KiB is parsed and
rendered off the event loop.
`openai_episodes.ExternalEpisodes` keeps each episode's exact tokens; the reward call turns it
into trajectories. Besides the standard fields a response carries `kiln`: the episode id, the
sampled token ids, their log-probs (of the raw model distribution; when the job samples at a
temperature other than 0 or 1, of the request's tempered one, and the trainer uses the job's
temperature: send that one) and policy versions. `logprobs: true` also fills the standard
`choices[0].logprobs`.

Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`. Every
sampling field is checked before the engine sees it (`openai_params.py`): a wrong type or range,
or a value asking for what is not done here (`n` > 1, stop strings, penalties, `top_k`,
`top_logprobs`, a forced `tool_choice`, a JSON `response_format`), gets a 400 naming the field;
another model's name a 404; a conversation or `max_tokens` past the context a 400 worded as
vLLM's (`context_length_exceeded`). A failed call leaves its episode as it was, so a retry
continues it. An engine that dies or stops answering makes /healthz fail and calls `on_dead`
(`kiln serve` and the rollout service exit, to be restarted). `stream: true` sends the reply as
server-sent events in one delta (generation is not incremental here). `/v1/completions`,
`/v1/responses` and `/v1/embeddings` get a 404 that says so.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from typing import Any, Callable

from aiohttp import web

from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_episodes import (ExternalEpisodes, Reply, TooManyEpisodes,
                                                   UnknownEpisode)
from kiln.services.rollout.openai_messages import RequestError
from kiln.services.rollout.openai_params import check_reward, sampling_options

log = logging.getLogger("kiln.rollout.openai")
EPISODE_HEADER = "X-Kiln-Episode"
REPLICA_HEADER = "X-Kiln-Replica"
INSTANCE_CHARS = re.compile(r"[^a-z0-9-]")
#: Bodies larger than this are parsed (and their history rendered) on the rendering thread.
OFFLOAD_BYTES = 64 << 10
CALLER = web.RequestKey("caller", str)


def replica_name(replica: str) -> str:
    """A rollout replica's name from `KILN_ROLLOUT_REPLICA`: a pod's name on a cluster, a
    worker's number under `kiln run` (none for the first)."""
    return f"rollout-{replica or 0}" if not replica or replica.isdigit() else replica


def _error(status: int, message: str, kind: str = "invalid_request_error", *,
           param: str | None = None, code: str | None = None) -> web.Response:
    """OpenAI's error shape, which its clients map to their exception classes by status."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": code}}, status=status)


def _refused(exc: RequestError) -> web.Response:
    return _error(400, str(exc), param=exc.param, code=exc.code)


class OpenAIServer:
    def __init__(self, episodes: ExternalEpisodes, *, model_name: str, tokenizer: Any,
                 keys: ApiKeys, host: str = "127.0.0.1", port: int = 0,
                 stall_seconds: float = 900.0,
                 on_dead: Callable[[str], None] | None = None, replica: str = "serve") -> None:
        """`stall_seconds`: an engine with requests in flight that answers none for this long
        is taken as wedged. `on_dead(reason)`: called once when the engine is found dead or
        wedged (the process should exit, to be restarted); /healthz fails from then on.
        `replica`: this server's name in the fleet (a pod's name, `kiln run`'s worker name)."""
        self.episodes, self.model_name, self.tokenizer = episodes, model_name, tokenizer
        self.keys, self.host, self.port = keys, host, port
        self.stall_seconds, self.on_dead = stall_seconds, on_dead
        # This process's incarnation: a restarted replica gets a new one, so that the router
        # can tell the episodes it lost (their ids end with the old one) from its new ones.
        self.instance = f"{INSTANCE_CHARS.sub('-', replica) or 'serve'}-{secrets.token_hex(3)}"
        episodes.id_suffix = "." + self.instance
        self.draining = False
        """Set by `drain`: no new episodes (503, retryable); open ones are still served."""
        self.dead = ""
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.episodes.settings.max_body_bytes,
                              middlewares=[self._authenticate])
        app.on_response_prepare.append(self._name_replica)
        app.add_routes([
            web.post("/v1/kiln/episodes", self.open_episode),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/kiln/episodes/{episode_id}/reward", self.reward),
            web.delete("/v1/kiln/episodes/{episode_id}", self.abandon),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post("/v1/completions", self.not_served),
            web.post("/v1/embeddings", self.not_served),
            web.post("/v1/responses", self.not_served),
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

    def drain(self) -> None:
        """Stop opening episodes (the replica is leaving): the router sends new ones elsewhere
        and this one's open episodes go on until the process stops."""
        self.draining = True

    async def _name_replica(self, request: web.Request, response: web.StreamResponse) -> None:
        # Which replica served a call, through the router too (what stickiness is checked by).
        response.headers[REPLICA_HEADER] = self.instance

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.episodes.idle_seconds / 4, self.stall_seconds / 4))
            if self.check_engine():
                continue
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
                           "type": "authentication_error", "param": None, "code": "invalid_api_key"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        request[CALLER] = caller
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is larger than {self.episodes.settings.max_body_bytes} "
                          "bytes (rollout.openai.maxBodyBytes)", "request_too_large")
        except web.HTTPNotFound:
            return _error(404, f"no route {request.path}: this server has /v1/chat/completions, "
                          "/v1/models and /v1/kiln/episodes", "not_found_error")
        except web.HTTPMethodNotAllowed as exc:
            return _error(405, f"{request.method} {request.path}: allowed {sorted(exc.allowed_methods)}",
                          "invalid_request_error")

    def check_engine(self) -> str:
        """Why the engine cannot serve (dead, or wedged past `stall_seconds`), "" when it can;
        the first time it cannot, `on_dead` is called."""
        if not self.dead:
            stalled = self.episodes.stalled_for()
            self.dead = self.episodes.engine.failure() or (
                f"the engine has answered no request for {stalled:.0f} s with some in flight "
                "(wedged)" if stalled > self.stall_seconds else "")
            if self.dead:
                log.critical("%s; the endpoint reports unhealthy", self.dead)
                if self.on_dead is not None:
                    self.on_dead(self.dead)
        return self.dead

    async def _json(self, request: web.Request) -> tuple[dict[str, Any], bool]:
        """The body as a JSON object, and whether it is large (parsed off the event loop)."""
        raw = await request.read()
        heavy = len(raw) > OFFLOAD_BYTES
        try:
            body = await self.episodes.offload(json.loads, raw) if heavy else json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}", param=None) from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", param=None)
        return body, heavy

    async def open_episode(self, request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, f"rollout replica {self.instance} is draining and opens no new "
                          "episodes: open it again (the router sends it to another replica)",
                          "server_error", code="replica_draining")
        try:
            episode_id = self.episodes.open(request[CALLER])
        except TooManyEpisodes as exc:
            return _error(429, str(exc), "rate_limit_error")
        return web.json_response({"episode_id": episode_id}, status=201)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        episode_id = request.headers.get(EPISODE_HEADER) or None
        try:
            body, heavy = await self._json(request)
            if (missing := self._unknown_model(body)) is not None:
                return missing
            sampling, exact = sampling_options(
                body, self.episodes.max_tokens_per_turn,
                honours_seeds=getattr(self.episodes.engine, "honours_seeds", True))
            reply = await self.episodes.complete(request[CALLER], episode_id,
                                                 body.get("messages"), body.get("tools"),
                                                 sampling=sampling, offload=heavy,
                                                 exact_max_tokens=exact)
        except RequestError as exc:
            return _refused(exc)
        except UnknownEpisode:
            return _not_open(str(episode_id))
        except TooManyEpisodes as exc:
            return _error(429, str(exc), "rate_limit_error")
        except ValueError as exc:  # the template cannot keep this conversation token-exact
            return _error(422, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # the engine failed; the episode is as it was before the call
            log.warning("a completion failed in the engine: %r", exc)
            dead = self.check_engine()
            return _error(503 if dead else 500, f"the engine failed ({type(exc).__name__}: "
                          f"{exc}){'; ' + dead if dead else ''}", "server_error")
        episode_id = reply.episode_id
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
                                      "usage": usage, "kiln": kiln},
                                     headers={EPISODE_HEADER: episode_id})
        return await self._stream(request, cid, created, choice, usage, kiln)

    def _unknown_model(self, body: dict[str, Any]) -> web.Response | None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error(400, "model: expected the served model's name, "
                          f"{self.model_name!r}", param="model")
        if model != self.model_name:
            return _error(404, f"The model `{model}` does not exist. This server serves "
                          f"`{self.model_name}`.", "NotFoundError", param="model",
                          code="model_not_found")
        return None

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
                                           "Cache-Control": "no-cache",
                                           EPISODE_HEADER: kiln["episode_id"]})
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
            stage = self.episodes.stage_group_size
            reward, parts, size = check_reward(
                body.get("reward"), body.get("reward_parts"), body.get("group_size"), group_id,
                reward_range=self.episodes.settings.reward_range,
                stage=stage() if stage is not None else None)
            trajs = await self.episodes.finish(
                request[CALLER], episode_id, reward, task_id=str(body.get("task_id") or ""),
                group_id=group_id, group_size=size, reward_parts=parts)
        except RequestError as exc:
            return _refused(exc)
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
        return web.json_response({"object": "list", "data": [self._card()]})

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kiln",
                "max_model_len": self.episodes.max_total_tokens}

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            return _error(404, f"The model `{name}` does not exist. This server serves "
                          f"`{self.model_name}`.", "NotFoundError", param="model",
                          code="model_not_found")
        return web.json_response(self._card())

    async def not_served(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.path} is not served here: this endpoint serves chat "
                      "completions (/v1/chat/completions), whose episodes it can train on",
                      "not_found_error")

    async def healthz(self, request: web.Request) -> web.Response:
        if dead := self.check_engine():
            return web.json_response({"ok": False, "reason": dead, "instance": self.instance},
                                     status=503)
        # What the fleet's router places episodes by.
        return web.json_response({"ok": True, "instance": self.instance,
                                  "draining": self.draining,
                                  "open_episodes": len(self.episodes),
                                  "in_flight": self.episodes.in_flight})


def _not_open(episode_id: str) -> web.Response:
    return _error(404, f"episode {episode_id!r} is not open for this API key (never opened, "
                  "another key's, already rewarded, or closed after being idle)", "not_found_error")
