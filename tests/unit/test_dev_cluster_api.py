"""The fake API server keeps serving at the same speed however long it runs: it keeps only the
newest requests of kmock's history, which kmock scans on every request."""
from __future__ import annotations

import json
import urllib.request

from kiln.cli.devcluster.api import HISTORY, running_fake_api


def test_request_history_stays_bounded_and_objects_stay() -> None:
    with running_fake_api() as (fake, url):
        fake.add_namespace("ns")
        for i in range(20 * HISTORY):
            body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": f"c{i}", "namespace": "ns"}}).encode()
            req = urllib.request.Request(f"{url}/api/v1/namespaces/ns/configmaps", data=body,
                                         method="POST", headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()
        assert len(fake._requests) <= 2 * HISTORY
        listed = json.loads(urllib.request.urlopen(f"{url}/api/v1/namespaces/ns/configmaps",
                                                   timeout=10).read())
        assert len(listed["items"]) == 20 * HISTORY  # the objects themselves are all kept
