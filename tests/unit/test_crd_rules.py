"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated with cel-python on good and bad
RLJobs, give the verdicts of the pydantic models `kiln validate` and the operator run; its
transition rules refuse what the operator refuses as an immutable-field change; its keyed lists
are keyed by what the models hold unique.

No API server can run here, so `admit` does the part of admission the rules rely on: the
schema's defaults filled in and numbers of `type: number` made doubles, as the API server
decodes them (CEL does not compare an int with a double)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from pydantic import ValidationError

from kiln.api.crd import build_crd
from kiln.api.rules import IMMUTABLE_FIELDS, RULES
from kiln.api.spec import RLJobSpec
from kiln.operator import children

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}

BASE: dict[str, Any] = {
    "model": {"path": "models/tiny"},
    "tasks": [{"name": "train", "env": "chain", "generate": {"count": 8},
               "toolLatency": {"p50Seconds": 1, "p99Seconds": 4}}],
    "stages": [{"name": "sft", "type": "sft", "tasks": ["train"], "batchSize": 8,
                "microBatchSize": 4},
               {"name": "rl", "type": "rl", "tasks": ["train"], "batchSize": 16,
                "microBatchSize": 8, "rl": {"groupSize": 8}}],
    "rollout": {"replicas": 2, "autoscale": {"minReplicas": 1, "maxReplicas": 4},
                "sampling": {"temperature": 1}, "openaiPort": 8000,
                "openai": {"apiKeySecret": "keys"},
                "pod": {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}},
    "sandbox": {"backend": "docker", "image": "python:3.12-slim"},
}


