"""The desired children of an RLJob, computed from its spec by pure functions.

`desired_children(job, spec)` returns every manifest the operator applies, in apply order: the
ConfigMap holding the resolved job file the services read (`--job /etc/kiln/job.yaml`), the
checkpoints and buffer PersistentVolumeClaims, one Service per component, the workloads
(built in `kiln.operator.workloads`), the job's frozen deployments (`kiln.operator.frozen`) and
a NetworkPolicy per component. Nothing here talks to a cluster, so the unit tests
validate these manifests against the Kubernetes schemas directly.

Which spec changes restart which component is decided here too: each component's pod template
carries a hash of the spec sections it reads (`component_hashes`); live settings (replica
counts, `suspend`) are left out, so scaling never restarts a pod.

Not covered: applying, diffing or deleting objects (`kiln.operator.reconcile`).
"""
from __future__ import annotations

from typing import Any

import yaml

from kiln.api import rules
from kiln.api.spec import API_GROUP, API_VERSION, KIND, RLJobSpec, StorageSpec
from kiln.api.openai_endpoint import CLIENT_LABEL
from kiln.operator import frozen, naming, router
from kiln.operator.naming import GRPC_PORT, METRICS_PORT, JobRef
from kiln.operator.pods import HEALTH_PORT
from kiln.operator.workloads import TRAINER_REPLICAS, SandboxHosting, workloads

JOB_FILE_KEY = "job.yaml"

# Spec sections (wire names) each component reads from the job file. A change to any of them
# restarts that component; a change elsewhere leaves it running.
SECTIONS: dict[str, tuple[str, ...]] = {
    "trainer": ("model", "tasks", "stages", "trainer", "checkpoints", "seed"),
    "rollout": ("model", "tasks", "stages", "rollout", "seed"),
    "sandbox": ("tasks", "sandbox", "seed"),
    "weight-sync": ("model", "weightSync"),
    "buffer": ("stages", "buffer"),
}
# Settings applied without a restart: (section, field) of a Deployment's replica count.
LIVE_FIELDS: dict[str, tuple[str, str]] = {
    "rollout": ("rollout", "replicas"),
    "sandbox": ("sandbox", "replicas"),
}

# Fields a running job cannot change (the CRD's transition rules say the same).
IMMUTABLE_FIELDS = rules.IMMUTABLE_FIELDS

# Services with one address per pod: weight-sync must reach every rollout replica, and gRPC's
# long-lived connections are only balanced when the client sees every pod.
HEADLESS = {"trainer", "rollout", "sandbox"}


def resolved_spec(spec: RLJobSpec) -> dict[str, Any]:
    """The spec with every default filled in, as the services will read it."""
    return spec.model_dump(by_alias=True, mode="json")


def job_file(job: JobRef, spec: RLJobSpec) -> str:
    document = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": without_pod_settings(resolved_spec(spec)),
    }
    return yaml.safe_dump(document, sort_keys=False)


def without_pod_settings(resolved: dict[str, Any]) -> dict[str, Any]:
    """The spec less each component's `pod` section: the services do not read it, and its env
    values (which may be secrets written inline) stay out of the ConfigMap."""
    return {key: ({k: v for k, v in value.items() if k != "pod"} if isinstance(value, dict)
                  and "pod" in value else value) for key, value in resolved.items()}


def component_hashes(spec: RLJobSpec) -> dict[str, str]:
    resolved = resolved_spec(spec)
    out = {}
    for component, sections in SECTIONS.items():
        parts = {key: resolved[key] for key in sections}
        if component in LIVE_FIELDS:
            section, field = LIVE_FIELDS[component]
            parts[section] = {k: v for k, v in parts[section].items() if k != field}
        out[component] = naming.config_hash(parts)
    return out


def immutable_changes(old: RLJobSpec, new: RLJobSpec) -> list[str]:
    """Messages naming each immutable field that differs between two specs."""
    a, b = resolved_spec(old), resolved_spec(new)
    changes = []
    for path in IMMUTABLE_FIELDS:
        va, vb = _dig(a, path), _dig(b, path)
        if va != vb:
            changes.append(f"spec.{'.'.join(path)} cannot change on a running job "
                           f"(was {va!r}, now {vb!r}); restore it, or create a new RLJob")
    return changes


def _dig(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def config_map(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": naming.metadata(job, "config", spec.image),
        "data": {JOB_FILE_KEY: job_file(job, spec)},
    }


def pvc(job: JobRef, component: str, storage: StorageSpec, image: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class is not None:
        spec["storageClassName"] = storage.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        # The creating job's uid: a later job of the same name does not adopt it (adoption.py).
        "metadata": {**naming.metadata(job, component, image),
                     "annotations": {naming.JOB_UID: job.uid}},
        "spec": spec,
    }


def service(job: JobRef, component: str, image: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": naming.selector_labels(job, component),
        "ports": [
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
             "appProtocol": "grpc"},
            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
        ],
    }
    if component in HEADLESS:
        spec["clusterIP"] = "None"
        # Peers find each other before they report ready (the trainer waits for the buffer).
        spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(job, component, image),
        "spec": spec,
    }


