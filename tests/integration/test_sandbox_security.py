"""Isolation and clean-up of both sandbox backends, run for real (bubblewrap + cgroups, and
containers through podman's Docker API socket started by the project's own helper)."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kiln.services.sandbox.config import BubblewrapConfig, DockerConfig, SandboxLimits
from kiln.services.sandbox.factory import leftovers, make_sandbox, reap_orphans
from kiln.services.sandbox.interface import PathEscapeError

# Each container test takes a few seconds (container start, engine round trips): slow.
BACKENDS = ["bubblewrap", pytest.param("docker", marks=pytest.mark.slow)]


def _host_has(tool: str) -> bool:
    return shutil.which(tool) is not None


@pytest.fixture(scope="module")
def engine():
    """A private podman Docker-API service and the image built from the host's /usr."""
    if not (_host_has("podman") and _host_has("runc")):
        pytest.skip("podman and runc are not installed (deploy/setup.sh installs them)")
    from kiln.services.sandbox.podman_service import PodmanService, build_host_image
    with PodmanService() as service:
        build_host_image()
        yield service


@pytest.fixture(params=BACKENDS)
def make_config(request):
    owner = f"t{uuid.uuid4().hex[:8]}"

    def make(**limits):
        lim = SandboxLimits(**{"memory_bytes": "128m", "pids": 64, "timeout_seconds": 10,
                               **limits})
        if request.param == "bubblewrap":
            return BubblewrapConfig(owner=owner, limits=lim)
        service = request.getfixturevalue("engine")
        return DockerConfig(owner=owner, limits=lim, base_url=service.base_url)

    make.backend = request.param
    yield make
    cfg = make()
    reap_orphans(cfg)
    assert leftovers(cfg) == []


def test_docker_backend_smoke(engine):
    """The one container test outside `slow`: start, exec, files, exit codes, clean-up."""
    cfg = DockerConfig(owner=f"t{uuid.uuid4().hex[:8]}", base_url=engine.base_url)

    async def go():
        async with make_sandbox(cfg) as sb:
            await sb.write_file("in.txt", b"41")
            r = await sb.exec("echo $(( $(cat in.txt) + 1 )) > out.txt; id -u; exit 7")
            return r, await sb.read_file("out.txt")

    res, out = run(go())
    assert res.exit_code == 7 and res.stdout.strip() == "65534" and out == b"42\n"
    assert leftovers(cfg) == []


def run(coro):
    return asyncio.run(coro)


async def _one(config, cmd, **kw):
    async with make_sandbox(config) as sb:
        return await sb.exec(cmd, **kw)


def _host_procs_with(token: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                continue
    return found


def test_host_loopback_listener_unreachable(make_config):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), "
             f"timeout=2); print('CONNECTED')\"")
    try:
        res = run(_one(make_config(), probe))
        assert "CONNECTED" not in res.stdout and res.exit_code != 0
        if make_config.backend == "bubblewrap":
            # With the network shared the egress filter refuses this host's own addresses
            # (test_sandbox_egress.py has the positive control: outside addresses connect).
            res = run(_one(make_config(network=True), probe))
            assert "CONNECTED" not in res.stdout and "ConnectionRefusedError" in res.stderr, \
                res.stderr
    finally:
        srv.close()


def test_host_files_invisible(make_config, tmp_path):
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    probes = [str(secret), "/etc/shadow", "/root/.bashrc", os.path.abspath(__file__),
              "/var/lib", "/home"]
    assert all(os.path.exists(p) for p in probes[:2])  # they do exist on the host
    script = "for p in " + " ".join(probes) + "; do test -e $p && echo VISIBLE:$p; done; echo END"
    res = run(_one(make_config(), script))
    assert res.stdout == "END\n", res.stdout


def test_host_processes_invisible(make_config):
    token = f"{uuid.uuid4().int % 10**6 + 10**6}"
    host = subprocess.Popen(["sleep", token])
    try:
        res = run(_one(make_config(), "ps -eo pid,args; ls /proc | grep -c '^[0-9]'"))
        assert token not in res.stdout
        assert res.exit_code == 0
        nprocs = int(res.stdout.strip().splitlines()[-1])
        assert nprocs < 10, res.stdout
    finally:
        host.kill()
        host.wait()


