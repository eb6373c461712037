"""What the development cluster's fake API answers so that plain kubectl works against it: the
OpenAPI v3 documents, Table responses, and the refusal of an RLJob its schema rejects.

- OpenAPI v3 (`/openapi/v3` and one document per group-version): kubectl's `apply` and `create`
  validate by default, and first ask the server's OpenAPI whether the PATCH operation of the
  object's kind takes the `fieldValidation` query parameter. Every served kind says it does,
  so kubectl sends `fieldValidation=Strict` and leaves validation to the server, as it does with
  any API server since Kubernetes 1.27 (`--validate=false` is not needed). The RLJob document
  carries the CRD's openAPIV3Schema (for `kubectl explain`); built-in kinds carry no schema,
  so kubectl builds their patches from the types compiled into it.
- RLJob admission: a created or updated RLJob is checked against the CRD's openAPIV3Schema
  (types, enums, bounds, required fields; unknown fields only under `fieldValidation=Strict`,
  what kubectl sends), as a real API server does; a refusal is a 422 naming each field. Rules
  the schema cannot state (Kiln's cross-field checks and capabilities) are left to the
  operator, which refuses such a job in its status, as on a real cluster. Its status
  subresource is not checked.
- Tables (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`, what `kubectl get` asks for):
  a list or a single object of a custom resource becomes a `meta.k8s.io/v1` Table whose columns
  are the CRD's `additionalPrinterColumns` (simple `.a.b.c` JSONPaths), after Name.

Not covered: OpenAPI v2 (kubectl only falls back to it when v3 is missing), schemas of built-in
kinds, Tables for built-in kinds (kubectl prints those itself) and for watches.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from kiln.api.spec import API_GROUP, KIND

TABLE_ACCEPT = "as=Table"
_PARAMS = [{"name": n, "in": "query", "schema": {"type": "string"}, "uniqueItems": True}
           for n in ("dryRun", "fieldManager", "fieldValidation")]


def gv_path(group: str, version: str) -> str:
    """The discovery path of a group-version: `api/v1` for the core group."""
    return f"apis/{group}/{version}" if group else f"api/{version}"


def v3_index(group_versions: list[tuple[str, str]]) -> dict[str, Any]:
    """The `/openapi/v3` root: where each group-version's document is."""
    return {"paths": {gv_path(g, v): {"serverRelativeURL": f"/openapi/v3/{gv_path(g, v)}"}
                      for g, v in sorted(set(group_versions))}}


def _schema_name(group: str, version: str, kind: str) -> str:
    reverse = ".".join(reversed(group.split("."))) if group else "io.k8s.api.core"
    return f"{reverse}.{version}.{kind}"


