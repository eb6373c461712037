"""The real operator (kopf's KopfRunner, in-process) against the development cluster's fake API
server (`kiln.cli.devcluster.api`; no real API server can run here), for tests about what the
operator writes: status, children, events. No service answers: jobs stay Pending unless a
test's rule moves them on (a deadline, a suspend)."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.cli.devcluster.api import RLJOBS, running_fake_api, write_kubeconfig

GROUP, VERSION, PLURAL = "kiln.dev", "v1alpha1", "rljobs"
COMPONENTS = ("trainer", "rollout", "sandbox", "weight-sync", "buffer")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


class FakeCluster:
    """The fake API server seen through a Kubernetes client (as kubectl would write) and read
    directly (as a test checks)."""

    def __init__(self, fake: Any, api: Any, namespace: str) -> None:
        self.fake, self.api, self.ns = fake, api, namespace

    def create(self, body: dict[str, Any]) -> None:
        self.api.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name,
                                                {"spec": spec},
                                                _content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.fake.stored(RLJOBS, self.ns, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, job: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(job).get("conditions", []) if c["type"] == type_), {})

    def obj(self, resource: str, name: str) -> dict[str, Any] | None:
        return self.fake.stored(resource, self.ns, name)

    def workload(self, job: str, component: str) -> dict[str, Any]:
        res = "apps/v1/statefulsets" if component == "trainer" else "apps/v1/deployments"
        found = self.obj(res, f"{job}-{component}")
        assert found is not None, f"{res} {job}-{component} missing"
        return found

    def replicas(self, job: str) -> dict[str, int]:
        return {c: self.workload(job, c)["spec"]["replicas"] for c in COMPONENTS}

    def children(self, job: str) -> dict[str, dict[str, Any]]:
        out = {}
        for res in ("v1/configmaps", "v1/services", "v1/persistentvolumeclaims",
                    "apps/v1/statefulsets", "apps/v1/deployments"):
            for name in self.fake.names(res, self.ns):
                if name.startswith(f"{job}-"):
                    out[f"{res}/{name}"] = self.obj(res, name)
        return out

    def events(self, job: str) -> list[tuple[str, str, str]]:
        return [(e.get("type"), e.get("reason"), e.get("message", ""))
                for e in self.fake.events(self.ns, job)]


@contextmanager
def running_operator(tmp: Path, namespace: str) -> Iterator[FakeCluster]:
    import kopf
    import kubernetes
    from kopf.testing import KopfRunner

    settings = {"KILN_OPERATOR_STATUS_INTERVAL": "0.3", "KILN_OPERATOR_GRPC_TIMEOUT": "0.5",
                # Nothing runs the pods here; what the admin allows is test_operator_process's.
                "KILN_OPERATOR_ALLOW_PRIVILEGED_SANDBOXES": "true",
                # No service answers: every address is a socket nobody listens on.
                "KILN_OPERATOR_ADDRESS_TEMPLATE": f"unix:{tmp}/{{name}}-{{component}}.sock"}
    saved = {k: os.environ.get(k) for k in [*settings, "KUBECONFIG"]}
    with running_fake_api() as (fake, url):
        fake.add_namespace(namespace)
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", url, namespace)
        os.environ.update(settings, KUBECONFIG=str(kubeconfig))
        client = kubernetes.config.new_client_from_config(str(kubeconfig))
        cluster = FakeCluster(fake, kubernetes.client.CustomObjectsApi(client), namespace)
        args = ["run", "--standalone", "--namespace", namespace, "-m", "kiln.operator.handlers"]
        kopf_settings = kopf.OperatorSettings()  # kept, to shut its handlers' threads down after
        try:
            with KopfRunner(args, timeout=30, settings=kopf_settings) as runner:
                yield cluster
                # Every job deleted, and its driving thread ended, while the operator runs: a
                # thread still driving when kopf's loop closes would post to a closed loop.
                for name in fake.names(RLJOBS, namespace):
                    cluster.delete(name)
                wait_for("every RLJob gone", lambda: not fake.names(RLJOBS, namespace), 120)
                wait_for("driving threads ended", lambda: not [
                    t for t in threading.enumerate()
                    if t.name.startswith(f"drive {namespace}/")], 120)
        finally:
            kopf_settings.execution.executor.shutdown(wait=True)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    assert runner.exception is None, runner.output[-3000:]
