"""An RLJob as the operator tests give it: the job's reference (name, namespace, uid), two
specs -- `SMALL`, the least a job needs, and `FULL`, everything optional switched on (GPUs, a
model PVC, docker sandboxes, storage classes, trainer pod settings, data-parallel replicas) --
with `spec` to build either with changes, and `by_name` and `workload` to find a child among
the operator's manifests."""
from __future__ import annotations

import copy
from typing import Any

from kiln.api.spec import RLJobSpec
from kiln.operator.naming import JobRef

JOB = JobRef(name="demo", namespace="team-a", uid="0f5c2b9e-1111-2222-3333-444455556666")

SMALL: dict[str, Any] = {
    "model": {"path": "models/tiny"},
    "tasks": [{"name": "train", "env": "chain", "generate": {"count": 8}}],
    "stages": [{"name": "rl", "type": "rl", "tasks": ["train"], "batchSize": 8,
                "microBatchSize": 8, "rl": {"groupSize": 8}}],
}
# Everything optional switched on: GPUs, a model PVC, docker sandboxes, storage classes.
FULL: dict[str, Any] = {
    **SMALL,
    "model": {"path": "qwen/7b", "pvc": "models"},
    "rollout": {"replicas": 4, "resources": {"cpu": "8", "memory": "64Gi", "gpu": 1},
                "openaiPort": 8000, "openai": {"apiKeySecret": "agents"}},
    "trainer": {"tensorParallel": 2, "dataParallel": 3,
                "resources": {"cpu": "16", "memory": "128Gi", "gpu": 2},
                "pod": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                         "effect": "NoSchedule"}],
                        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [
                                {"key": "pool", "operator": "In", "values": ["train"]}]}]}}},
                        "imagePullSecrets": ["registry"],
                        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                            "name": "hf", "key": "token"}}}, {"name": "NCCL_DEBUG", "value": "WARN"}],
                        "envFrom": [{"secretRef": {"name": "wandb"}}],
                        "priorityClassName": "training", "serviceAccountName": "kiln-trainer",
                        "labels": {"team": "rl"}, "annotations": {"owner": "rl-team"}}},
    "sandbox": {"backend": "docker", "image": "python:3.12-slim", "cpu": 0.5, "memory": "1Gi",
                "maxConcurrent": 16, "replicas": 2},
    "buffer": {"storage": {"size": "20Gi", "storageClass": "fast", "retain": False}},
    "checkpoints": {"storage": {"size": "200Gi", "storageClass": "fast"}},
    "image": "registry.example.com/kiln:0.1.0",
}


def spec(data: dict[str, Any], **changes: Any) -> RLJobSpec:
    data = copy.deepcopy(data)
    for path, value in changes.items():
        node = data
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return RLJobSpec.model_validate(data)


def by_name(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def workload(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    kind = "StatefulSet" if component == "trainer" else "Deployment"
    return by_name(objs)[f"{kind}/demo-{component}"]
