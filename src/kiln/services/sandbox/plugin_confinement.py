"""How a plugin worker (`plugin_host.py`) is started: confined, when the sandbox service is root.

When the service runs as root the worker is confined like a sandbox, less the workspace:

    bwrap (as root, so it can bind what root can read; capabilities cut to SETUID/SETGID)
          new PID, IPC, UTS, network and cgroup namespaces; a root file system holding only
          /usr, a few /etc files, the interpreter, the Python path and the task folders (all
          read-only) and a private /tmp; --die-with-parent, --new-session, --clearenv
      setpriv --reuid PLUGIN_UID --regid PLUGIN_GID, no groups, no capabilities,
              no_new_privs
        python -m kiln.services.sandbox.plugin_host   (seccomp deny-list, rlimits, then the
                                                       plugin is imported)

so plugin code runs as a uid of its own (not the sandboxes': a sandboxed command cannot
signal it), sees no secret (the TLS folder, the service's environment and /proc are not in
its view, and a key file it could see is root's 0600 anyway), cannot write outside its /tmp,
has no network, cannot see or signal the service (another PID namespace) and cannot get root
back. A service that is not root cannot change uid: its worker then runs as its own uid, still
a separate process under the seccomp filter and no_new_privs, without the namespaces.

Limits: the worker bounds its own address space (`sandbox.pluginMemory`, RLIMIT_AS), open
files, file size and, as its own uid, processes (`plugin_host.confine`); it shares the
service's cgroup, so the sandbox pod's limits hold all workers together.

Not covered: talking to the worker (`plugins.py`); a CPU limit of the worker's own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .interface import SandboxError

#: The identity plugin code runs as when the service is root: unprivileged, and distinct from
#: the sandboxes' (65534), so the model's commands and the author's plugin cannot reach each
#: other's processes.
PLUGIN_UID = 65533
PLUGIN_GID = 65533

BWRAP = "/usr/bin/bwrap"
SETPRIV = "/usr/bin/setpriv"
#: Host /etc entries the worker sees (dynamic linking, time zone, CA certificates).
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
             "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates", "/etc/alternatives")


def _readable_paths(extra: list[Path]) -> list[str]:
    """Folders the worker must read: the interpreter, the Python path, the task folders;
    without any path already inside another, outermost first."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *map(str, extra)}
    found.update(p for p in sys.path if p)
    paths = sorted({os.path.realpath(p) for p in found if os.path.exists(p)} - {"/"})
    kept: list[str] = []
    for p in paths:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def confined_argv(read_only: list[Path], memory_bytes: int | None = None) -> list[str]:
    """The command line of a plugin worker (see the module docstring)."""
    python = [sys.executable, "-m", "kiln.services.sandbox.plugin_host",
              *(["--memory-bytes", str(memory_bytes)] if memory_bytes else [])]
    if os.geteuid() != 0:
        return python
    for tool in (BWRAP, SETPRIV):
        if not os.access(tool, os.X_OK):
            raise SandboxError(f"{tool} not found: plugins run confined by bubblewrap and "
                               "setpriv when the sandbox service is root (install bubblewrap "
                               "and util-linux)")
    args = [BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
            "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/sbin", "/sbin"]
    for path in ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    made = {"/", "/usr", "/tmp", "/etc", "/proc", "/dev"}
    for path in _readable_paths(read_only):
        if path == "/usr" or path.startswith("/usr/"):
            continue
        # bwrap makes missing parents root-only; the worker's uid must pass through them.
        parents = Path(path).parents
        for parent in reversed([str(p) for p in parents]):
            if parent not in made:
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", path, path]
        made.add(path)
    pythonpath = ":".join(p for p in sys.path if p)
    args += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PYTHONPATH", pythonpath, "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
             "--chdir", "/tmp", "--",
             SETPRIV, f"--reuid={PLUGIN_UID}", f"--regid={PLUGIN_GID}", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return args + python
