"""The local sandbox backend: bubblewrap namespaces, cgroup limits, an unprivileged uid.

Each sandbox is a host workspace folder with a filesystem of the disk quota's size mounted on
it (`quota.py`: a loop-mounted ext4 image, or a tmpfs) plus a cgroup (memory, pids, CPU limits; `cgroup.kill`).
Each `exec` starts a fresh `bwrap` in that cgroup:

    sh (writes its pid into the cgroups, then execs)
      setpriv --reuid U --no-new-privs, no capabilities, no bounding set
        bwrap --unshare-all (user, pid, net, ipc, uts, cgroup, mount), --disable-userns,
              --seccomp FD, --die-with-parent, --new-session, --clearenv, read-only /usr and
              a few /etc files, /workspace read-write, fresh /proc, /dev, /tmp
          /bin/sh -c CMD

Privileges are dropped before bwrap runs, so bwrap works in an unprivileged user namespace and
nothing inside maps to host root. With `network=False` the sandbox has only its own loopback:
the host's 127.0.0.1 is unreachable. With `network=True` it shares the service's network
namespace under an egress filter on its cgroup (`egress.py`): this host's own addresses,
link-local ones (cloud metadata) and Kiln's ports anywhere are refused. The command runs
under a seccomp deny-list (`seccomp.py`:
no new namespaces, io_uring, keyrings, bpf, perf, mounts, modules...), and `--disable-userns`
makes the sandbox's user namespace the last one: a nested `unshare -U` fails even where the
filter would not see it. When the command returns, the PID namespace dies with it;
on timeout the cgroup is killed, which takes detached and double-forked processes too.

Not covered: persistence of processes between execs (each exec is its own process tree; state
lives in the workspace), and kernel-level attack surface (bubblewrap shares the host kernel;
the filter narrows it but a bug in an allowed syscall is still a host kernel bug). Other
destinations of a networked sandbox (the internet, cluster services on other ports) are the
pod's NetworkPolicy's to limit.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import time
import uuid

from .cgroups import Cgroup
from .egress import EgressPolicy
from .config import NAME_PREFIX, BubblewrapConfig
from .interface import (EXIT_OOM, EXIT_TIMEOUT, WORKSPACE, ExecResult, Sandbox, SandboxError,
                        WorkspaceFull)
from .output import CappedBuffer, drain
from .quota import check_tools, mount_workspace, unmount_workspace
from .seccomp import program, program_fd
from .workspace_fs import read_beneath, write_beneath

BWRAP = "/usr/bin/bwrap"
SETPRIV = "/usr/bin/setpriv"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def check_host(workspace_fs: str = "ext4") -> None:
    """Raise SandboxError naming what is missing for this backend (not retryable)."""
    for tool in (BWRAP, SETPRIV, "/bin/sh"):
        if not os.access(tool, os.X_OK):
            raise SandboxError(f"{tool} not found: install bubblewrap and util-linux")
    check_tools(workspace_fs)
    program()  # SandboxError when libseccomp is missing


class BubblewrapSandbox(Sandbox):
    def __init__(self, config: BubblewrapConfig, name: str | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.name = name or f"{NAME_PREFIX}-{config.owner}-{uuid.uuid4().hex[:12]}"
        self.dir = config.state_dir / self.name
        self.workspace = self.dir / "workspace"
        self.cgroup = Cgroup(config.cgroup_root, self.name)
        self.egress = (EgressPolicy(f"/{self.name}", tuple(config.egress_ports))
                       if self.limits.network else None)
        self._started = False
        self._destroyed = False

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        self.dir.mkdir(mode=0o711)
        try:
            self.workspace.mkdir(mode=0o755)
            mount_workspace(self.workspace, self.limits.disk_bytes, cfg.uid, cfg.gid,
                            cfg.workspace_fs)
            (self.dir / "passwd").write_text(
                f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                f"sandbox:x:{cfg.uid}:{cfg.gid}:sandbox:{WORKSPACE}:/bin/sh\n")
            (self.dir / "group").write_text(f"root:x:0:\nsandbox:x:{cfg.gid}:\n")
            self.cgroup.create(self.limits.memory_bytes, self.limits.pids, self.limits.cpu)
            if self.egress is not None:
                # Before any command runs: a networked sandbox never exists unfiltered.
                try:
                    self.egress.install()  # removes what it added when it fails
                except BaseException:
                    self.cgroup.remove()
                    raise
        except BaseException:
            unmount_workspace(self.workspace)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self._started = True

    async def destroy(self) -> None:
        if self._destroyed or not self._started:
            self._destroyed = True
            return  # start() removes what it made when it fails
        self._destroyed = True
        await asyncio.to_thread(self._teardown)

    def _teardown(self) -> None:
        self.cgroup.remove()  # first: nothing may still write into the workspace
        if self.egress is not None:
            self.egress.remove()
        unmount_workspace(self.workspace)
        shutil.rmtree(self.dir)

    # -- commands -------------------------------------------------------------------------
    def _bwrap_args(self, workdir: str, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
        cfg = self.config
        # --disable-userns needs the user namespace asked for explicitly (--unshare-all only
        # tries one).
        args = [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--clearenv", "--hostname", "sandbox"]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        if self.limits.network:
            args.append("--share-net")
        if cfg.rootfs is not None:
            args += ["--ro-bind", str(cfg.rootfs), "/"]
        else:
            args += ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                     "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                     "--symlink", "usr/sbin", "/sbin"]
            etc = list(cfg.etc_files)
            if self.limits.network:
                etc += ["/etc/resolv.conf", "/etc/hosts"]
            for path in etc:
                if os.path.exists(path):
                    args += ["--ro-bind", path, path]
            args += ["--ro-bind", str(self.dir / "passwd"), "/etc/passwd",
                     "--ro-bind", str(self.dir / "group"), "/etc/group"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                 "--bind", str(self.workspace), WORKSPACE, "--chdir", workdir]
        base_env = {"PATH": SANDBOX_PATH, "HOME": WORKSPACE, "LANG": "C.UTF-8",
                    "TMPDIR": "/tmp", "USER": "sandbox"}
        for key, value in {**base_env, **env}.items():
            args += ["--setenv", key, value]
        return args

    def _argv(self, cmd: str | list[str], workdir: str, env: dict[str, str],
              seccomp_fd: int | None = None) -> list[str]:
        procs = [str(p) for p in self.cgroup.procs_files()]
        # The launcher joins the cgroups itself before exec'ing, so no child can be forked
        # outside them (writing the pid after spawn would race with the first fork).
        join = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(procs)))
        launcher = ["/bin/sh", "-c", f'{join} && shift {len(procs)} && exec "$@"', "kiln-launch",
                    *procs]
        cfg = self.config
        drop = [SETPRIV, f"--reuid={cfg.uid}", f"--regid={cfg.gid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        inner = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return [*launcher, *drop, *self._bwrap_args(workdir, env, seccomp_fd), "--", *inner]

    async def exec(self, cmd, *, timeout=None, workdir=None, env=None, stdin=None) -> ExecResult:
        if not self._started or self._destroyed:
            raise SandboxError(f"sandbox {self.name} is not running")
        timeout = self.limits.timeout_seconds if timeout is None else timeout
        workdir = workdir or WORKSPACE
        if not workdir.startswith("/"):
            workdir = f"{WORKSPACE}/{workdir}"
        # One pipe per bwrap: it reads the program to EOF, and the sh and setpriv in
        # between keep the descriptor open for it.
        seccomp_fd = program_fd() if self.config.seccomp else None
        argv = self._argv(cmd, workdir, env or {}, seccomp_fd)
        oom_before = self.cgroup.oom_kills()
        out, err = CappedBuffer(self.limits.output_limit_bytes), \
            CappedBuffer(self.limits.output_limit_bytes)
        t0 = time.monotonic()
        # Spawning is shielded: a cancelled spawn would leave a process we hold no handle to.
        # An empty environment from the first process on: bwrap is PID 1 inside the sandbox,
        # and /proc/1/environ would otherwise show the service's (addresses, secrets).
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env={"PATH": "/usr/bin:/bin"},
            pass_fds=() if seccomp_fd is None else (seccomp_fd,)))
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            await asyncio.wait([spawn])
            if not spawn.cancelled() and spawn.exception() is None:
                await self._kill_and_reap(spawn.result())
            raise
        finally:
            if seccomp_fd is not None and spawn.done():
                os.close(seccomp_fd)
        readers = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
        feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            readers.cancel()
            await self._kill_and_reap(proc)
            await asyncio.gather(readers, return_exceptions=True)  # collected, not left to log
            raise
        # Either way nothing may outlive the exec: after a timeout this is what stops the
        # command; after a normal exit it catches anything that slipped out of the PID
        # namespace's teardown.
        if timed_out or self.cgroup.pids():
            await asyncio.to_thread(self.cgroup.kill)
        await proc.wait()
        await readers
        if feeder is not None:
            await feeder
        duration = time.monotonic() - t0
        oom = self.cgroup.oom_kills() > oom_before
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if timed_out:
            code = EXIT_TIMEOUT
        elif oom:
            code = EXIT_OOM
        return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text(), timed_out=timed_out,
                          oom_killed=oom and not timed_out, truncated=out.truncated or err.truncated,
                          duration_s=duration)

    async def _kill_and_reap(self, proc: asyncio.subprocess.Process) -> None:
        # The launcher joins the cgroup itself, a moment after it is spawned: a cancel in that
        # moment finds the cgroup empty, and the command would then run to its end. The
        # launcher leads its own session, so its process group reaches it before it joins;
        # everything it starts after joining is in the cgroup.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(self.cgroup.kill)
        await proc.wait()

    # -- files ----------------------------------------------------------------------------
    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await asyncio.to_thread(read_beneath, self.workspace, path, max_bytes)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        try:
            await asyncio.to_thread(write_beneath, self.workspace, path, data, mode,
                                    self.config.uid, self.config.gid)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise WorkspaceFull(f"disk: writing {path} ({len(data)} bytes) passes the "
                                    f"workspace quota of {self.limits.disk_bytes} bytes") from None
            raise


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its input; that is its business
    finally:
        proc.stdin.close()
