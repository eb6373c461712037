"""The rollout fleet's front door: one address for the OpenAI endpoint of every rollout replica.

An outside agent's episode is state in the replica that opened it (its tokens, log-probs and
conversation: `openai_episodes.py`), so every call of an episode must reach that replica. The
router places and proxies each request:

- **an episode's calls** (`X-Kiln-Episode`, a reward, a delete) go to the replica that opened
  it. Episode ids end with the opening replica's instance (`ep-<hex>.<instance>`, issued by the
  replica), so placement needs no table: routers hold no episode state, several can run side
  by side, and a restarted one routes as before. An episode whose replica is gone, failing or
  restarted (a new instance) gets a 503 with code `replica_gone`: its turns are lost with the
  replica, and the client plays it again on a new episode. Never a silent 404.
- **a new episode** (`POST /v1/kiln/episodes`) goes to the least loaded replica that is serving
  and not draining: open episodes plus generations in flight, as each replica's `/healthz`
  reports them, plus what the router has placed there since.
- **a call that names no episode** (a stock client) goes where its conversation's root (its
  tools and messages up to the first user turn) ranks highest by rendezvous hashing among the
  serving replicas: every turn of a conversation reaches the same replica, which finds its
  issued episode again, and conversations that share a root (a group's samples of one task)
  share that replica's prefix cache. Such conversations are placed by content, not by load.
- **anything else** (`/v1/models`, the routes the replicas refuse by name) goes to the least
  loaded replica.

The router checks API keys itself (the replicas' keys file; 401 before anything is forwarded)
and passes the `Authorization` header on, so each replica still binds episodes to their key.
Replicas are found by a `discover()` callable (fixed URLs, `kiln run`'s announcement files, or a
headless Service's DNS: `router_main.py`) and health-checked every `interval` seconds; a replica
that is no longer discovered but still answers is kept as draining, so that its open episodes
finish. A replica whose connection fails is taken out at once, before its next health check.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_server import EPISODE_HEADER, REPLICA_HEADER

log = logging.getLogger("kiln.rollout.router")
Discover = Callable[[], Awaitable[set[str]]]
#: Headers that belong to one hop (RFC 9110 7.6.1) or that aiohttp writes itself.
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
       "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass
class Replica:
    url: str
    instance: str = ""
    """The serving process's incarnation (its /healthz): the suffix of its episodes' ids."""
    serving: bool = False
    draining: bool = False
    discovered: bool = True
    load: int = 0
    """Open episodes plus generations in flight, as the replica last reported them."""
    opened: int = 0
    """Episodes the router opened there since that report (which counts them from then on)."""
    calls: int = 0
    """Calls the router has in flight there."""

    def weight(self) -> int:
        return self.load + self.opened + self.calls

    def state(self) -> str:
        return "down" if not self.serving else "draining" if self.draining else "serving"


class Replicas:
    """The replicas one router knows, as its last health checks found them."""

    def __init__(self, discover: Discover, session: aiohttp.ClientSession, *,
                 interval: float = 1.0, on_change: Callable[[list[Replica]], None] = lambda r: None):
        self.discover, self.session, self.interval = discover, session, interval
        self.on_change = on_change
        self.known: dict[str, Replica] = {}

    async def refresh(self) -> None:
        try:
            urls = await self.discover()
        except Exception as exc:  # noqa: BLE001 — DNS or a file briefly missing: keep the last set
            log.warning("replica discovery failed: %r", exc)
            urls = {u for u, r in self.known.items() if r.discovered}
        for url in urls - self.known.keys():
            self.known[url] = Replica(url)
        for url, r in self.known.items():
            r.discovered = url in urls
        await asyncio.gather(*(self._check(r) for r in list(self.known.values())))
        for url, r in list(self.known.items()):
            if not r.discovered and not r.serving:
                del self.known[url]  # gone from discovery and not answering: forgotten
        self.on_change(list(self.known.values()))

    async def _check(self, r: Replica) -> None:
        try:
            async with self.session.get(r.url + "/healthz",
                                        timeout=aiohttp.ClientTimeout(total=2)) as resp:
                body = await resp.json(content_type=None)
            r.instance = str(body.get("instance", r.instance))
            r.serving = resp.status == 200 and bool(body.get("ok"))
            r.draining = bool(body.get("draining")) or not r.discovered
            r.load = int(body.get("open_episodes", 0)) + int(body.get("in_flight", 0))
            r.opened = 0
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            r.serving = False

    async def watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 — a round that failed must not end the watching
                log.exception("a health round of the rollout replicas failed")
            await asyncio.sleep(self.interval)

    def lost(self, r: Replica) -> None:
        """A connection to `r` failed: out until a health check finds it serving again."""
        if r.serving:
            log.warning("rollout replica %s (%s) stopped answering", r.instance, r.url)
        r.serving = False
        self.on_change(list(self.known.values()))

    def open(self) -> list[Replica]:
        """Replicas that take new episodes, least loaded first."""
        return sorted((r for r in self.known.values() if r.serving and not r.draining),
                      key=lambda r: (r.weight(), r.url))

    def of_episode(self, episode_id: str) -> tuple[Replica | None, str]:
        """The replica serving `episode_id`, and its instance named by the id ("" if none)."""
        _, dot, instance = episode_id.rpartition(".")
        if not dot or not instance:
            return None, ""
        for r in self.known.values():
            if r.instance == instance and r.serving:
                return r, instance
        return None, instance

    def of_conversation(self, root: str) -> list[Replica]:
        """Replicas for a conversation with this root, its own first (rendezvous hashing)."""
        return sorted(self.open(), key=lambda r: hashlib.sha256(
            f"{r.url}\n{root}".encode()).digest(), reverse=True)


def conversation_root(body: dict[str, Any]) -> str:
    """What identifies a conversation from its first turn on: its tools, and its messages up
    to and including the first user message (what every later call repeats)."""
    messages = body.get("messages")
    head: list[Any] = []
    if isinstance(messages, list):
        for m in messages:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
    return json.dumps([body.get("tools"), head], sort_keys=True, default=str)


def _error(status: int, message: str, code: str, kind: str = "server_error") -> web.Response:
    headers = {"Retry-After": "1"} if status == 503 else {}
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": code}}, status=status, headers=headers)


class Router:
    def __init__(self, replicas: Replicas, keys: ApiKeys, *, max_body_bytes: int = 4 << 20,
                 count: Callable[..., None] = lambda **labels: None) -> None:
        """`count(replica=, placement=, code=)` records each routed call, `count(refused=)`
        each refusal (the metrics of `router_main.py`)."""
        self.replicas, self.keys, self.max_body_bytes = replicas, keys, max_body_bytes
        self.count = count

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes([web.get("/healthz", self.healthz),
                        web.route("*", "/{tail:.*}", self.route)])
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        replicas = [{"url": r.url, "instance": r.instance, "state": r.state(),
                     "load": r.weight()} for r in self.replicas.known.values()]
        ok = bool(self.replicas.open())
        return web.json_response({"ok": ok, "replicas": replicas}, status=200 if ok else 503)

    async def route(self, request: web.Request) -> web.StreamResponse:
        if self.keys.identify(request.headers.get("Authorization")) is None:
            self.count(refused="unauthenticated")
            return web.json_response(
                {"error": {"message": "an API key is required: Authorization: Bearer <key>",
                           "type": "authentication_error", "param": None,
                           "code": "invalid_api_key"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.count(refused="too_large")
            return _error(413, f"the request body is larger than {self.max_body_bytes} bytes "
                          "(rollout.openai.maxBodyBytes)", "request_too_large",
                          "invalid_request_error")
        episode = self._episode_of(request)
        if episode:
            replica, instance = self.replicas.of_episode(episode)
            if replica is None:
                self.count(refused="replica_gone")
                return self._gone(episode, instance)
            return await self._forward(request, body, [replica], "episode", episode)
        if request.method == "POST" and request.path == "/v1/chat/completions":
            try:
                parsed = json.loads(body or b"{}")
            except ValueError:
                parsed = None  # the replica refuses it in its own words
            root = conversation_root(parsed) if isinstance(parsed, dict) else ""
            return await self._forward(request, body, self.replicas.of_conversation(root),
                                       "conversation")
        placement = "new" if request.path == "/v1/kiln/episodes" else "any"
        return await self._forward(request, body, self.replicas.open(), placement)

    @staticmethod
    def _episode_of(request: web.Request) -> str:
        if request.path.startswith("/v1/kiln/episodes/"):
            return request.path.removeprefix("/v1/kiln/episodes/").split("/")[0]
        return request.headers.get(EPISODE_HEADER, "")

    def _gone(self, episode: str, instance: str) -> web.Response:
        if not instance:
            return _error(404, f"episode {episode!r} is not open (not an id this fleet issued)",
                          "not_found_error", "not_found_error")
        return _error(503, f"episode {episode!r} was served by rollout replica {instance}, which "
                      "is gone, failing or restarted: its turns are lost with it; open a new "
                      "episode and play it again", "replica_gone")

    async def _forward(self, request: web.Request, body: bytes, candidates: list[Replica],
                       placement: str, episode: str = "") -> web.StreamResponse:
        """Send the request to the first candidate that takes the connection; a new episode
        or a conversation moves on to the next one when a replica cannot be reached (nothing
        reached it), an episode's call does not (its state is in that replica alone)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        headers["X-Forwarded-For"] = request.remote or ""
        for replica in candidates:
            replica.calls += 1
            try:
                upstream = await self.replicas.session.request(
                    request.method, replica.url + request.path_qs, data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=2))
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                replica.calls -= 1
                self.replicas.lost(replica)
                if episode:
                    self.count(refused="replica_gone")
                    return self._gone(episode, replica.instance)
                continue
            try:
                return await self._relay(request, upstream, replica, placement)
            finally:
                upstream.release()
                replica.calls -= 1
                if placement == "new" and upstream.status < 300:
                    replica.opened += 1
        self.count(refused="no_replica")
        return _error(503, "no rollout replica is serving: try again shortly", "no_replica")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     replica: Replica, placement: str) -> web.StreamResponse:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        headers.setdefault(REPLICA_HEADER, replica.instance)
        self.count(replica=replica.instance, placement=placement, code=str(upstream.status))
        if not upstream.content_type.startswith("text/event-stream"):
            # A whole JSON reply: one read, one write with its length (no chunking).
            body = await upstream.read()
            return web.Response(status=upstream.status, reason=upstream.reason, body=body,
                                headers=headers)
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await resp.prepare(request)
        # Event by event: a streamed reply reaches the client as the replica sends it.
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
        except aiohttp.ClientError:
            self.replicas.lost(replica)  # died mid-reply: the client sees the stream cut
            raise
        await resp.write_eof()
        return resp


async def serve(router: Router, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen; returns the runner (cleanup stops it) and the port bound."""
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.info("router at http://%s:%d/v1", host, bound)
    return runner, bound

