"""The node agent's view of the API server: the few calls it makes, as JSON over HTTP (no
client library needed)."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

WORKLOADS = (("apps/v1", "deployments"), ("apps/v1", "statefulsets"))
OWNED = (("v1", "configmaps"), ("v1", "secrets"), ("v1", "services"), ("v1", "persistentvolumeclaims"),
         ("networking.k8s.io/v1", "networkpolicies"),
         ("v1", "pods"), *WORKLOADS)
RLJOBS = ("kiln.dev/v1alpha1", "rljobs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    """The few calls the agent makes, as JSON over HTTP (no client library needed)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _path(self, api_version: str, plural: str, namespace: str | None, name: str = "") -> str:
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        ns = f"/namespaces/{namespace}" if namespace else ""
        return f"{root}{ns}/{plural}" + (f"/{name}" if name else "")

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type,
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return json.loads(text) if text else {}

    def namespaces(self) -> list[str]:
        out = self.call("GET", "/api/v1/namespaces") or {}
        return [n["metadata"]["name"] for n in out.get("items", [])]

    def list(self, api_version: str, plural: str, namespace: str) -> list[dict[str, Any]]:
        out = self.call("GET", self._path(api_version, plural, namespace)) or {}
        return list(out.get("items", []))

    def patch_status(self, api_version: str, plural: str, namespace: str, name: str,
                     status: dict[str, Any]) -> None:
        self.call("PATCH", self._path(api_version, plural, namespace, name) + "/status",
                  {"status": status}, "application/merge-patch+json")

    def put_pod(self, namespace: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if self.call("GET", self._path("v1", "pods", namespace, name)) is None:
            self.call("POST", self._path("v1", "pods", namespace), pod)
        self.patch_status("v1", "pods", namespace, name, pod["status"])

    def delete(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        self.call("DELETE", self._path(api_version, plural, namespace, name))
