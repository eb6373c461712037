"""The checked-in CRD is exactly what the spec models generate, and Kubernetes would accept it."""
from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kiln.api.crd import build_crd, crd_yaml

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "charts" / "kiln" / "crds" / "rljobs.kiln.dev.yaml"
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
K8S_VERSION = "1.33.0"


def test_checked_in_crd_matches_generated():
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "charts/kiln/crds is stale: run `kiln crd > charts/kiln/crds/rljobs.kiln.dev.yaml`")


def test_crd_passes_kubernetes_validate():
    kubernetes_validate.validate(build_crd(), K8S_VERSION, strict=True)


def _structural_problems(node, path="schema"):
    """Kubernetes' structural-schema rules that matter for a generated schema."""
    problems = []
    if isinstance(node, dict):
        for bad in ("$ref", "anyOf", "oneOf", "allOf", "$defs", "const"):
            if bad in node:
                problems.append(f"{path}: {bad} is not allowed")
        if "properties" in node and node.get("type") != "object":
            problems.append(f"{path}: properties without type: object")
        if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{path}: no type")
        for key, value in node.get("properties", {}).items():
            problems += _structural_problems(value, f"{path}.{key}")
        if "items" in node:
            problems += _structural_problems(node["items"], f"{path}[]")
    return problems


def test_schema_is_structural():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _structural_problems(schema) == []


def test_printer_columns_cover_kubectl_get():
    cols = {c["name"]: c["jsonPath"] for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Phase"] == ".status.phase"
    assert cols["Version"] == ".status.policyVersion"
    assert cols["Step"] == ".status.step"
    assert cols["Reward"] == ".status.reward"
    assert cols["Age"] == ".metadata.creationTimestamp"


def _to_jsonschema(node):
    """OpenAPI v3.0 `nullable`/boolean exclusive bounds -> JSON Schema, for jsonschema."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(bound) is True:
            node[bound] = node.pop(plain)
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    return node


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_crd_schema(path):
    schema = _to_jsonschema(copy.deepcopy(
        build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    for doc in yaml.safe_load_all(path.read_text()):
        jsonschema.validate(doc, schema)


def test_crd_schema_rejects_what_validate_rejects():
    schema = _to_jsonschema(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    doc = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["sandbox"]["backend"] = "gvisor"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def _undescribed(node: dict, path: str) -> list[str]:
    """Fields (properties, and object-valued list items) without a description: what `kubectl
    explain rljob.spec...` would show with nothing to say."""
    missing = []
    if path and not node.get("description"):
        missing.append(path)
    for name, child in node.get("properties", {}).items():
        missing += _undescribed(child, f"{path}.{name}" if path else name)
    items = node.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        missing += _undescribed(items, path + "[]")
    return missing


def test_every_crd_field_has_a_description():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["description"]
    assert _undescribed(schema, "") == []
    # The check itself sees nested fields: a stage's rl.tau and a task set's generate.seed.
    spec = schema["properties"]["spec"]["properties"]
    assert "tau" in spec["stages"]["items"]["properties"]["rl"]["properties"]
    assert spec["tasks"]["items"]["properties"]["generate"]["properties"]["seed"]["description"]


def test_scale_subresource_paths_name_fields_of_the_schema():
    """`kubectl scale`, an HPA or KEDA write and read rollout's replica count through these."""
    version = build_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    schema = version["schema"]["openAPIV3Schema"]

    def field(path: str) -> dict:
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        return node

    assert field(scale["specReplicasPath"])["type"] == "integer"
    assert field(scale["statusReplicasPath"])["type"] == "integer"
    assert field(scale["labelSelectorPath"])["type"] == "string"
