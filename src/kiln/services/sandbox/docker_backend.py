"""The container sandbox backend: one container per sandbox through the Docker Engine API.

In a pod the engine is the dind sidecar; locally and in CI it is podman's Docker-compatible
socket (`podman_service.PodmanService`). Each sandbox is a container running `sleep infinity`
as the unprivileged user, with no network (unless asked: then on a bridge network of its own
under the egress filter, `docker_network.py`), all capabilities dropped,
no-new-privileges, and memory, pids and CPU limits; commands run through `exec`.

Timeouts: the engine API cannot kill one exec, so on timeout the service runs `kill -9 -1` as
the sandbox user inside the container, which signals every process of that user except the
container's init: detached, setsid'd and double-forked children included. When that kill cannot
even start (a fork bomb holding every pid), the container is killed and started again, which
empties its cgroup and, since the workspace is a size-limited tmpfs (the disk quota), empties
the workspace too: the exec that caused it says so on stderr. OOM kills are read
from the container's own memory cgroup (v1 `memory.oom_control` or v2 `memory.events`).

File access goes through `get_archive`/`put_archive`; a path is first resolved inside the
container and refused unless it stays in /workspace with no symlink on the way.

Not covered: image builds (see `podman_service.build_host_image`), registries, volumes.
"""
from __future__ import annotations

import asyncio
import io
import shlex
import tarfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from .config import NAME_PREFIX, DockerConfig
from .docker_network import egress_network
from .interface import (EXIT_OOM, EXIT_TIMEOUT, WORKSPACE, ExecResult, PathEscapeError, Sandbox,
                        SandboxError, WorkspaceFull, workspace_relpath)
from .output import CappedBuffer

LABEL_OWNER = "kiln.sandbox.owner"
#: How long the in-container `kill -9 -1` may take before the container is restarted instead.
KILL_EXEC_TIMEOUT_S = 3.0

#: PID 1 of every container: waits for SIGCHLD and reaps every zombie, so killed detached
#: processes do not pile up against the pids limit (`sleep infinity` would reap nothing).
REAPER_INIT = [
    "python3", "-c",
    "import os, signal\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
    "while True:\n"
    "    signal.sigwait({signal.SIGCHLD})\n"
    "    try:\n"
    "        while os.waitpid(-1, os.WNOHANG)[0] > 0:\n"
    "            pass\n"
    "    except ChildProcessError:\n"
    "        pass\n",
]

_OOM_PROBE = ("cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null "
              "|| cat /sys/fs/cgroup/memory.events 2>/dev/null")


#: Engine calls block (HTTP over a unix socket) and an exec holds its thread for the whole
#: command, so they get their own pool: asyncio's default one has only cpu_count + 4 threads,
#: which would queue the 5th concurrent exec behind the others' running commands.
_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="kiln-docker")


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)


def make_client(config: DockerConfig):
    import docker
    if config.base_url:
        return docker.DockerClient(base_url=config.base_url, timeout=120)
    return docker.from_env(timeout=120)


