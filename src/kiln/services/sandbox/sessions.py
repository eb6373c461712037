"""Sandbox sessions: owners, idle TTLs, a warm pool per image, a concurrency limit, throttled
starts. This is the logic behind the gRPC service; it knows nothing of protobuf.

- A session is one sandbox lent to an owner (a rollout replica, a job). It expires when unused
  for `ttl_seconds`; `destroy_owner` ends all sessions of an owner that went away.
- At most `max_concurrent` sandboxes exist at once (warm ones included); a create waits up to
  `acquire_timeout_s` for room, then fails with `CapacityError` (retryable).
- One owner holds at most `max_per_owner` sessions (None: no bound beyond `max_concurrent`), so
  one rollout replica cannot starve the others; a create past it fails with `CapacityError`
  at once (the owner must end one of its own first).
- At most `max_parallel_starts` sandboxes start at once, so a burst of creates does not stall
  the host (container starts are CPU-heavy).
- `warm_pool` sandboxes per image are kept started with the default limits; a create with the
  default limits takes one, and the pool refills in the background.
- Every start is timed into the `kiln_sandbox_start_seconds` histogram; failures are counted.

Not covered: persistence (sessions die with the process; `reap_orphans` at start-up removes
what a killed process left behind).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .config import BubblewrapConfig, DockerConfig, SandboxLimits, check_owner
from kiln.env import Grade, Task
from .environments.tasks import make_environment, parse_task
from .factory import make_sandbox, reap_orphans
from .interface import Sandbox, SandboxError
from .metrics import ACTIVE, START_FAILURES, START_SECONDS

log = logging.getLogger("kiln.sandbox.sessions")


class CapacityError(SandboxError):
    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class SessionNotFound(KeyError):
    pass


@dataclass
class PoolConfig:
    max_concurrent: int = 64
    max_per_owner: int | None = None
    max_parallel_starts: int = 8
    warm_pool: int = 0
    default_ttl_s: float = 600.0
    acquire_timeout_s: float = 30.0
    tasks_dir: Path = field(default_factory=Path.cwd)
    """Folder that relative paths in task records (repos, corpora) resolve against."""


@dataclass
class Session:
    id: str
    owner: str
    sandbox: Sandbox
    ttl_s: float
    task: Task | None = None
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def expired(self, now: float) -> bool:
        return now - self.last_used > self.ttl_s


class SessionManager:
    def __init__(self, base: BubblewrapConfig | DockerConfig, pool: PoolConfig | None = None,
                 client=None) -> None:
        self.base = base
        self.pool = pool or PoolConfig()
        self.client = client
        self.sessions: dict[str, Session] = {}
        self._per_owner: dict[str, int] = {}
        """Sessions of each owner, counted from the start of `create` (so concurrent creates
        cannot all pass the bound) to the end of `destroy`."""
        self._room = asyncio.Semaphore(self.pool.max_concurrent)
        self.room = self._room
        """Living sandboxes (warm ones included); the episode manager draws from it too."""
        self._starts = asyncio.Semaphore(self.pool.max_parallel_starts)
        self._warm: dict[str, list[Sandbox]] = {}
        self._bg: set[asyncio.Task] = set()
        self._closed = False

    # -- start-up and shutdown ------------------------------------------------------------
    async def start(self) -> list[str]:
        """Reap what an earlier process of this owner left, fill the warm pool."""
        removed = await asyncio.to_thread(reap_orphans, self.base, self.client)
        if removed:
            log.info("reaped %d orphaned sandboxes: %s", len(removed), ", ".join(removed))
        if self.pool.warm_pool:
            # At start-up a backend that cannot start sandboxes is fatal, not a warning.
            await self._refill(self._image_key(None), strict=True)
        self._bg_task(self._expiry_loop())
        return removed

    async def close(self) -> None:
        self._closed = True
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        ids = list(self.sessions)
        await asyncio.gather(*(self.destroy(i) for i in ids), return_exceptions=True)
        for pool in self._warm.values():
            while pool:
                await self._release(pool.pop())

    # -- sandboxes ------------------------------------------------------------------------
    def _image_key(self, image: str | None) -> str:
        if isinstance(self.base, DockerConfig):
            return image or self.base.image
        return str(self.base.rootfs or "host")

    def _config(self, image: str | None, limits: SandboxLimits | None):
        update: dict = {}
        if limits is not None:
            update["limits"] = limits
        if image and isinstance(self.base, DockerConfig):
            update["image"] = image
        return self.base.model_copy(update=update) if update else self.base

    async def _new_sandbox(self, image: str | None, limits: SandboxLimits | None) -> Sandbox:
        try:
            await asyncio.wait_for(self._room.acquire(), self.pool.acquire_timeout_s)
        except asyncio.TimeoutError:
            raise CapacityError(f"all {self.pool.max_concurrent} sandboxes busy for "
                                f"{self.pool.acquire_timeout_s:g} s; retry later") from None
        try:
            sandbox = make_sandbox(self._config(image, limits), client=self.client)
            async with self._starts:
                t0 = time.monotonic()
                try:
                    await sandbox.start()
                except BaseException:
                    START_FAILURES.labels(self.base.type).inc()
                    await sandbox.destroy()
                    raise
                START_SECONDS.labels(self.base.type).observe(time.monotonic() - t0)
            ACTIVE.labels(self.base.type).inc()
            return sandbox
        except BaseException:
            self._room.release()
            raise

    async def _release(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.destroy()
        finally:
            ACTIVE.labels(self.base.type).dec()
            self._room.release()

    async def _refill(self, key: str, strict: bool = False) -> None:
        pool = self._warm.setdefault(key, [])
        image = None if key == self._image_key(None) else key
        try:
            while not self._closed and len(pool) < self.pool.warm_pool:
                pool.append(await self._new_sandbox(image, None))
        except (SandboxError, RuntimeError, OSError):
            if strict:
                raise
            # Creates still work without a warm sandbox (they start their own); the failure
            # is counted in kiln_sandbox_failures_total{reason="start"} and logged here.
            log.exception("refilling the warm pool for %s failed", key)

    def _bg_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- sessions -------------------------------------------------------------------------
    async def create(self, owner: str, *, image: str | None = None,
                     limits: SandboxLimits | None = None, ttl_s: float | None = None,
                     task: dict | None = None) -> Session:
        check_owner(owner)
        parsed = parse_task(task, "task") if task is not None else None
        if parsed is not None and parsed.image and not image:
            image = parsed.image
        held = self._per_owner.get(owner, 0)
        bound = self.pool.max_per_owner
        if bound is not None and held >= bound:
            raise CapacityError(f"owner: {owner!r} holds {held} sandboxes, the most one owner "
                                f"may (spec.sandbox.maxPerOwner = {bound}); end one first")
        self._per_owner[owner] = held + 1
        try:
            key = self._image_key(image)
            pool = self._warm.get(key)
            if limits is None and pool:
                sandbox = pool.pop()
                self._bg_task(self._refill(key))
            else:
                sandbox = await self._new_sandbox(image, limits)
        except BaseException:
            self._owner_done(owner)
            raise
        session = Session(uuid.uuid4().hex, owner, sandbox, ttl_s or self.pool.default_ttl_s,
                          parsed)
        self.sessions[session.id] = session
        if parsed is not None:
            try:
                await make_environment(parsed.type, self.pool.tasks_dir).setup(sandbox, parsed)
            except BaseException:
                await self.destroy(session.id)
                raise
        return session

    def get(self, session_id: str) -> Session:
        try:
            session = self.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"session_id: no live session {session_id!r} "
                                  "(expired or destroyed)") from None
        session.touch()
        return session

    async def destroy(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._owner_done(session.owner)
        await self._release(session.sandbox)
        return True

    def _owner_done(self, owner: str) -> None:
        left = self._per_owner.get(owner, 1) - 1
        if left > 0:
            self._per_owner[owner] = left
        else:
            self._per_owner.pop(owner, None)

    async def destroy_owner(self, owner: str) -> int:
        ids = [s.id for s in self.sessions.values() if s.owner == owner]
        await asyncio.gather(*(self.destroy(i) for i in ids))
        return len(ids)

    async def verify(self, session_id: str, task: dict | None = None,
                     answer: str | None = None) -> Grade:
        session = self.get(session_id)
        parsed = parse_task(task, "task") if task is not None else session.task
        if parsed is None:
            raise ValueError("task: the session was created without a task, so Verify needs one")
        env = make_environment(parsed.type, self.pool.tasks_dir)
        return await env.grade(session.sandbox, parsed, answer)

    async def expire(self) -> int:
        now = time.monotonic()
        ids = [s.id for s in self.sessions.values() if s.expired(now)]
        for i in ids:
            log.info("session %s expired", i)
            await self.destroy(i)
        return len(ids)

    async def _expiry_loop(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.expire()
