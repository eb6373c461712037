"""A stand-in for a Kubernetes API server: the development cluster's API (`kiln dev-cluster`)
and the operator's end-to-end tests.

No Kubernetes API server can run on the development and CI machines, so the local cluster
serves kmock's in-memory emulator over real HTTP. kmock 0.8 needs a few fixes to satisfy kopf
1.45 and kubectl; they all live here, in `KubeApiFake`:

- objects get `metadata.uid`, `resourceVersion`, `creationTimestamp` and `generation` on
  create; every patch bumps `resourceVersion` (kopf's JSON-patches `test` it) and a patch of
  `spec` bumps `generation`;
- a JSON-patch whose `test` fails is answered 422 (kopf then retries), not 500;
- list responses carry `kind` and `apiVersion`;
- `metadata.generateName` is honoured (kopf posts events that way);
- `GET /api/v1/namespaces` is served (kmock's path parser fails on it);
- the core group's resource list says `groupVersion: v1` (kmock: `/v1`, which hides every core
  kind from kubectl's `apply`);
- a watch misses no event that happens while it starts, and does not announce again what the
  client listed at the `resourceVersion` it passes;
- only the newest `HISTORY` requests are kept: kmock keeps every request for test assertions
  and matches each new one against that whole history, so an API serving an operator for
  minutes slowed down quadratically (50 jobs took two minutes each to reconcile);
- what plain kubectl needs (`kiln.cli.devcluster.openapi`): OpenAPI v3 documents, so
  `kubectl apply -f` validates without `--validate=false`; an RLJob that the CRD's schema
  rejects is refused with a 422 naming the field; `kubectl get` of a custom resource gets a
  Table with the CRD's printer columns.

What it still is not: there is no garbage collection here (the development cluster's node agent
does it, `kiln.cli.devcluster.node`), no label selectors (clients filter), no schema validation
of built-in kinds, no defaulting, no other admission.
`running_fake_api()` serves it from a thread of its own, and `write_kubeconfig` points clients
at it.

Whoever uses it stays real (the operator, kubectl, the node agent); only the API server is fake.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock import KubernetesError, ResourceInfo

from kiln.api.spec import API_GROUP, API_VERSION, KIND, PLURAL
from kiln.cli.devcluster import openapi

RLJOBS = f"{API_GROUP}/{API_VERSION}/{PLURAL}"

_BUILTIN = {
    "v1/configmaps": "ConfigMap",
    "v1/secrets": "Secret",
    "v1/services": "Service",
    "v1/persistentvolumeclaims": "PersistentVolumeClaim",
    "v1/events": "Event",
    "v1/namespaces": "Namespace",
    "apps/v1/deployments": "Deployment",
    "apps/v1/statefulsets": "StatefulSet",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "v1/pods": "Pod",
}
_WITH_STATUS = {"Deployment", "StatefulSet", "Pod"}
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
_VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}
# Requests kept in kmock's history. A request must still be in it while its reaction is looked
# up, which kmock does before anything can suspend, so no other request completes (and trims)
# in between; the margin covers that changing in a later kmock.
HISTORY = 8


class KubeApiFake(kmock.KubernetesEmulator):
    """kmock's emulator with the fixes kopf needs (see the module docstring)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self.namespaces: set[str] = set()
        for path, kind in _BUILTIN.items():
            self.resources[path] = ResourceInfo(
                kind=kind, singular=kind.lower(), verbs=_VERBS, namespaced=kind != "Namespace",
                subresources={"status"} if kind in _WITH_STATUS else set())
        self.resources[CRDS] = ResourceInfo(kind="CustomResourceDefinition",
                                            singular="customresourcedefinition", verbs=_VERBS,
                                            namespaced=False)
        self.resources[RLJOBS] = ResourceInfo(kind=KIND, singular=KIND.lower(), verbs=_VERBS,
                                              namespaced=True, subresources={"status"})

    # -- fixes -----------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.method == "GET" and raw_request.path.rstrip("/") == "/api/v1/namespaces":
            items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
                     for n in sorted(self.namespaces)]
            if raw_request.query.get("watch") == "true":
                return await self._watch_namespaces(raw_request, items)
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "NamespaceList",
                "metadata": {"resourceVersion": str(next(self._versions))}, "items": items})
        if raw_request.method == "GET" and raw_request.path.startswith("/openapi/v3"):
            return self._openapi(raw_request.path.removeprefix("/openapi/v3").strip("/"))
        try:
            return await super().__call__(raw_request)
        finally:
            self._forget_old_requests()

    async def _serve_version(self, request):  # type: ignore[no-untyped-def]
        # kmock names the core group's version "/v1"; kubectl's REST mapper keys the core
        # resources by "v1" and, not finding them, maps no core kind (`kubectl apply -f` of a
        # ConfigMap or a PVC: "no matches for kind").
        doc = await super()._serve_version(request)
        if doc.get("groupVersion", "").startswith("/"):
            doc["groupVersion"] = doc["groupVersion"][1:]
        return doc

    def _forget_old_requests(self) -> None:
        if len(self._requests) > 2 * HISTORY:
            del self._requests[:-HISTORY]
            for payload in self._payloads:
                del payload._requests[:-HISTORY]

    async def _watch_namespaces(self, raw_request: aiohttp.web.BaseRequest,
                                items: list[dict[str, Any]]) -> aiohttp.web.StreamResponse:
        """Namespaces never change here: announce them, then hold the stream open."""
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        await asyncio.sleep(3600)  # cancelled when the client or the server goes away
        return response

    def _openapi(self, gv: str) -> aiohttp.web.StreamResponse:
        by_gv: dict[str, list[tuple[str, str, bool]]] = {}
        for res, info in self.resources.items():
            by_gv.setdefault(openapi.gv_path(res.group, res.version), []).append(
                (res.plural, info.kind, bool(info.namespaced)))
        if not gv:
            return aiohttp.web.json_response(openapi.v3_index(
                [(res.group, res.version) for res in self.resources]))
        if gv not in by_gv:
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "code": 404,
                                              "status": "Failure", "reason": "NotFound"}, status=404)
        group, version = gv.split("/")[1:] if gv.startswith("apis/") else ("", gv.split("/")[1])
        schemas = {}
        for plural, kind, _ in by_gv[gv]:
            crd = self._crd(group, plural)
            for v in (crd or {}).get("spec", {}).get("versions", []):
                if v.get("name") == version and "openAPIV3Schema" in v.get("schema", {}):
                    schemas[kind] = v["schema"]["openAPIV3Schema"]
        return aiohttp.web.json_response(openapi.v3_document(group, version, by_gv[gv], schemas))

    def _crd(self, group: str, plural: str) -> dict[str, Any] | None:
        key = (kmock.resource(CRDS), None, f"{plural}.{group}")
        return self.objects[key].raw if group and key in self.objects and \
            not self.objects[key].deleted else None

    def _table(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """A Table of the requested custom resources, when one was asked for."""
        res = request.resource
        crd = self._crd(res.group, res.plural) if res.group else None
        if crd is None or not openapi.wants_table(request.headers.get("Accept", "")):
            return None
        objects = [obj.raw for (r, ns, name), obj in self.objects.items()
                   if not obj.deleted and self._matches(request, r, ns, name)]
        if request.name is not None and not objects:
            raise KubernetesError(status=404, reason="NotFound",
                                  message=f'{res.plural}.{res.group} "{request.name}" not found')
        return aiohttp.web.json_response(openapi.table(
            sorted(objects, key=lambda o: o["metadata"]["name"]),
            openapi.printer_columns(crd, res.version), str(next(self._versions))))

    def _admit(self, request: kmock.Request) -> None:
        """Refuse an RLJob whose new spec the CRD's schema rejects (422, naming the fields)."""
        if request.resource != kmock.resource(RLJOBS) or request.subresource is not None:
            return
        key = (request.resource, request.namespace, request.name)
        current = copy.deepcopy(self.objects[key].raw) if key in self.objects else None
        if request.action == kmock.action.CREATE:
            new = request.data
        elif current is None or request.data is None:
            return
        elif isinstance(request.data, list):
            new = jsonpatch.apply_patch(current, request.data)
        elif request.method == kmock.method.PUT:
            new = request.data
        else:
            new = _merge(current, request.data)
        if current is not None and isinstance(new, dict) and new.get("spec") == current.get("spec"):
            return  # metadata or finalizers only: a refused job still takes kopf's patches
        crd = self._crd(request.resource.group, request.resource.plural)
        schema = next((v["schema"]["openAPIV3Schema"] for v in (crd or {}).get("spec", {}).get("versions", [])
                       if v.get("name") == request.resource.version and "schema" in v), None)
        if schema is None:
            return
        strict = request.params.get("fieldValidation") == "Strict"
        refusal = openapi.rljob_refusal(new, schema, strict=strict)
        if refusal is not None:
            raise KubernetesError(status=422, reason="Invalid", message=refusal["message"],
                                  details=refusal["details"])

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.action in (kmock.action.LIST, kmock.action.FETCH):
            if (response := self._table(request)) is not None:
                return response
        if request.resource is not None and request.action in (kmock.action.CREATE,
                                                               kmock.action.UPDATE):
            self._admit(request)
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._stamp_new(request)
            elif request.action == kmock.action.UPDATE and request.data is not None:
                self._stamp_patch(request)
        try:
            return await super()._handle(request)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        res = request.resource
        kind = self.resources[res].kind if res in self.resources else None
        payload["kind"] = f"{kind or res.plural.capitalize()}List"
        payload["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        payload["metadata"]["resourceVersion"] = str(next(self._versions))
        return payload

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """Like kmock's watch, but events between the snapshot and the stream are not lost
        (the bus position is marked under the lock), and objects the client has already
        listed (`resourceVersion` parameter) are not announced again."""
        yield b""
        bus = self._buses[request.resource]
        since = int(request.params.get("resourceVersion") or 0)
        async with self._lock:
            mark = await bus.mark()
            snapshot = [obj.raw for (res, ns, name), obj in self.objects.items()
                        if not obj.deleted and self._matches(request, res, ns, name)]
        for raw in snapshot:
            if int(raw.get("metadata", {}).get("resourceVersion", 0)) > since:
                yield {"type": "ADDED", "object": raw}
        async for event in bus.stream(since=mark):
            meta = event.get("object", {}).get("metadata", {})
            if self._matches(request, request.resource, meta.get("namespace"), meta.get("name")):
                yield event

    @staticmethod
    def _matches(request: kmock.Request, resource: Any, namespace: str | None, name: str) -> bool:
        return (resource == request.resource
                and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name))

    def _stamp_new(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["creationTimestamp"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["generation"] = 1

    def _stamp_patch(self, request: kmock.Request) -> None:
        version = str(next(self._versions))
        key = (request.resource, request.namespace, request.name)
        current = self.objects[key] if key in self.objects else None
        touches_spec = False
        if isinstance(request.data, list):  # JSON patch: the tests go first, so they see the old version
            touches_spec = any(op.get("path", "").startswith("/spec") for op in request.data)
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        elif isinstance(request.data, dict):  # merge patch or server-side apply
            touches_spec = "spec" in request.data
            request.data.setdefault("metadata", {})["resourceVersion"] = version
        if touches_spec and request.subresource is None and current is not None and not current.deleted:
            generation = current.get("metadata", {}).get("generation", 1) + 1
            if isinstance(request.data, list):
                request.data.append({"op": "add", "path": "/metadata/generation", "value": generation})
            else:
                request.data["metadata"]["generation"] = generation

    # -- helpers for tests ------------------------------------------------------------------

    def add_namespace(self, name: str) -> None:
        self.namespaces.add(name)

    def _read(self, fn: Any) -> Any:
        """Run `fn` on the server's event loop: tests read from another thread, and the
        emulator's dicts must not change under an iteration."""
        loop = getattr(self, "loop", None)
        if loop is None or threading.current_thread() is getattr(self, "thread", None):
            return fn()

        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            key = (kmock.resource(resource), namespace, name)
            if key not in self.objects or self.objects[key].deleted:
                return None
            return copy.deepcopy(self.objects[key].raw)
        return self._read(read)

    def names(self, resource: str, namespace: str) -> set[str]:
        wanted = kmock.resource(resource)
        return self._read(lambda: {name for (res, ns, name), obj in self.objects.items()
                                   if ns == namespace and not obj.deleted and res == wanted})

    def events(self, namespace: str, involved: str) -> list[dict[str, Any]]:
        wanted = kmock.resource("v1/events")
        return self._read(lambda: [
            copy.deepcopy(obj.raw) for (res, ns, _), obj in self.objects.items()
            if res == wanted and ns == namespace and not obj.deleted
            and obj.raw.get("involvedObject", {}).get("name") == involved])


def _merge(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied to a copy of `target`."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def write_kubeconfig(path: Path, url: str, namespace: str) -> Path:
    """A kubeconfig whose only context points at the fake server (no credentials)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "fake"}}],
        "contexts": [{"name": "test-fake", "context": {"cluster": "fake", "user": "fake",
                                                       "namespace": namespace}}],
        "current-context": "test-fake",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def running_fake_api(port: int = 0) -> Iterator[tuple[KubeApiFake, str]]:
    """Serve a `KubeApiFake` on 127.0.0.1 from a background thread; yields (fake, url)."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        async with KubeApiFake() as fake, kmock.Server(fake, port=port or None) as server:
            fake.loop, fake.thread = loop, threading.current_thread()
            started["fake"], started["url"] = fake, str(server.url).rstrip("/")
            ready.set()
            await stop.wait()

    def target() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # surfaced to the test below
            started["error"] = exc
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=target, name="fake-kube-api", daemon=True)
    thread.start()
    ready.wait(10)
    if "error" in started or "fake" not in started:
        raise RuntimeError(f"fake Kubernetes API did not start: {started.get('error')!r}")
    try:
        yield started["fake"], started["url"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