@pytest.mark.slow
def test_fork_bomb_held_by_pids_limit(make_config):
    cfg = make_config(pids=32, timeout_seconds=4)
    stop = threading.Event()
    worst = [0.0]

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            subprocess.run(["true"])
            worst[0] = max(worst[0], time.monotonic() - t0)
            time.sleep(0.1)

    async def go():
        async with make_sandbox(cfg) as sb:
            await sb.write_file("keep.txt", b"kept")
            bomb = await sb.exec("bash -c 'f(){ f | f & }; f; sleep 30'")
            # The sandbox is usable again and its workspace intact.
            after = await sb.exec("cat keep.txt")
            return bomb, after

    t = threading.Thread(target=probe)
    t.start()
    try:
        res, after = run(go())
    finally:
        stop.set()
        t.join()
    assert res.timed_out and res.exit_code == 124
    if "the workspace was reset" in res.stderr:
        # docker, when even `kill` could not start: the container was restarted, and its
        # workspace is a tmpfs (the disk quota). The sandbox works again, empty.
        assert after.exit_code == 1 and "keep.txt" in after.stderr
    else:
        assert after.exit_code == 0 and after.stdout == "kept"
    assert worst[0] < 2.0, f"host stalled {worst[0]:.2f} s during the fork bomb"


def test_memory_hog_is_oom_killed(make_config):
    res = run(_one(make_config(memory_bytes="64m"),
                   "python3 -c 'b = bytearray(300 << 20); print(len(b))'"))
    assert res.oom_killed and res.exit_code == 137 and not res.timed_out
    ok = run(_one(make_config(memory_bytes="64m"), "python3 -c 'b = bytearray(8 << 20)'"))
    assert ok.exit_code == 0 and not ok.oom_killed


