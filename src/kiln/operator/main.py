"""`kiln-operator`: run the Kiln operator (kopf) with its handlers, a liveness endpoint and metrics.

    kiln-operator --all-namespaces
    kiln-operator --namespace team-a --namespace team-b --liveness http://0.0.0.0:8080/healthz

Settings other than these flags come from `KILN_OPERATOR_*` variables (`kiln.operator.config`);
logs are JSON lines unless `KILN_LOG_FORMAT=text` (`kiln.logs`).

Not covered: the handlers themselves (`kiln.operator.handlers`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import kopf
from prometheus_client import start_http_server


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln-operator", description="Kiln RLJob operator")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--namespace", action="append", dest="namespaces",
                       help="watch RLJobs in this namespace (repeatable; globs allowed)")
    where.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch RLJobs in every namespace")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="liveness endpoint URL kopf serves (empty: none)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics port (0: do not serve)")
    p.add_argument("-v", "--verbose", action="store_true", help="log handler details")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="0.0.0.0")
    # Importing the module registers its handlers with kopf's default registry.
    from kiln.operator import handlers  # noqa: F401

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    if (os.environ.get("KILN_LOG_FORMAT") or "json") == "json":
        # One format for every Kiln process: kopf's records (and the object each is about)
        # through Kiln's JSON handler, in place of the one kopf just installed; kopf's events
        # poster is a handler of its own and stays.
        from kiln.logs import setup_logging

        setup_logging("operator", "DEBUG" if args.verbose else None, relay=True)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=tuple(args.namespaces or ()),
        liveness_endpoint=args.liveness or None,
        standalone=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