def admit(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as the API server holds it after defaulting."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = admit(out[name], sub)
        return out
    if isinstance(value, list) and "items" in schema:
        return [admit(v, schema["items"]) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _run(rule: str, self: Any, old: Any = None) -> bool:
    program = _PROGRAMS.get(rule) or _PROGRAMS.setdefault(rule, _ENV.program(_ENV.compile(rule)))
    activation = {"self": celpy.json_to_cel(self)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    return bool(program.evaluate(activation))


def violations(new: Any, schema: dict[str, Any] = SPEC_SCHEMA, old: Any = None) -> list[str]:
    """Messages of the rules `new` breaks (transition rules only where `old` is given, as the
    API server evaluates them on updates of a value that existed)."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        if not _run(rule["rule"], new, old if transition else None):
            out.append(rule["message"])
    if isinstance(new, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in new:
                out += violations(new[name], sub, old.get(name) if isinstance(old, dict) else None)
    elif isinstance(new, list) and "items" in schema:
        for item in new:  # list items have no oldSelf unless keyed; none of ours relies on it
            out += violations(item, schema["items"])
    return out


def with_change(path: str, value: Any, base: dict[str, Any] = BASE) -> dict[str, Any]:
    """A copy of `base` with one field set: `path` is dotted, list indices as numbers."""
    data = copy.deepcopy(base)
    node: Any = data
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[keys[-1]] = value
    return data


def pydantic_refuses(spec: dict[str, Any]) -> bool:
    try:
        RLJobSpec.model_validate(spec)
    except ValidationError:
        return True
    return False


def test_the_base_job_passes_both() -> None:
    assert not pydantic_refuses(BASE)
    assert violations(admit(BASE, SPEC_SCHEMA)) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_jobs_pass_every_rule(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert violations(admit(doc["spec"], SPEC_SCHEMA)) == [], path.name


# (field, value that breaks one rule, the rule's message, a value on the good side of it);
# a field written `context:field` is set on a copy of BASE with `context` (field=value) first.
CASES = [
    ("stages.1.microBatchSize", 6, "microBatchSize must divide batchSize", 4),
    ("stages.1.rl.groupSize", 6, "batchSize must be a multiple of rl.groupSize", 4),
    ("stages.1.rl", {}, None, None),  # the default group size (8) divides 16: both accept
    ("stages.0.tasks", [], "tasks: an sft or opd stage names the task sets it trains on", ["train"]),
    # An rl stage may train on outside episodes alone, with the endpoint they come through.
    ("rollout.openaiPort=8000:stages.1.tasks", [], None, []),
    ("rollout.replicas", 5, "replicas must be within autoscale's minReplicas and maxReplicas", 4),
    ("rollout.autoscale.maxReplicas", 0, None, 2),  # below minReplicas: refused by the bound too
    ("rollout.replicas=0:rollout.autoscale", {"minReplicas": 3, "maxReplicas": 2},
     "maxReplicas must be at least minReplicas", None),
    ("rollout.sampling.temperature", 2.5, "vLLM samples at most at temperature 2: lower "
     "sampling.temperature, or use engine 'megatron'", 2),
    ("rollout.sampling.toolChoiceTemperature", 1.0, "sampling.toolChoiceTemperature needs a "
     "sampling temperature above 0 and toolCallFormat 'tags'", None),
    ("rollout.toolCallFormat=tags:rollout.thinking", "turn-level", "thinking 'turn-level' needs a chat-template "
     "toolCallFormat (hermes, llama3 or auto)", "preserved"),
    ("rollout.openaiPort", 50051, "openaiPort must not be one of the ports Kiln's pods use "
     "(9090, 29500, 50050, 50051)", 50052),
    ("sandbox.rootfs", "/srv/rootfs", "rootfs applies to the bubblewrap backend; use image with "
     "docker", None),
    ("tasks.0.toolLatency.p99Seconds", 0.5, "p99Seconds must be at least p50Seconds", 1),
    ("rollout.pod.volumeMounts.0.name", "other",
     "every volumeMounts[].name must be one of volumes[].name", "data"),
    ("tasks.0.path", "tasks/t.jsonl", "exactly one of path, source or generate must be set", None),
    ("tasks", [{"name": "train", "env": "chain", "source": {
        "configMap": {"name": "team-tasks", "key": "t.jsonl"}, "hfDataset": {"id": "org/ds"}}}],
     "exactly one of path, configMap, pvc, image or hfDataset must be set",
     [{"name": "train", "env": "chain", "source": {"hfDataset": {"id": "org/ds"}}}]),
    ("tasks", [{"name": "train", "env": "chain", "source": {}}],
     "exactly one of path, configMap, pvc, image or hfDataset must be set",
     [{"name": "train", "env": "chain", "source": {"pvc": {"claim": "d", "path": "t.jsonl"}}}]),
    ("output", {"pvc": {"claim": "out"}, "uri": "s3://bucket/runs"},
     "exactly one of pvc or uri must be set", {"uri": "s3://bucket/runs"}),
    ("output", {"pvc": {"claim": "out"}, "endpoint": "http://127.0.0.1:9000"},
     "endpoint and credentialsSecret: only with uri (an S3 location), not with pvc",
     {"pvc": {"claim": "out"}}),
]


@pytest.mark.parametrize("path, bad, message, good", CASES, ids=[c[0] for c in CASES])
def test_each_rule_refuses_what_pydantic_refuses(path: str, bad: Any, message: str | None,
                                                 good: Any) -> None:
    base = BASE
    if ":" in path:
        context, path = path.split(":")
        field, value = context.split("=")
        base = with_change(field, int(value) if value.isdigit() else value)
    broken = with_change(path, bad, base)
    if message is not None:
        found = violations(admit(broken, SPEC_SCHEMA))
        # maxReplicas below minReplicas leaves no replica count within them either.
        assert found == [message] or (message.startswith("maxReplicas") and message in found)
        assert pydantic_refuses(broken), f"pydantic accepts what CEL refuses ({path}={bad!r})"
    if good is not None:
        fine = with_change(path, good, base)
        assert violations(admit(fine, SPEC_SCHEMA)) == []
        assert not pydantic_refuses(fine), f"pydantic refuses what CEL accepts ({path}={good!r})"
    if path == "rollout.sampling.toolChoiceTemperature":
        # The other side of the same rule: tags format, a temperature above 0.
        fine = with_change("rollout.toolCallFormat", "tags", broken)
        assert violations(admit(fine, SPEC_SCHEMA)) == [] and not pydantic_refuses(fine)
        cold = with_change("rollout.sampling.temperature", 0, fine)
        assert violations(admit(cold, SPEC_SCHEMA)) and pydantic_refuses(cold)


def test_every_rule_has_a_case() -> None:
    messages = {m for rules in RULES.values() for _rule, m in rules}
    assert messages == {c[2] for c in CASES if c[2]}


# (field, new value) of a running job, both refused; then one change both take
IMMUTABLE_CASES = [
    ("model.path", "models/other"),
    ("model.pvc", "models"),
    ("model.dtype", "float32"),
    ("trainer.tensorParallel", 2),
    ("trainer.dataParallel", 2),
    ("trainer.pipelineParallel", 2),
    ("buffer.storage.storageClass", "fast"),
    ("checkpoints.storage.storageClass", "fast"),
    ("managedBy", "kueue.x-k8s.io/multikueue"),
]


@pytest.mark.parametrize("path, value", IMMUTABLE_CASES, ids=[c[0] for c in IMMUTABLE_CASES])
def test_transition_rules_refuse_what_the_operator_refuses(path: str, value: Any) -> None:
    old, new = BASE, with_change(path, value)
    assert len(violations(admit(new, SPEC_SCHEMA), old=admit(old, SPEC_SCHEMA))) == 1
    assert children.immutable_changes(RLJobSpec.model_validate(old), RLJobSpec.model_validate(new))
    # Written at creation and left out later is a change too (the default comes back).
    if path != "model.path":
        assert violations(admit(old, SPEC_SCHEMA), old=admit(new, SPEC_SCHEMA))


def test_every_immutable_field_has_a_case() -> None:
    # The model's fields share one rule (`self.model == oldSelf.model`): two of them stand in.
    covered = {tuple(p.split(".")) for p, _ in IMMUTABLE_CASES}
    assert {f for f in IMMUTABLE_FIELDS if f[0] != "model"} <= covered
    assert {f for f in IMMUTABLE_FIELDS if f[0] == "model"} >= {("model", "path"), ("model", "pvc")}


def test_mutable_changes_pass_transition_rules() -> None:
    old = admit(BASE, SPEC_SCHEMA)
    for path, value in [("rollout.replicas", 3), ("suspend", True), ("activeDeadlineSeconds", 60),
                        ("trainer.checkpointInterval", 5), ("managedBy", None)]:
        new = with_change(path, value)
        if value is None:
            new.pop(path)
        assert violations(admit(new, SPEC_SCHEMA), old=old) == [], path
        assert children.immutable_changes(RLJobSpec.model_validate(BASE),
                                          RLJobSpec.model_validate(new)) == []


def test_keyed_lists_are_the_lists_whose_keys_pydantic_holds_unique() -> None:
    props = SCHEMA["properties"]
    for node, key in [(props["spec"]["properties"]["tasks"], "name"),
                      (props["spec"]["properties"]["stages"], "name"),
                      (props["status"]["properties"]["conditions"], "type")]:
        assert node["x-kubernetes-list-type"] == "map"
        assert node["x-kubernetes-list-map-keys"] == [key]
        assert key in node["items"]["required"]
    twice = copy.deepcopy(BASE)
    twice["stages"].append({**twice["stages"][1]})
    assert pydantic_refuses(twice)
    twice = copy.deepcopy(BASE)
    twice["tasks"].append({**twice["tasks"][0]})
    assert pydantic_refuses(twice)


def test_conditions_are_metav1_conditions() -> None:
    item = SCHEMA["properties"]["status"]["properties"]["conditions"]["items"]
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert item["properties"]["observedGeneration"]["type"] == "integer"