class DockerSandbox(Sandbox):
    def __init__(self, config: DockerConfig, client=None, name: str | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.name = name or f"{NAME_PREFIX}-{config.owner}-{uuid.uuid4().hex[:12]}"
        self._client = client
        self._own_client = client is None
        self.container = None
        self._destroyed = False

    @property
    def client(self):
        if self._client is None:
            self._client = make_client(self.config)
        return self._client

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        fut = asyncio.ensure_future(_in_thread(self._start))
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The engine call goes on in its thread; wait for it so that `destroy` finds (and
            # removes) the container instead of racing with its creation.
            await asyncio.wait([fut])
            raise

    def _start(self) -> None:
        import docker
        # The egress filter is in place before a networked container exists.
        network = (egress_network(self.client, tuple(self.config.egress_ports))
                   if self.limits.network else None)
        try:
            self.container = self.client.containers.run(
                **container_options(self.config, self.name, self._workspace_options(), network))
        except docker.errors.ImageNotFound as exc:
            raise SandboxError(f"image: {self.config.image} not found in the engine; build it "
                               "with `kiln sandbox image`") from exc
        except docker.errors.APIError as exc:
            raise SandboxError(f"container start failed: {exc}", retryable=True) from exc

    def _workspace_options(self) -> str:
        """tmpfs options of the workspace (the disk quota), owned by the sandbox user. Podman
        refuses uid=/gid= and has `U` (chown to the container's user) instead."""
        size = f"rw,size={self.limits.disk_bytes},nosuid,nodev"
        if _is_podman(self.client):
            return f"{size},U"
        uid, _, gid = self.config.user.partition(":")
        return f"{size},mode=0755,uid={uid},gid={gid or uid}"

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await _in_thread(self._teardown)

    def _teardown(self) -> None:
        import docker
        try:
            self.client.api.remove_container(self.name, force=True, v=True)
        except docker.errors.NotFound:
            pass
        if self._own_client and self._client is not None:
            self._client.close()

    # -- commands -------------------------------------------------------------------------
    def _run_exec(self, argv: list[str], workdir: str, env: dict[str, str], out: CappedBuffer,
                  err: CappedBuffer, user: str | None = None) -> int:
        api = self.client.api
        exec_id = api.exec_create(self.name, argv, stdout=True, stderr=True, workdir=workdir,
                                  environment=env or None, user=user or self.config.user)["Id"]
        for chunk_out, chunk_err in api.exec_start(exec_id, stream=True, demux=True):
            if chunk_out:
                out.feed(chunk_out)
            if chunk_err:
                err.feed(chunk_err)
        code = api.exec_inspect(exec_id).get("ExitCode")
        return -1 if code is None else int(code)

    def _oom_count(self) -> int:
        out, err = CappedBuffer(4096), CappedBuffer(4096)
        self._run_exec(["/bin/sh", "-c", _OOM_PROBE], "/", {}, out, err)
        for line in out.text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def _kill_all(self) -> int:
        out, err = CappedBuffer(4096), CappedBuffer(4096)
        return self._run_exec(["kill", "-9", "-1"], "/", {}, out, err)

    def _restart(self) -> None:
        self.client.api.kill(self.name)
        self.client.api.start(self.name)

    async def _stop_everything(self) -> bool:
        """Kill every process of the sandbox user; restart the container when even that
        cannot run (a fork bomb holding every pid leaves no room for the `kill` process).
        Returns whether it had to restart (which empties the workspace tmpfs)."""
        import docker
        try:
            code = await asyncio.wait_for(_in_thread(self._kill_all), KILL_EXEC_TIMEOUT_S)
            if code == 0:
                return False
        except (asyncio.TimeoutError, docker.errors.APIError):
            pass
        await _in_thread(self._restart)
        return True

    async def exec(self, cmd, *, timeout=None, workdir=None, env=None, stdin=None) -> ExecResult:
        if self.container is None or self._destroyed:
            raise SandboxError(f"sandbox {self.name} is not running")
        timeout = self.limits.timeout_seconds if timeout is None else timeout
        workdir = workdir or WORKSPACE
        if not workdir.startswith("/"):
            workdir = f"{WORKSPACE}/{workdir}"
        if stdin is not None:
            # The engine's exec stdin needs a hijacked socket; a here-file is simpler and the
            # same for the command.
            await self.write_file(".kiln-stdin", stdin)
            cmd = cmd if isinstance(cmd, str) else shlex.join(cmd)
            cmd = f"( {cmd} ) < {WORKSPACE}/.kiln-stdin"
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        out, err = CappedBuffer(self.limits.output_limit_bytes), \
            CappedBuffer(self.limits.output_limit_bytes)
        t0 = time.monotonic()
        done = threading.Event()

        def run() -> int:
            try:
                return self._run_exec(argv, workdir, env or {}, out, err)
            finally:
                done.set()

        task = asyncio.ensure_future(_in_thread(run))
        timed_out = False
        try:
            code = await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            restarted = await self._stop_everything()
            code = await task
            if restarted:
                err.feed(b"\nkiln sandbox: the container had to be restarted to stop the "
                         b"command; the workspace was reset\n")
        duration = time.monotonic() - t0
        oom = False
        if not timed_out and code == EXIT_OOM:
            # 137 is SIGKILL; only the cgroup's counter tells the OOM killer from `kill -9`.
            oom = await _in_thread(self._oom_count) > 0
        if timed_out:
            code = EXIT_TIMEOUT
        return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text(),
                          timed_out=timed_out, oom_killed=oom,
                          truncated=out.truncated or err.truncated, duration_s=duration)

    # -- files ----------------------------------------------------------------------------
    def _resolve(self, path: str) -> str:
        rel = workspace_relpath(path)
        full = f"{WORKSPACE}/{rel}"
        # `realpath -m` resolves every symlink on the way; any difference from the literal
        # path means a symlink is involved, which could point anywhere. It always prints a
        # path: an empty answer is podman 4.3 losing an exec's output under load (about one
        # exec in 200), so ask again rather than call it a symlink.
        for _ in range(3):
            out, err = CappedBuffer(8192), CappedBuffer(8192)
            code = self._run_exec(["realpath", "-m", "--", full], "/", {}, out, err)
            real = out.text().strip()
            if real or code != 0:
                break
        if real != full:
            raise PathEscapeError(f"path: {path!r} goes through a symlink (resolves to {real!r})")
        return full

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await _in_thread(self._read, path, max_bytes)

    def _read(self, path: str, max_bytes: int | None) -> bytes:
        import docker
        full = self._resolve(path)
        try:
            stream, _ = self.client.api.get_archive(self.name, full)
        except docker.errors.NotFound:
            raise FileNotFoundError(path) from None
        # Streamed: only the first `max_bytes` of the file are ever held in memory.
        try:
            with tarfile.open(fileobj=io.BufferedReader(_ChunkReader(stream)), mode="r|") as tar:
                member = tar.next()
                if member is None or not member.isfile():
                    raise PathEscapeError(f"path: {path!r} is not a regular file")
                f = tar.extractfile(member)
                return f.read() if max_bytes is None else f.read(max_bytes)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await _in_thread(self._write, path, data, mode)

    def _write(self, path: str, data: bytes, mode: int) -> None:
        import docker
        full = self._resolve(path)
        parent, _, name = full.rpartition("/")
        if parent != WORKSPACE:
            out, err = CappedBuffer(4096), CappedBuffer(4096)
            code = self._run_exec(["mkdir", "-p", "--", parent], "/", {}, out, err)
            if code != 0:
                raise SandboxError(f"cannot create {parent}: {err.text().strip()}")
        uid, _, gid = self.config.user.partition(":")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            info.uid, info.gid = int(uid or 0), int(gid or uid or 0)
            tar.addfile(info, io.BytesIO(data))
        try:
            ok = self.client.api.put_archive(self.name, parent, buf.getvalue())
        except docker.errors.APIError as exc:
            if "no space left" in str(exc).lower():
                raise WorkspaceFull(f"disk: writing {path} ({len(data)} bytes) passes the "
                                    f"workspace quota of {self.limits.disk_bytes} bytes") from None
            raise SandboxError(f"put_archive of {path} failed: {exc}", retryable=True) from exc
        if not ok:
            raise SandboxError(f"put_archive of {path} failed", retryable=True)


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the engine's archive stream)."""

    def __init__(self, chunks) -> None:
        self._chunks = iter(chunks)
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._rest:
            try:
                self._rest = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._rest))
        buffer[:n] = self._rest[:n]
        self._rest = self._rest[n:]
        return n


