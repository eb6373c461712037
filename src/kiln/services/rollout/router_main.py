"""Entry point of the rollout fleet's router (`router.py`): one address for the OpenAI endpoint
of every rollout replica.

    python -m kiln.services.rollout.router_main --port 8000 \\
        (--replica http://10.0.0.5:8000 ... | --discover-dns rollout.ns.svc:8000 |
         --discover-files 'RUN_DIR/rollout*/openai.json')

Replicas come from fixed URLs, from the A records of a headless Service (a cluster: one per
ready rollout pod, looked up again before every health round), or from announcement files
(`kiln run`: each rollout worker writes `{"url": ...}` into its state folder once its endpoint
listens). API keys come from `KILN_OPENAI_API_KEYS`, as the replicas read theirs. Stops on
SIGTERM or SIGINT; `--ready-file` gets `{"port": N}` once it listens.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import logging
import signal
import socket
import sys
from pathlib import Path

import aiohttp

from kiln.files import write_json_whole
from kiln.logs import setup_logging
from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.router import Replica, Replicas, Router, serve

log = logging.getLogger("kiln.rollout.router")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kiln.services.rollout.router_main",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free one)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--replica", action="append", metavar="URL",
                     help="a replica's endpoint, e.g. http://127.0.0.1:8001 (repeatable)")
    how.add_argument("--discover-dns", metavar="HOST:PORT",
                     help="every address HOST resolves to (a headless Service), on PORT")
    how.add_argument("--discover-files", metavar="GLOB",
                     help="JSON files of {\"url\": ...}, one per replica")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between health checks of the replicas (default 1)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body forwarded (default 4 MiB)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: none)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="file to write {\"port\": N} to once the router listens")
    return p


def discovery(args: argparse.Namespace):
    """The `discover()` of `Replicas` that the arguments ask for."""
    if args.replica:
        fixed = {u.rstrip("/") for u in args.replica}

        async def static() -> set[str]:
            return fixed
        return static
    if args.discover_dns:
        host, _, port = args.discover_dns.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--discover-dns: expected HOST:PORT, got {args.discover_dns!r}")

        async def dns() -> set[str]:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, int(port), type=socket.SOCK_STREAM)
            except socket.gaierror:
                return set()  # no ready replica yet: the Service has no endpoints
            return {f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}"
                    for a in (info[4][0] for info in infos)}
        return dns
    pattern = args.discover_files

    async def files() -> set[str]:
        urls = set()
        for path in glob.glob(pattern):
            try:
                urls.add(str(json.loads(Path(path).read_text())["url"]).rstrip("/"))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not an announcement
        return urls
    return files


def _metrics():
    from kiln.services.common import metrics as M

    def count(*, refused: str = "", replica: str = "", placement: str = "", code: str = "") -> None:
        if refused:
            M.ROUTER_REFUSALS.labels(refused).inc()
        else:
            M.ROUTER_REQUESTS.labels(replica, placement, code).inc()

    shown: set[str] = set()

    def changed(replicas: list[Replica]) -> None:
        for state in ("serving", "draining", "down"):
            M.ROUTER_REPLICAS.labels(state).set(sum(r.state() == state for r in replicas))
        now = {r.instance: r.weight() for r in replicas if r.instance}
        for gone in shown - now.keys():  # a replica forgotten or restarted: no stale series
            M.ROUTER_REPLICA_LOAD.remove(gone)
        for instance, weight in now.items():
            M.ROUTER_REPLICA_LOAD.labels(instance).set(weight)
        shown.clear()
        shown.update(now)
    return count, changed


async def run(args: argparse.Namespace) -> int:
    keys = ApiKeys.from_env()
    discover = discovery(args)
    count, changed = _metrics()
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Unbounded pool: each in-flight call holds a connection (a generation can take minutes).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        replicas = Replicas(discover, session, interval=args.interval, on_change=changed)
        await replicas.refresh()
        watcher = asyncio.ensure_future(replicas.watch())
        runner, port = await serve(Router(replicas, keys, max_body_bytes=args.max_body_bytes,
                                          count=count), args.host, args.port)
        if args.ready_file is not None:
            write_json_whole(args.ready_file, {"port": port})
        try:
            await stop.wait()
        finally:
            watcher.cancel()
            await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        setup_logging("router")
        return asyncio.run(run(args))
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
