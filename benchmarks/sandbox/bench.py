"""Sandbox start latency and throughput, per backend, side by side.

    python benchmarks/sandbox/bench.py [--backends bubblewrap,bubblewrap-tmpfs,docker]
                                       [--starts 40] [--concurrent 64] [--docker-starts 20]
                                       [--seccomp on|off|both]

Start latency: a fresh sandbox created and its first command (`true`) finished, one at a time;
p50 and p99 over `--starts` runs (`--docker-starts` for docker). Throughput: `--concurrent`
sandboxes each running `sleep 1` at once (create, run, destroy), wall time for all of them.
The docker backend runs against a private podman service started here (or DOCKER_HOST).
`bubblewrap` makes each workspace a loop-mounted ext4 image (the disk quota), `bubblewrap-tmpfs`
a tmpfs: side by side, what the disk-backed quota costs a start. `--seccomp both` runs each
bubblewrap backend with the syscall filter (`+seccomp`) and without it (`-seccomp`), in
alternating rounds of the same run, so both see the same load.

Targets: bubblewrap p50 <= 50 ms, docker (podman) p50 <= 600 ms, 64 concurrent `sleep 1`
bubblewrap sandboxes in under 3 s.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def start_latency(config, n: int) -> tuple[list[float], list[float]]:
    from kiln.services.sandbox.factory import make_sandbox
    ready, first = [], []
    for _ in range(n):
        sb = make_sandbox(config)
        t0 = time.perf_counter()
        await sb.start()
        t1 = time.perf_counter()
        res = await sb.exec("true")
        t2 = time.perf_counter()
        await sb.destroy()
        assert res.exit_code == 0, res
        ready.append(t1 - t0)
        first.append(t2 - t0)
    return ready, first


async def concurrent_sleep(config, n: int) -> float:
    from kiln.services.sandbox.factory import make_sandbox

    async def one():
        async with make_sandbox(config) as sb:
            res = await sb.exec("sleep 1")
            assert res.exit_code == 0, res

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0


def _alternating(backend: str, owner: str, limits, starts: int) -> list[tuple]:
    """Rows for `backend` with and without the syscall filter, measured in alternating
    rounds of 5 starts (no throughput test: it would not alternate)."""
    from kiln.services.sandbox.config import BubblewrapConfig
    from kiln.services.sandbox.factory import leftovers, reap_orphans
    fs = "tmpfs" if backend.endswith("tmpfs") else "ext4"
    configs = {on: BubblewrapConfig(owner=owner, limits=limits, workspace_fs=fs, seccomp=on)
               for on in (True, False)}
    got = {on: ([], []) for on in configs}
    try:
        for config in configs.values():
            asyncio.run(start_latency(config, 2))
        for i in range(0, starts, 5):
            for on, config in configs.items():
                ready, first = asyncio.run(start_latency(config, min(5, starts - i)))
                got[on][0].extend(ready)
                got[on][1].extend(first)
        left = leftovers(configs[True])
    finally:
        reap_orphans(configs[True])
    return [(f"{backend}{'+' if on else '-'}seccomp", starts, ready, first, float("nan"), left)
            for on, (ready, first) in got.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="bubblewrap,bubblewrap-tmpfs,docker")
    p.add_argument("--starts", type=int, default=40)
    p.add_argument("--docker-starts", type=int, default=20)
    p.add_argument("--concurrent", type=int, default=64, help="0 skips the throughput test")
    p.add_argument("--seccomp", choices=("on", "off", "both"), default="on",
                   help="bubblewrap with the syscall filter, without it, or both side by side")
    args = p.parse_args(argv)

    from kiln.services.sandbox.config import (BubblewrapConfig, DockerConfig, SandboxLimits)
    from kiln.services.sandbox.factory import leftovers, reap_orphans
    rows = []
    filters = {"on": [True], "off": [False], "both": [True, False]}[args.seccomp]
    for backend in args.backends.split(","):
        owner = f"bench-{uuid.uuid4().hex[:6]}"
        limits = SandboxLimits(memory_bytes="256m", pids=64, timeout_seconds=30)
        if backend in ("bubblewrap", "bubblewrap-tmpfs") and len(filters) == 2:
            rows += _alternating(backend, owner, limits, args.starts)
            continue
        if backend in ("bubblewrap", "bubblewrap-tmpfs"):
            fs = "tmpfs" if backend.endswith("tmpfs") else "ext4"
            config, engine, n = BubblewrapConfig(owner=owner, limits=limits, workspace_fs=fs,
                                                 seccomp=filters[0]), \
                contextlib.nullcontext(None), args.starts
        elif backend == "docker":
            from kiln.services.sandbox.podman_service import LocalEngine
            config = DockerConfig(owner=owner, limits=limits)
            engine, n = LocalEngine(config), args.docker_starts
        else:
            raise ValueError(f"--backends: unknown backend {backend!r}")
        with engine as engined:
            config = engined or config
            try:
                asyncio.run(start_latency(config, 2))  # warm caches (image layers, page cache)
                ready, first = asyncio.run(start_latency(config, n))
                wall = (asyncio.run(concurrent_sleep(config, args.concurrent))
                        if args.concurrent else float("nan"))
                left = leftovers(config)
            finally:
                reap_orphans(config)
        rows.append((backend, n, ready, first, wall, left))

    print(f"{'backend':<17} {'n':>3} {'create p50':>11} {'create p99':>11} "
          f"{'1st-cmd p50':>12} {'1st-cmd p99':>12} {f'{args.concurrent}x sleep 1':>14} "
          f"{'left':>5}")
    for backend, n, ready, first, wall, left in rows:
        print(f"{backend:<17} {n:>3} {pct(ready, .5)*1e3:>9.1f}ms {pct(ready, .99)*1e3:>9.1f}ms "
              f"{pct(first, .5)*1e3:>10.1f}ms {pct(first, .99)*1e3:>10.1f}ms "
              f"{wall:>13.2f}s {len(left):>5}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"(host: {os.cpu_count()} cores, load average {load}; mean 1st-cmd: " + ", ".join(
        f"{b} {statistics.mean(f)*1e3:.1f}ms" for b, _, _, f, _, _ in rows) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