def test_detached_tree_killed_on_timeout(make_config):
    token = f"{uuid.uuid4().int % 10**6 + 2 * 10**6}"
    cmd = (f"setsid sleep {token} & (nohup sleep {token} >/dev/null 2>&1 &) ; "
           f"sh -c 'sh -c \"sleep {token} &\" &' ; sleep {token}")

    async def go(cfg):
        async with make_sandbox(cfg) as sb:
            res = await sb.exec(cmd, timeout=1.5)
            after = await sb.exec("ps -eo args")
            return res, after

    res, after = run(go(make_config()))
    assert res.timed_out and res.exit_code == 124
    assert token not in after.stdout
    deadline = time.monotonic() + 60
    while _host_procs_with(f"sleep\x00{token}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _host_procs_with(f"sleep\x00{token}") == []


def test_output_flood_truncated(make_config):
    cfg = make_config(output_limit_bytes=10_000)
    res = run(_one(cfg, "head -c 20000000 /dev/zero | tr '\\0' x; echo done >&2"))
    assert res.truncated and res.exit_code == 0
    assert len(res.stdout) < 10_200
    assert "output truncated, 19990000 more bytes dropped" in res.stdout
    assert res.stderr.strip() == "done"


def test_file_api_rejects_traversal_and_symlinks(make_config):
    async def go(cfg):
        async with make_sandbox(cfg) as sb:
            await sb.write_file("dir/ok.txt", b"fine")
            assert await sb.read_file("/workspace/dir/ok.txt") == b"fine"
            r = await sb.exec("ln -s /etc/passwd link && ln -s / rootlink && cat dir/ok.txt")
            assert r.stdout == "fine"
            for path in ("../etc/passwd", "/etc/passwd", "/workspace/../etc/passwd", "link",
                         "rootlink/etc/passwd"):
                with pytest.raises(PathEscapeError):
                    await sb.read_file(path)
            for path in ("link", "rootlink/tmp/x", "../x"):
                with pytest.raises(PathEscapeError):
                    await sb.write_file(path, b"x")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")

    run(go(make_config()))


@pytest.mark.slow
def test_many_sandboxes_leave_nothing_behind(make_config):
    # 200 with bubblewrap (a few seconds); 100 containers with podman (about 0.45 s each).
    count = 200 if make_config.backend == "bubblewrap" else 100
    cfg = make_config()
    width = 16 if make_config.backend == "bubblewrap" else 8
    lost: list[int] = []

    async def one(i, sem):
        async with sem:
            async with make_sandbox(cfg) as sb:
                await sb.write_file("n.txt", str(i).encode())
                r = await sb.exec("cat n.txt; sleep 0.05 & setsid sleep 60 &")
                if r.stdout == "" and r.exit_code == 0 and make_config.backend == "docker":
                    lost.append(i)
                else:
                    assert r.stdout == str(i), r

    async def go():
        sem = asyncio.Semaphore(width)
        await asyncio.gather(*(one(i, sem) for i in range(count)))

    run(go())
    assert leftovers(cfg) == []
    # Known podman 4.3 behaviour under concurrent load: now and then an exec's attach stream
    # delivers no output although the command printed it (seen about once in 200). Tolerated
    # here up to 2 so the leftovers check stays reliable; any more is a failure.
    assert len(lost) <= 2, f"{len(lost)} of {count} docker execs lost their output: {lost}"
    if make_config.backend == "bubblewrap":
        assert not any(p.name.startswith(f"kiln-sbx-{cfg.owner}")
                       for p in cfg.state_dir.iterdir())


def test_cancelled_starts_and_execs_leave_nothing(make_config):
    cfg = make_config()

    async def one():
        async with make_sandbox(cfg) as sb:
            await sb.exec("sleep 600")

    async def go():
        tasks = [asyncio.ensure_future(one()) for _ in range(4)]
        await asyncio.sleep(0.05)   # some are starting, some may already run `sleep`
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        later = [asyncio.ensure_future(one()) for _ in range(2)]
        await asyncio.sleep(1.5)    # these are probably inside `sleep 600`
        for t in later:
            t.cancel()
        await asyncio.gather(*later, return_exceptions=True)

    t0 = time.monotonic()
    run(go())
    # Cancelling must stop the commands, not wait for `sleep 600` to end. The bound is far
    # from both (a loaded 2-core machine has taken 30 s for the starts and stops alone).
    assert time.monotonic() - t0 < 180
    assert leftovers(cfg) == []


def _host_usage(path) -> int:
    """Bytes the host filesystem holds for everything under `path` (blocks, not sizes; a
    filesystem mounted below is counted by what its backing file takes, not walked)."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(root, d))]
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def test_workspace_write_past_quota_fails_inside(make_config):
    """A command writing 3x its disk quota gets ENOSPC inside; the host keeps at most the quota
    per sandbox; deleting frees the room again; nothing is left mounted after."""
    _quota_checks(make_config(disk_bytes="8m"), make_config.backend)


def test_tmpfs_workspace_quota():
    owner = f"t{uuid.uuid4().hex[:8]}"
    cfg = BubblewrapConfig(owner=owner, workspace_fs="tmpfs",
                           limits=SandboxLimits(memory_bytes="128m", disk_bytes="8m"))
    _quota_checks(cfg, "bubblewrap")
    assert leftovers(cfg) == []


def _quota_checks(cfg, backend: str) -> None:
    from kiln.services.sandbox.interface import WorkspaceFull

    async def go():
        async with make_sandbox(cfg) as sb:
            r = await sb.exec("dd if=/dev/urandom of=big bs=1M count=24 2>&1; echo rc=$?; "
                              "df -k . | tail -1")
            host = _host_usage(sb.dir) if backend == "bubblewrap" else None
            with pytest.raises(WorkspaceFull, match="disk: .*8388608 bytes"):
                await sb.write_file("more.bin", b"x" * (4 << 20))
            again = await sb.exec("rm -f big more.bin && dd if=/dev/zero of=small bs=1M count=2 "
                                  "2>/dev/null && echo ok")
            return r, host, again, sb

    r, host, again, sb = run(go())
    assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
    assert again.stdout.strip() == "ok"
    if host is not None:
        # The filesystem's own metadata comes on top of the data, never 24 MiB of it.
        assert host <= (8 << 20) + (1 << 20), host
        assert not os.path.ismount(sb.workspace) and not sb.dir.exists()
        with open("/proc/mounts") as f:
            assert str(sb.workspace) not in f.read()


def test_reaper_unmounts_a_killed_service_workspaces():
    """A service killed with sandboxes alive leaves mounted workspaces; the next one's reaper
    unmounts them (and frees their loop devices) before removing the folders."""
    owner = f"t{uuid.uuid4().hex[:8]}"
    cfg = BubblewrapConfig(owner=owner, limits=SandboxLimits(disk_bytes="4m"))
    script = (
        "import asyncio, os, sys\n"
        "from kiln.services.sandbox.config import BubblewrapConfig, SandboxLimits\n"
        "from kiln.services.sandbox.factory import make_sandbox\n"
        f"cfg = BubblewrapConfig(owner={owner!r}, limits=SandboxLimits(disk_bytes='4m'))\n"
        "async def main():\n"
        "    sb = make_sandbox(cfg)\n"
        "    await sb.start()\n"
        "    await sb.write_file('x', b'1')\n"
        "    print(sb.workspace, flush=True)\n"
        "    os._exit(0)\n"
        "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    workspace = out.stdout.strip()
    assert os.path.ismount(workspace)
    removed = reap_orphans(cfg)
    assert any(owner in name for name in removed)
    assert not os.path.exists(workspace) and leftovers(cfg) == []
