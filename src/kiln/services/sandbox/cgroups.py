"""Per-sandbox cgroups on a hybrid hierarchy: limits in v1, kill in v2.

On these hosts memory, pids and cpu are cgroup v1 controllers (`/sys/fs/cgroup/{memory,pids,
cpu}`) while the v2 tree at `/sys/fs/cgroup/unified` has no controllers but offers
`cgroup.kill`, which kills every process in the group atomically, including ones that
double-forked, called setsid or were reparented. A sandbox's group has the same name in all
four trees. On a pure v2 host (`/sys/fs/cgroup/cgroup.controllers` exists) the limits and the
kill are all in one tree.

Not covered: putting a process into the group (the launcher writes its own pid into
`procs_files()` before it execs, so nothing escapes between fork and placement).
"""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

V1_CONTROLLERS = ("memory", "pids", "cpu")


class Cgroup:
    """One sandbox's cgroup(s); `create()` makes them with limits, `remove()` kills and
    deletes."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.pure_v2 = (root / "cgroup.controllers").exists() and not (root / "memory").is_dir()
        if self.pure_v2:
            self.kill_dir = root / name
            self.dirs = {"unified": self.kill_dir}
        else:
            self.kill_dir = root / "unified" / name
            self.dirs = {c: root / c / name for c in V1_CONTROLLERS}
            self.dirs["unified"] = self.kill_dir

    # -- life cycle -----------------------------------------------------------------------
    def create(self, memory_bytes: int, pids: int, cpu: float) -> None:
        try:
            for path in self.dirs.values():
                path.mkdir(exist_ok=False)
        except FileExistsError as exc:
            raise RuntimeError(f"cgroup {self.name} already exists (name clash)") from exc
        except PermissionError as exc:
            raise RuntimeError(
                f"cannot create cgroup under {self.root}: the sandbox service needs root "
                "(or a delegated cgroup) to enforce limits"
            ) from exc
        period = 100_000
        quota = max(1000, int(cpu * period))
        if self.pure_v2:
            d = self.kill_dir
            _write(d / "memory.max", str(memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(pids))
            _write(d / "cpu.max", f"{quota} {period}")
            return
        mem = self.dirs["memory"]
        _write(mem / "memory.limit_in_bytes", str(memory_bytes))
        # Without a swap limit the tree could swap instead of being OOM-killed.
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(self.dirs["pids"] / "pids.max", str(pids))
        _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(period))
        _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this group so far."""
        if self.pure_v2:
            text = _read(self.kill_dir / "memory.events")
        else:
            text = _read(self.dirs["memory"] / "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        try:
            text = _read(self.kill_dir / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def kill(self, wait_s: float = 5.0) -> None:
        """Kill every process in the group and wait until the group is empty."""
        if not self.kill_dir.exists():
            return
        _write(self.kill_dir / "cgroup.kill", "1")
        deadline = time.monotonic() + wait_s
        while self.pids():
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup {self.name}: processes survive cgroup.kill")
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill()
        for path in self.dirs.values():
            _rmdir(path)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _rmdir(path: Path) -> None:
    # A group whose last process just died can report EBUSY for a moment.
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.005)
    raise RuntimeError(f"cannot remove cgroup {path}: still busy")


def list_groups(root: Path, prefix: str) -> list[str]:
    """Names of existing groups starting with `prefix`, across every tree used."""
    trees = [root] if (root / "cgroup.controllers").exists() and not (root / "memory").is_dir() \
        else [root / c for c in (*V1_CONTROLLERS, "unified")]
    names: set[str] = set()
    for tree in trees:
        try:
            names.update(e.name for e in os.scandir(tree) if e.is_dir() and e.name.startswith(prefix))
        except FileNotFoundError:
            continue
    return sorted(names)
