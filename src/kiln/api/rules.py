"""The RLJob rules the API server checks itself, at admission, written into the generated CRD.

- CEL rules (`x-kubernetes-validations`) for the cross-field checks of the pydantic models that
  CEL can state cheaply (no rule walks a list inside a list: the API server refuses a CRD whose
  rules' estimated cost is unbounded); each mirrors a `model_validator` and tests hold the two
  to the same verdicts (tests/unit/test_crd_rules.py);
- transition rules (`oldSelf`) for the fields a running job cannot change (`IMMUTABLE_FIELDS`,
  which the operator also refuses, for an API server without CEL and for the job's accepted
  spec);
- lists keyed by a field (`x-kubernetes-list-type: map`): task sets and stages by name (each
  name once), conditions by type.

What is not here: rules over lists (stage references to task sets, unique names of other lists,
teachers), over quantities (`pod.shmSize` within `resources.memory`) and whatever needs files
or the cluster; `kiln validate` and the operator check those with the same pydantic models.
"""
from __future__ import annotations

from typing import Any

from kiln.api.model import ModelSpec
from kiln.api.ports import RESERVED as RESERVED_PORTS
from kiln.api.rl import RLSettings
from kiln.api.sampling import VLLM_MAX_TEMPERATURE

_MODEL = tuple(("model", f.alias or name) for name, f in ModelSpec.model_fields.items())

IMMUTABLE_FIELDS: tuple[tuple[str, ...], ...] = (
    *_MODEL,
    ("trainer", "tensorParallel"),
    ("trainer", "dataParallel"),
    ("trainer", "pipelineParallel"),
    ("buffer", "storage", "storageClass"),
    ("checkpoints", "storage", "storageClass"),
    ("managedBy",),
)
"""Fields of `spec` a job cannot change once created: the model (every field of it), and what
the checkpoints' layout depends on (and the controller that runs it, `managedBy`)."""

# Defaults of the immutable fields that may be left out (the API server fills in the defaults
# its schema declares, but not inside an object the manifest leaves out).
_ABSENT = {("trainer", "tensorParallel"): "1", ("trainer", "dataParallel"): "1",
           ("trainer", "pipelineParallel"): "1", ("buffer", "storage", "storageClass"): "''",
           ("checkpoints", "storage", "storageClass"): "''", ("managedBy",): "''"}

_POD = ("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
        "self.volumes.exists(v, v.name == m.name))",
        "every volumeMounts[].name must be one of volumes[].name")
_GROUP = RLSettings.model_fields["group_size"].default


def _exactly_one(*fields: str) -> str:
    """CEL: exactly one of `fields` of `self` is given (a sum, not a list filter: cheap to
    estimate)."""
    return " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields) + " == 1"

