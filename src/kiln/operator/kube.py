"""A small Kubernetes client for the kinds the operator manages, over the `kubernetes` package.

`Kube` reads, creates, applies (server-side apply, field manager `kiln-operator`), patches and
deletes objects given as plain manifests, so the reconciler works with the same dicts the pure
functions in `kiln.operator.children` return. Authentication comes from the `kubernetes`
package: the in-cluster service account when running in a pod, the kubeconfig otherwise.

API errors become `kopf.TemporaryError` (a retry may help: conflicts, throttling, a server
restarting) or `kopf.PermanentError` (it will not: forbidden, invalid), naming the object.

Not covered: watching (kopf does that for RLJobs; children are not watched) and kinds outside
`KINDS`.
"""
from __future__ import annotations

import json
import os
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kiln.operator.naming import MANAGER

# (apiVersion, kind) -> plural; all are namespaced.
KINDS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("kiln.dev/v1alpha1", "RLJob"): "rljobs",
}

_RETRYABLE = {409, 429, 500, 502, 503, 504}


class Conflict(Exception):
    """The object changed since it was read (a failed resourceVersion test); read again."""


def load_credentials() -> None:
    """The pod's service account inside a cluster; the kubeconfig (KUBECONFIG) outside one."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        # Read KUBECONFIG now: the kubernetes package captures it once, at its own import.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    plural = KINDS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"kind {api_version}/{kind} is not managed by the Kiln operator")
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}"


def object_path(manifest: dict[str, Any]) -> str:
    meta = manifest["metadata"]
    base = collection_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
    return f"{base}/{meta['name']}"


def is_subset(want: Any, have: Any) -> bool:
    """Whether every field of `want` is present in `have` with the same value."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k])
                                              for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(is_subset(a, b) for a, b in zip(want, have)))
    return want == have


class Kube:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()

    def _call(self, method: str, path: str, *, body: Any = None, content_type: str | None = None,
              query: list[tuple[str, str]] | None = None, what: str,
              conflict_ok: bool = False) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            method, url, headers, body, _ = self.api.param_serialize(
                method, path, query_params=query or [], header_params=headers, body=body,
                auth_settings=["BearerToken"])
            resp = self.api.call_api(method, url, header_params=headers, body=body,
                                     _request_timeout=30)
            data = resp.read()
            if not 200 <= resp.status <= 299:
                raise ApiException(http_resp=resp)
        except ApiException as exc:
            if exc.status == 404:
                return None
            if conflict_ok and exc.status in (409, 422):
                raise Conflict(what) from exc
            reason = _reason(exc)
            if exc.status in _RETRYABLE:
                raise kopf.TemporaryError(f"{method} {what}: {reason} (HTTP {exc.status}); retrying",
                                          delay=5) from exc
            raise kopf.PermanentError(f"{method} {what}: {reason} (HTTP {exc.status})") from exc
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        return self._call("GET", path, what=f"{kind} {namespace}/{name}")

    def list(self, api_version: str, kind: str, namespace: str,
             labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out = self._call("GET", collection_path(api_version, kind, namespace),
                         query=[("labelSelector", selector)], what=f"{kind} list in {namespace}")
        items = (out or {}).get("items", [])
        # The selector is applied here as well, so a server that ignores it changes nothing.
        return [o for o in items if is_subset(labels, o.get("metadata", {}).get("labels", {}))]

    def apply(self, manifest: dict[str, Any]) -> str:
        """Create the object, or bring it to the manifest. Returns created/updated/unchanged."""
        meta = manifest["metadata"]
        what = f"{manifest['kind']} {meta['namespace']}/{meta['name']}"
        current = self.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        if current is None:
            path = collection_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
            self._call("POST", path, body=manifest, content_type="application/json",
                       query=[("fieldManager", MANAGER)], what=what)
            return "created"
        if is_subset(manifest, current):
            return "unchanged"
        # Server-side apply: fields the operator set earlier and no longer sets are removed.
        self._call("PATCH", object_path(manifest), body=manifest,
                   content_type="application/apply-patch+yaml",
                   query=[("fieldManager", MANAGER), ("force", "true")], what=what)
        return "updated"

    def merge_patch(self, manifest_ref: dict[str, Any], patch: dict[str, Any]) -> None:
        what = f"{manifest_ref['kind']} {manifest_ref['metadata']['namespace']}/" \
               f"{manifest_ref['metadata']['name']}"
        self._call("PATCH", object_path(manifest_ref), body=patch,
                   content_type="application/merge-patch+json", what=what)

    def merge_patch_status(self, manifest_ref: dict[str, Any], status: dict[str, Any]) -> None:
        """Merge `status` into the object's status subresource."""
        self._call("PATCH", object_path(manifest_ref) + "/status", body={"status": status},
                   content_type="application/merge-patch+json",
                   what=f"status of {manifest_ref['metadata']['name']}")

    def patch_status_if_unchanged(self, manifest_ref: dict[str, Any], resource_version: str,
                                  fields: dict[str, Any]) -> bool:
        """Set status fields unless the object changed since `resource_version` was read.

        Returns False on a conflict (someone wrote in between; read again and retry)."""
        ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/resourceVersion",
                                      "value": resource_version}]
        ops += [{"op": "add", "path": f"/status/{key}", "value": value}
                for key, value in fields.items()]
        try:
            self._call("PATCH", object_path(manifest_ref) + "/status", body=ops,
                       content_type="application/json-patch+json", conflict_ok=True,
                       what=f"status of {manifest_ref['metadata']['name']}")
        except Conflict:
            return False
        return True

    def delete(self, manifest_ref: dict[str, Any]) -> bool:
        what = f"{manifest_ref['kind']} {manifest_ref['metadata']['namespace']}/" \
               f"{manifest_ref['metadata']['name']}"
        out = self._call("DELETE", object_path(manifest_ref), what=what,
                         body={"propagationPolicy": "Background"}, content_type="application/json")
        return out is not None


def _reason(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError):
        return str(exc.reason)