def v3_document(group: str, version: str, resources: list[tuple[str, str, bool]],
                schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI v3 document of one group-version. `resources`: (plural, kind, namespaced);
    `schemas`: kind -> openAPIV3Schema, for the kinds that have one (custom resources)."""
    paths: dict[str, Any] = {}
    components: dict[str, Any] = {}
    for plural, kind, namespaced in resources:
        gvk = {"group": group, "version": version, "kind": kind}
        scope = "/namespaces/{namespace}" if namespaced else ""
        base = f"/{gv_path(group, version)}{scope}/{plural}"

        def op(verb: str, params: list[dict[str, Any]] = (), gvk=gvk, plural=plural) -> dict[str, Any]:
            return {"operationId": f"{verb}{plural}", "parameters": list(params),
                    "x-kubernetes-action": verb, "x-kubernetes-group-version-kind": gvk,
                    "responses": {"200": {"description": "OK"}}}
        paths[base] = {"get": op("list"), "post": op("post", _PARAMS)}
        paths[f"{base}/{{name}}"] = {"get": op("get"), "put": op("put", _PARAMS),
                                     "patch": op("patch", _PARAMS), "delete": op("delete")}
        if kind in schemas:
            components[_schema_name(group, version, kind)] = {
                **schemas[kind], "x-kubernetes-group-version-kind": [gvk]}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes (kiln dev-cluster)", "version": "v1"},
            "paths": paths, "components": {"schemas": components}}


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a meta.k8s.io Table first."""
    first = accept.split(",")[0].replace(" ", "")
    return TABLE_ACCEPT in first and "g=meta.k8s.io" in first


def _cell(obj: dict[str, Any], json_path: str) -> Any:
    node: Any = obj
    for key in json_path.strip().lstrip("{").rstrip("}").lstrip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def age(timestamp: Any, now: datetime | None = None) -> Any:
    """A `date` cell as the API server prints it: the time since, in kubectl's units."""
    try:
        then = datetime.strptime(str(timestamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return timestamp
    s = int(((now or datetime.now(timezone.utc)) - then).total_seconds())
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 0:
        return "0s"
    for limit, text in ((120, f"{s}s"), (600, f"{m}m{s % 60}s" if s % 60 else f"{m}m"),
                        (3 * 3600, f"{m}m"), (8 * 3600, f"{h}h{m % 60}m" if m % 60 else f"{h}h"),
                        (48 * 3600, f"{h}h"), (8 * 86400, f"{d}d{h % 24}h" if h % 24 else f"{d}d")):
        if s < limit:
            return text
    return f"{d}d"


def table(objects: list[dict[str, Any]], columns: list[dict[str, Any]],
          resource_version: str) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table of `objects` with the CRD's printer `columns` after Name."""
    defs = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
             "description": "Name must be unique within a namespace."}]
    defs += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
              "description": c.get("description", ""), "priority": c.get("priority", 0)}
             for c in columns]
    rows = [{"cells": [obj.get("metadata", {}).get("name")]
             + [age(v) if c.get("type") == "date" and v is not None else v
                for c in columns for v in [_cell(obj, c["jsonPath"])]],
             "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                        "metadata": obj.get("metadata", {})}}
            for obj in objects]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": defs, "rows": rows}


def printer_columns(crd: dict[str, Any], version: str) -> list[dict[str, Any]]:
    for v in crd.get("spec", {}).get("versions", []):
        if v.get("name") == version:
            return list(v.get("additionalPrinterColumns") or [])
    return []


def rljob_refusal(obj: Any, schema: dict[str, Any], *, strict: bool) -> dict[str, Any] | None:
    """A 422 Status for an RLJob that the CRD's `schema` (openAPIV3Schema) rejects, else None;
    `strict`: unknown fields are refused too (kubectl's `fieldValidation=Strict`)."""
    import jsonschema

    if not isinstance(obj, dict):
        return None
    document = {k: v for k, v in obj.items() if k in ("spec",)}
    spec_schema = {"type": "object", "properties": {"spec": _json_schema(
        (schema.get("properties") or {}).get("spec") or {}, strict)}}
    # OpenAPI 3.0 schemas speak draft 4 (`exclusiveMinimum: true` beside `minimum`).
    errors = sorted(jsonschema.Draft4Validator(spec_schema).iter_errors(document),
                    key=lambda e: list(map(str, e.absolute_path)))
    if not errors:
        return None
    causes = [{"reason": "FieldValueInvalid", "field": _path(e.absolute_path), "message": e.message}
              for e in errors]
    name = (obj.get("metadata") or {}).get("name", "")
    detail = "; ".join(f"{c['field']}: {c['message']}" for c in causes)
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "reason": "Invalid", "code": 422,
            "message": f'{KIND}.{API_GROUP} "{name}" is invalid: {detail}',
            "details": {"name": name, "group": API_GROUP, "kind": KIND, "causes": causes}}


def _json_schema(node: Any, strict: bool) -> Any:
    """An OpenAPI v3 structural schema as JSON Schema: `nullable` becomes a null type, and
    objects without `x-kubernetes-preserve-unknown-fields` refuse unknown fields when strict
    (a real API server prunes them otherwise)."""
    if isinstance(node, list):
        return [_json_schema(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v, strict) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if strict and node.get("type") == "object" and "properties" in node \
            and not node.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def _path(parts) -> str:  # type: ignore[no-untyped-def]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