RULES: dict[tuple[str, ...], list[tuple[str, str]]] = {
    ("spec", "stages", "[]"): [
        ("self.batchSize % self.microBatchSize == 0", "microBatchSize must divide batchSize"),
        (f"self.type == 'sft' || self.batchSize % (has(self.rl) ? self.rl.groupSize : {_GROUP}) == 0",
         "batchSize must be a multiple of rl.groupSize"),
        ("self.type == 'rl' || (has(self.tasks) && size(self.tasks) > 0)",
         "tasks: an sft or opd stage names the task sets it trains on"),
    ],
    ("spec", "rollout"): [
        ("!has(self.autoscale) || (self.replicas >= self.autoscale.minReplicas && "
         "self.replicas <= self.autoscale.maxReplicas)",
         "replicas must be within autoscale's minReplicas and maxReplicas"),
        (f"self.engine != 'vllm' || !has(self.sampling) || "
         f"self.sampling.temperature <= {VLLM_MAX_TEMPERATURE!r}",
         f"vLLM samples at most at temperature {VLLM_MAX_TEMPERATURE:g}: lower "
         "sampling.temperature, or use engine 'megatron'"),
        ("!has(self.sampling) || !has(self.sampling.toolChoiceTemperature) || "
         "(self.sampling.temperature > 0.0 && self.toolCallFormat == 'tags')",
         "sampling.toolChoiceTemperature needs a sampling temperature above 0 and "
         "toolCallFormat 'tags'"),
        ("!(self.thinking == 'turn-level' && self.toolCallFormat == 'tags')",
         "thinking 'turn-level' needs a chat-template toolCallFormat (hermes, llama3 or auto)"),
        ("!has(self.openaiPort) || !(self.openaiPort in "
         f"[{', '.join(str(p) for p in sorted(RESERVED_PORTS))}])",
         "openaiPort must not be one of the ports Kiln's pods use "
         f"({', '.join(str(p) for p in sorted(RESERVED_PORTS))})"),
    ],
    ("spec", "rollout", "autoscale"): [
        ("self.maxReplicas >= self.minReplicas", "maxReplicas must be at least minReplicas"),
    ],
    ("spec", "sandbox"): [
        ("self.backend != 'docker' || !has(self.rootfs)",
         "rootfs applies to the bubblewrap backend; use image with docker"),
    ],
    ("spec", "tasks", "[]"): [
        (_exactly_one("path", "source", "generate"),
         "exactly one of path, source or generate must be set"),
    ],
    ("spec", "tasks", "[]", "source"): [
        (_exactly_one("path", "configMap", "pvc", "image", "hfDataset"),
         "exactly one of path, configMap, pvc, image or hfDataset must be set"),
    ],
    ("spec", "output"): [
        (_exactly_one("pvc", "uri"), "exactly one of pvc or uri must be set"),
        ("has(self.uri) || !(has(self.endpoint) || has(self.credentialsSecret))",
         "endpoint and credentialsSecret: only with uri (an S3 location), not with pvc"),
    ],
    ("spec", "tasks", "[]", "toolLatency"): [
        ("self.p99Seconds >= self.p50Seconds", "p99Seconds must be at least p50Seconds"),
    ],
    **{("spec", component, "pod"): [_POD]
       for component in ("rollout", "trainer", "sandbox", "weightSync", "buffer")},
}
"""Schema location -> (CEL rule, message) pairs; `self` is the object at that location."""

LIST_KEYS: dict[tuple[str, ...], str] = {
    ("spec", "tasks"): "name",
    ("spec", "stages"): "name",
    ("status", "conditions"): "type",
}
"""Lists whose items are keyed by one field (each key once; server-side apply merges by it)."""


def _value(root: str, path: tuple[str, ...]) -> str:
    """The field at `path` under `root` in CEL, its default when it or an object above it is
    left out."""
    if path not in _ABSENT:
        return ".".join((root, *path))
    present = " && ".join(f"has({'.'.join((root, *path[:i + 1]))})" for i in range(len(path)))
    return f"({present} ? {'.'.join((root, *path))} : {_ABSENT[path]})"


def immutability_rules() -> list[tuple[str, str]]:
    """One transition rule per immutable field, on `spec` (so that a field left out at creation
    and written later, or the other way round, counts as a change, as the operator sees it)."""
    # The model in one rule: `spec.model` is required, so it is always there to compare.
    return [("self.model == oldSelf.model",
             "spec.model cannot change once the job is created; create a new RLJob")] + [
        (f"{_value('self', path)} == {_value('oldSelf', path)}",
         f"spec.{'.'.join(path)} cannot change once the job is created; create a new RLJob")
        for path in IMMUTABLE_FIELDS if path not in _MODEL]


def _node(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        schema = schema["items"] if key == "[]" else schema["properties"][key]
    return schema


def add_rules(root: dict[str, Any]) -> dict[str, Any]:
    """Write the rules and list keys into the CRD's openAPIV3Schema (`root`, changed in place)."""
    for path, rules in RULES.items():
        _node(root, path).setdefault("x-kubernetes-validations", []).extend(
            {"rule": rule, "message": message} for rule, message in rules)
    _node(root, ("spec",)).setdefault("x-kubernetes-validations", []).extend(
        {"rule": rule, "message": message} for rule, message in immutability_rules())
    for path, key in LIST_KEYS.items():
        node = _node(root, path)
        node["x-kubernetes-list-type"] = "map"
        node["x-kubernetes-list-map-keys"] = [key]
    return root
