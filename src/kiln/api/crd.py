"""The RLJob CustomResourceDefinition, generated from the pydantic models in `kiln.api.spec`.

Kubernetes wants a *structural* schema: every node typed, no `$ref`, no `anyOf`/`oneOf` that
introduces properties. pydantic's JSON schema is close; this module rewrites it: references are
inlined, `X | None` becomes `nullable: true`, and a tagged union (the stages on `type`, a stage's
`rl.loss` on `mode`) becomes one object with every variant's fields, whose tag is an enum (the
per-variant rules, such as a field of the other variant, are enforced by `kiln validate` and by
the operator, which run the same pydantic models). The CEL rules, immutable fields and keyed
lists the API server checks at admission are added from `kiln.api.rules`. The checked-in copy lives at
`charts/kiln/crds/rljobs.kiln.dev.yaml`; a test regenerates it and compares.
"""
from __future__ import annotations

import copy
from typing import Any

import yaml

from kiln.api.rules import add_rules
from kiln.api.spec import API_GROUP, API_VERSION, KIND, PLURAL, RLJobSpec, RLJobStatus

_DROP = {"title", "examples", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)
        return _resolve(target, defs)
    return {k: _resolve(v, defs) for k, v in node.items() if k not in _DROP}


_TAG_DESCRIPTIONS = {"type": "Kind of stage.", "mode": "Loss mode (the fields it reads are its own)."}


def _tag_key(variants: list[dict[str, Any]]) -> str:
    """The discriminator: the property every variant fixes to one value."""
    fixed = [{n for n, s in v.get("properties", {}).items()
              if "const" in s or len(s.get("enum", [])) == 1} for v in variants]
    (key,) = set.intersection(*fixed)
    return key


def _merge_variants(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """One object schema accepting every variant of a tagged union. A field that only some
    variants have, or that variants describe differently, has its description(s) prefixed with
    the variants' tags (`ppo: ...`), so `kubectl explain` says where it applies."""
    key = _tag_key(variants)
    props: dict[str, Any] = {}
    described: dict[str, dict[str, list[str]]] = {}  # field -> description -> tags
    required: set[str] | None = None
    tags: list[str] = []
    for v in variants:
        tag_schema = v["properties"][key]
        tag = tag_schema.get("const", (tag_schema.get("enum") or [None])[0])
        tags.append(tag)
        for name, schema in v.get("properties", {}).items():
            if name == key:
                continue
            props.setdefault(name, schema)
            if props[name].get("minItems") and not schema.get("minItems"):
                # One variant allows an empty list (a rule for the others keeps theirs).
                props[name] = {k: v for k, v in props[name].items() if k != "minItems"}
            described.setdefault(name, {}).setdefault(schema.get("description", ""), []).append(tag)
        req = set(v.get("required", []))
        required = req if required is None else required & req
    for name, by_text in described.items():
        if len(by_text) > 1 or len(next(iter(by_text.values()))) < len(variants):
            text = " ".join(f"{', '.join(ts)}: {d}" for d, ts in by_text.items() if d)
            props[name] = {**props[name], "description": text}
    props[key] = {"type": "string", "enum": tags,
                  "description": _TAG_DESCRIPTIONS.get(key, f"One of {', '.join(tags)}.")}
    descriptions = [v["description"] for v in variants if v.get("description")]
    out: dict[str, Any] = {"type": "object", "properties": dict(sorted(props.items()))}
    if descriptions:
        out["description"] = "One of: " + " / ".join(f"{t}: {d}" for t, d in zip(tags, descriptions))
    out["required"] = sorted(required or set())
    return out


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    for key in ("anyOf", "oneOf"):
        if key not in node:
            continue
        options = node.pop(key)
        non_null = [o for o in options if o.get("type") != "null"]
        nullable = len(non_null) != len(options)
        types = {o.get("type") for o in non_null}
        if len(non_null) == 1:
            merged = dict(non_null[0])
        elif len(types) > 1:
            # A value of several JSON types (a built-in name or a {plugin: ...} object): a
            # structural schema cannot say so; the API's own validation does.
            merged = {"x-kubernetes-preserve-unknown-fields": True}
        else:
            merged = _merge_variants(non_null)
            if node.get("description") and merged.get("description"):
                # The field's own words first, then what each variant is.
                node["description"] = f"{node['description']} {merged['description']}"
        merged.update(node)
        node = merged
        if nullable:
            node["nullable"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("type") == "object" and "additionalProperties" in node:
        ap = node["additionalProperties"]
        if ap is False:
            node.pop("additionalProperties")
        elif ap is True or ap == {}:
            node.pop("additionalProperties")
            node["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "default" in node and node["default"] is None:
        node.pop("default")
    # JSON Schema 2020 writes exclusive bounds as numbers; OpenAPI v3.0 as booleans.
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())
    return {k: _structural(v) for k, v in node.items()}


def openapi_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def build_crd() -> dict[str, Any]:
    spec_schema = openapi_schema(RLJobSpec)
    status_schema = openapi_schema(RLJobStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["rlj"],
                "categories": ["kiln"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    # `scale` sizes rollout: `kubectl scale rljob/NAME --replicas N`, an HPA or
                    # a KEDA ScaledObject (or the operator, with spec.rollout.autoscale).
                    "subresources": {"status": {}, "scale": {
                        "specReplicasPath": ".spec.rollout.replicas",
                        "statusReplicasPath": ".status.rolloutReplicas",
                        "labelSelectorPath": ".status.rolloutSelector"}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Stage", "type": "string", "jsonPath": ".status.stage"},
                        {"name": "Version", "type": "integer", "jsonPath": ".status.policyVersion",
                         "description": "Policy version published to rollout"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Reward", "type": "number", "jsonPath": ".status.reward"},
                        {"name": "Staleness", "type": "integer",
                         "jsonPath": ".status.observedStaleness", "priority": 1},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": add_rules({
                            "type": "object",
                            "description": "A reinforcement-learning job for an LLM agent.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": (
                                    "APIVersion defines the versioned schema of this "
                                    f"representation of an object: {API_GROUP}/{API_VERSION}.")},
                                "kind": {"type": "string", "description": (
                                    f"Kind is the REST resource this object represents: {KIND}.")},
                                "metadata": {"type": "object", "description": (
                                    "Standard object metadata: name, namespace, labels, "
                                    "annotations.")},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        })
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `kiln crd` from src/kiln/api/spec.py; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
