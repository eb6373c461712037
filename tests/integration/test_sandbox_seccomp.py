"""The bubblewrap sandbox against the model's own code: the seccomp deny-list and
`--disable-userns`, probed from inside a real sandbox, and ordinary tool use still working."""
from __future__ import annotations

import asyncio
import os
import struct
import uuid

import pytest

from kiln.services.sandbox import seccomp
from kiln.services.sandbox.bubblewrap import BWRAP, SETPRIV
from kiln.services.sandbox.config import BubblewrapConfig, SandboxLimits
from kiln.services.sandbox.factory import leftovers, make_sandbox, reap_orphans
from kiln.services.sandbox.interface import SandboxError

needs_bwrap = pytest.mark.skipif(not (os.access(BWRAP, os.X_OK) and os.access(SETPRIV, os.X_OK)),
                                reason="bubblewrap and setpriv are not installed")

# Each line: a syscall by name (libc's syscall(), numbers resolved by libseccomp for this
# architecture), its arguments, and the errno it gives (0: it succeeded).
PROBE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = dict(a.split("=") for a in sys.argv[1].split(","))
buf = ctypes.create_string_buffer(256)
calls = {
    "io_uring_setup": (1, buf), "keyctl": (0, 0, 0, 0), "add_key": (b"user", b"k", b"v", 1, -2),
    "bpf": (0, buf, 64), "perf_event_open": (buf, 0, -1, -1, 0), "userfaultfd": (0,),
    "unshare_user": (0x10000000,), "clone_newuser": (0x10000000 | 17, 0, 0, 0, 0),
    "clone3": (buf, 88), "mount": (b"none", b"/tmp", b"tmpfs", 0, 0), "setns": (0, 0),
    "open_by_handle_at": (-100, buf, 0),
}
for name, args in calls.items():
    r = libc.syscall(int(nr[name]), *args)
    print(name, 0 if r >= 0 else ctypes.get_errno())
"""


def _nr(name: str) -> int:
    return seccomp._lib().seccomp_syscall_resolve_name(name.encode())


def _numbers() -> str:
    names = {"unshare_user": "unshare", "clone_newuser": "clone"}
    keys = ["io_uring_setup", "keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd",
            "unshare_user", "clone_newuser", "clone3", "mount", "setns", "open_by_handle_at"]
    return ",".join(f"{k}={_nr(names.get(k, k))}" for k in keys)


def _run(cmds: list[str], **config) -> list:
    cfg = BubblewrapConfig(owner=f"t{uuid.uuid4().hex[:8]}",
                           limits=SandboxLimits(memory_bytes="256m", timeout_seconds=60), **config)

    async def go():
        async with make_sandbox(cfg) as sb:
            await sb.write_file("probe.py", PROBE.encode())
            return [await sb.exec(c) for c in cmds]

    try:
        return asyncio.run(go())
    finally:
        reap_orphans(cfg)
        assert leftovers(cfg) == []


def test_program_checks_the_architecture_first():
    prog = seccomp.program()
    insns = [struct.unpack("HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    # ld [arch]; jeq AUDIT_ARCH_<native>: a syscall under another ABI takes the kill branch.
    assert insns[0] == (0x20, 0, 0, 4)
    assert insns[1][0] == 0x15 and insns[1][3] in (0xC000003E, 0xC00000B7)
    text = seccomp.describe()
    assert "invalid architecture action\naction KILL_PROCESS" in text
    for name in ("keyctl", "io_uring_setup", "bpf", "unshare", "mount", "kexec_load"):
        assert f'"{name}"' in text


@needs_bwrap
def test_syscalls_refused_inside_the_sandbox():
    status, unshare, probe = _run(["grep '^Seccomp:' /proc/self/status",
                                   "unshare -Urn true",
                                   f"python3 probe.py {_numbers()}"])
    assert status.stdout.split() == ["Seccomp:", "2"]
    assert unshare.exit_code != 0, unshare.stdout
    errnos = dict(line.split() for line in probe.stdout.splitlines())
    assert probe.exit_code == 0, probe.stderr
    assert errnos.pop("clone3") == "38"  # ENOSYS: libc falls back to clone, whose flags are seen
    assert errnos == {k: "1" for k in errnos}, errnos  # EPERM


@needs_bwrap
def test_disable_userns_holds_without_the_filter():
    """The second layer alone: the sandbox's user namespace is the last one."""
    (res,) = _run(["unshare -Ur true"], seccomp=False)
    assert res.exit_code != 0 and "No space left on device" in res.stderr, res.stderr