# Who connects to each component's gRPC port (the services' authorization table,
# kiln.services.common.tls.CALLERS, checks each RPC on top; a test keeps the two in step).
# "operator" is the Kiln operator's pod, in whatever namespace the chart put it.
GRPC_CLIENTS: dict[str, tuple[str, ...]] = {
    # teacher: a frozen deployment fetching a stage's weights.
    "trainer": ("operator", "teacher"),
    "rollout": ("operator", "rollout"),  # rollout: a teacher's Score
    "sandbox": ("rollout",),
    "weight-sync": ("trainer", "rollout", "operator"),
    "buffer": ("trainer", "rollout", "operator"),
}
OPERATOR_PODS = {"app.kubernetes.io/part-of": "kiln", "app.kubernetes.io/component": "operator"}


def _job_pods(job: JobRef, components: list[str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": job.name},
                            "matchExpressions": [{"key": "app.kubernetes.io/component",
                                                  "operator": "In", "values": components}]}}


def openai_peers(spec: RLJobSpec) -> list[dict[str, Any]]:
    """Who may reach the OpenAI endpoint: the job's `allowedPeers`, or by default the pods of
    the job's namespace labelled `kiln.dev/openai-client: "true"` (never "anyone")."""
    peers = spec.rollout.openai.allowed_peers
    if not peers:
        return [{"podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}}]
    out: list[dict[str, Any]] = []
    for p in peers:
        if p.cidr is not None:
            out.append({"ipBlock": {"cidr": p.cidr}})
        elif p.namespace_labels is None:
            out.append({"podSelector": {"matchLabels": dict(p.pod_labels)}})
        else:
            out.append({"namespaceSelector": {"matchLabels": dict(p.namespace_labels)},
                        "podSelector": {"matchLabels": dict(p.pod_labels)}})
    return out


def network_policy(job: JobRef, spec: RLJobSpec, component: str) -> dict[str, Any]:
    """Ingress to `component`'s pods: gRPC from its clients only; health and metrics from
    anywhere (kubelet probes, Prometheus); the rollout's OpenAI port, when asked for, from the
    router's pods only (which admit `rollout.openai.allowedPeers`: `openai_peers`, `router.py`);
    between the trainer's ranks (replica 0 and the data-parallel replicas), every port: gloo and NCCL connect each rank to every other on ports of their own."""
    clients = frozen.CLIENTS if component in frozen.components(spec) else GRPC_CLIENTS[component]
    pods = [c for c in clients if c != "operator"]
    if component == "trainer":
        # Its teacher callers are the frozen deployments' pods (`frozen.py`), if any.
        pods = [c for c in pods if c != "teacher"] + frozen.fetching(spec)
    peers: list[dict[str, Any]] = []
    if "operator" in clients:
        peers.append({"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_PODS}})
    if pods:
        peers.append(_job_pods(job, pods))
    rules: list[dict[str, Any]] = [
        {"from": peers, "ports": [{"port": GRPC_PORT, "protocol": "TCP"}]},
        {"ports": [{"port": HEALTH_PORT, "protocol": "TCP"}, {"port": METRICS_PORT, "protocol": "TCP"}]},
    ]
    selector: dict[str, Any] = {"matchLabels": naming.selector_labels(job, component)}
    if component == "trainer":
        ranks = _job_pods(job, ["trainer", TRAINER_REPLICAS])
        selector = ranks["podSelector"]
        rules.append({"from": [ranks]})
    if component == "rollout" and spec.rollout.openai_port:
        # Outside agents reach the endpoint through the router (`router.py`) alone.
        rules.append({"from": [router.router_pods(job)],
                      "ports": [{"port": spec.rollout.openai_port, "protocol": "TCP"}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(job, component, spec.image),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": rules},
    }


def pvcs(job: JobRef, spec: RLJobSpec) -> list[dict[str, Any]]:
    return [
        pvc(job, "checkpoints", spec.checkpoints.storage, spec.image),
        pvc(job, "buffer", spec.buffer.storage, spec.image),
    ]


def retained_pvc_names(job: JobRef, spec: RLJobSpec) -> dict[str, bool]:
    """PVC name -> whether it outlives the RLJob (spec.*.storage.retain)."""
    return {
        job.child("checkpoints"): spec.checkpoints.storage.retain,
        job.child("buffer"): spec.buffer.storage.retain,
    }


def desired_children(job: JobRef, spec: RLJobSpec, *, active: bool = True,
                     hosting: SandboxHosting = SandboxHosting(),
                     ca_fingerprint: str = "", finished_stages: list[str] = ()) -> list[dict[str, Any]]:
    """Every child manifest, in apply order. `active=False` scales all workloads to zero.
    `ca_fingerprint` (of the job's CA, `tls.py`) joins every pod's config hash: pods restart
    onto a new CA. `finished_stages` (the status's): which stages' frozen deployments can run."""
    hashes = component_hashes(spec)
    if ca_fingerprint:
        hashes = {c: naming.config_hash({"spec": h, "ca": ca_fingerprint}) for c, h in hashes.items()}
    frozen_services, frozen_rest = frozen.children(job, spec, hashes["rollout"], active=active,
                                                   finished_stages=finished_stages)
    return [
        config_map(job, spec),
        *pvcs(job, spec),
        *(service(job, c, spec.image) for c in naming.COMPONENTS),
        *frozen_services,
        *workloads(job, spec, hashes, active=active, hosting=hosting,
                   frozen_addresses=frozen.addresses(job, spec)),
        *frozen_rest,
        *(network_policy(job, spec, c) for c in (*naming.COMPONENTS, *frozen.components(spec))),
        *router.children(job, spec, active=active, peers=openai_peers(spec)),
    ]
