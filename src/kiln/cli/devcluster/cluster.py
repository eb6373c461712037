"""The development cluster's API-and-node process (`python -m kiln.cli.devcluster.cluster DIR`,
started by `kiln dev-cluster up`): serves the fake API server, installs the RLJob CRD, writes
`DIR/kubeconfig`, and runs the node agent until SIGTERM, which stops every pod first."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from kiln.api.crd import build_crd
from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig
from kiln.cli.devcluster.apiclient import Api
from kiln.cli.devcluster.node import Node

NAMESPACE = "default"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kiln-dev-cluster")
    p.add_argument("root", type=Path)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with running_fake_api() as (fake, url):
        fake.add_namespace(NAMESPACE)
        crd = json.dumps(build_crd()).encode()
        urllib.request.urlopen(urllib.request.Request(
            f"{url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions", data=crd,
            method="POST", headers={"Content-Type": "application/json"}), timeout=10).read()
        node = Node(Api(url), args.root, args.workdir.resolve(), interval=args.interval)
        thread = threading.Thread(target=node.run, name="node", daemon=True)
        thread.start()
        # Written last: its presence says the API is up.
        tmp = args.root / "kubeconfig.tmp"
        write_kubeconfig(tmp, url, NAMESPACE)
        tmp.replace(args.root / "kubeconfig")
        logging.getLogger("kiln.devcluster").info("API at %s; node agent running", url)
        stop.wait()
        node.stop.set()
        thread.join(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