@needs_bwrap
def test_ordinary_tool_use_still_works():
    script = (
        "set -e\n"
        "printf 'def add(a, b):\\n    return a + b\\n' > calc.py\n"
        "printf 'from calc import add\\ndef test_add():\\n    assert add(2, 3) == 5\\n' > test_calc.py\n"
        "python3 -m pytest -q -p no:cacheprovider test_calc.py\n"
        "git init -q repo && cd repo && git config user.email a@b && git config user.name a\n"
        "echo x > f && git add f && git commit -qm first && git log --oneline | wc -l\n"
        "python3 -c 'import threading, subprocess, multiprocessing as mp;"
        " p = mp.Pool(2); print(sum(p.map(abs, [-1, -2]))); p.close(); p.join()'\n")
    (res,) = _run([script])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout and res.stdout.split()[-2:] == ["1", "3"]


# -- the docker backend ------------------------------------------------------------------------

def _host_config(bridge: str | None = None, **limits) -> dict:
    """The HostConfig the backend's `containers.run` call sends to the engine."""
    from docker.models.containers import _create_container_args

    from kiln.services.sandbox.config import DockerConfig
    from kiln.services.sandbox.docker_backend import container_options
    cfg = DockerConfig(owner="t", limits=SandboxLimits(**limits))
    args = _create_container_args({**container_options(cfg, "kiln-sbx-t-x", "rw,size=1m", bridge),
                                   "version": "1.41"})
    return args["host_config"]


def test_docker_container_is_unprivileged_under_the_default_profile():
    host = _host_config()
    assert host.get("Privileged") in (None, False)
    assert host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
    assert host["SecurityOpt"] == ["no-new-privileges"]  # no seccomp=/apparmor= override
    assert host["NetworkMode"] == "none"
    # A networked container joins the filtered network, never the engine's default bridge.
    from kiln.services.sandbox.docker_network import NETWORK
    assert _host_config(NETWORK, network=True)["NetworkMode"] == NETWORK
    with pytest.raises(SandboxError, match="filtered network"):
        _host_config(network=True)


def test_docker_container_filtered_for_real():
    """One real container through podman's Docker API: the runtime's default profile is on."""
    import shutil
    if not (shutil.which("podman") and shutil.which("runc")):
        pytest.skip("podman and runc are not installed (deploy/setup.sh installs them)")
    from kiln.services.sandbox.config import DockerConfig
    from kiln.services.sandbox.podman_service import PodmanService, build_host_image
    with PodmanService() as service:
        build_host_image()
        cfg = DockerConfig(owner=f"t{uuid.uuid4().hex[:8]}", base_url=service.base_url)

        async def go():
            async with make_sandbox(cfg) as sb:
                # podman 4.3 loses an exec's output now and then under load: ask again.
                for _ in range(3):
                    res = await sb.exec("grep '^Seccomp:' /proc/self/status; grep '^CapEff' "
                                        "/proc/self/status; unshare -Ur true && echo NESTED")
                    if res.stdout:
                        return res
                return res

        res = asyncio.run(go())
        assert leftovers(cfg) == []
    lines = res.stdout.split("\n")
    assert lines[0].split() == ["Seccomp:", "2"] and lines[1].split() == ["CapEff:",
                                                                         "0000000000000000"]
    assert "NESTED" not in res.stdout