def container_options(config: DockerConfig, name: str, workspace_options: str,
                      network: str | None = None) -> dict:
    """Keyword arguments of `containers.run` for one sandbox: what the engine is asked for.

    No `privileged`, every capability dropped, `no-new-privileges`, and no `seccomp=` option,
    so the engine applies its default seccomp profile (Docker's and podman's deny new
    namespaces, keyrings, bpf, mounts, modules... much as `seccomp.py` does for bubblewrap).
    `network=False` is `network_mode="none"` (only loopback); `network=True` is the bridge
    `network` (`docker_network.NETWORK`), whose egress filter the caller has installed."""
    from docker.types import Ulimit
    lim = config.limits
    if lim.network and not network:
        raise SandboxError("a networked container joins the filtered network "
                           "(docker_network.egress_network), never the engine's default bridge")
    return dict(
        image=config.image, command=config.init or REAPER_INIT, name=name, detach=True,
        user=config.user, working_dir=config.workdir, privileged=False,
        **({"network": network} if lim.network else {"network_mode": "none"}),
        mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes,
        pids_limit=lim.pids, nano_cpus=int(lim.cpu * 1e9),
        cap_drop=["ALL"], security_opt=["no-new-privileges"],
        ulimits=[Ulimit(name=k, soft=v, hard=v) for k, v in config.ulimits.items()],
        labels={LABEL_OWNER: config.owner}, hostname="sandbox",
        tmpfs={WORKSPACE: workspace_options},
        environment={"HOME": WORKSPACE, "LANG": "C.UTF-8"})


def _is_podman(client) -> bool:
    """Whether the engine behind `client` is podman (its Docker API differs in small ways);
    asked once per client."""
    known = getattr(client, "_kiln_is_podman", None)
    if known is None:
        try:
            components = client.version().get("Components") or []
        except Exception:  # noqa: BLE001 - an engine that cannot say is treated as Docker
            components = []
        known = any("podman" in str(c.get("Name", "")).lower() for c in components)
        client._kiln_is_podman = known
    return known


def reap_containers(client, owner: str) -> list[str]:
    """Remove every container of `owner` left by an earlier process; returns their names."""
    removed = []
    for c in client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={owner}"}):
        if c.name.startswith(f"{NAME_PREFIX}-{owner}-"):
            client.api.remove_container(c.id, force=True, v=True)
            removed.append(c.name)
    return removed
