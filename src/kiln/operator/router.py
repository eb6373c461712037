"""The rollout fleet's router on a cluster (`spec.rollout.openaiPort`): the one door of the
OpenAI endpoint, in front of every rollout pod (`kiln.services.rollout.router`).

- Deployment `<job>-router` (2 pods: it keeps no state, since episode ids name the rollout pod
  that serves them, so either pod routes any call), running
  `python -m kiln.services.rollout.router_main`: listens on `openaiPort`, finds the rollout pods
  by the A records of the rollout's headless Service (looked up again every second, so scaling
  and restarts show at once), checks the API keys (the same Secret, mounted here too) and
  exports its metrics on the metrics port. Ready only while some rollout pod serves.
- Service `<job>-openai`: what outside agents connect to (`openaiPort` -> the router pods).
- NetworkPolicy: the router's port admits `rollout.openai.allowedPeers` (or the labelled pods
  of the namespace); the rollout pods' own OpenAI port admits the router pods alone
  (`kiln.operator.children.network_policy`).

The router speaks plain HTTP to the rollout pods, as the endpoint does to its callers: the
endpoint's trust is its API keys (checked by the router and again by the rollout pod, which
binds each episode to its key), not mTLS.
"""
from __future__ import annotations

from typing import Any

from kiln.api.openai_endpoint import KEYS_DIR, KEYS_ENV
from kiln.api.spec import RLJobSpec
from kiln.operator import naming
from kiln.operator.naming import METRICS_PORT, JobRef
from kiln.operator.pods import SERVICE_UID, service_security

COMPONENT = "router"
SERVICE = "openai"
REPLICAS = 2


def _pod(job: JobRef, spec: RLJobSpec, port: int) -> dict[str, Any]:
    rollout_dns = f"{job.child('rollout')}.{job.namespace}.svc"
    container = {
        "name": COMPONENT,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "kiln.services.rollout.router_main"],
        "args": ["--host", "0.0.0.0", "--port", str(port), "--discover-dns", f"{rollout_dns}:{port}",
                 "--metrics-port", str(METRICS_PORT)],
        "env": [{"name": KEYS_ENV, "value": KEYS_DIR}, {"name": "KILN_COMPONENT", "value": COMPONENT}],
        "ports": [{"name": "openai", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # Ready while a rollout pod serves (its /healthz says so); alive while it listens.
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "openai"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "openai"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"cpu": "2", "memory": "512Mi"}},
        "volumeMounts": [{"name": "openai-keys", "mountPath": KEYS_DIR, "readOnly": True}],
        "securityContext": service_security(),
    }
    return {
        "metadata": {"labels": naming.labels(job, COMPONENT, spec.image),
                     "annotations": {"prometheus.io/scrape": "true",
                                     "prometheus.io/port": str(METRICS_PORT)}},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 10,
            # Group-readable keys: root's files, the router runs as SERVICE_UID in fsGroup.
            "securityContext": {"fsGroup": SERVICE_UID},
            "containers": [container],
            "volumes": [{"name": "openai-keys", "secret": {
                "secretName": spec.rollout.openai.api_key_secret or "", "defaultMode": 0o440}}],
        },
    }


def children(job: JobRef, spec: RLJobSpec, *, active: bool,
             peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The router's Deployment, Service and NetworkPolicy (`peers`: who may connect, as
    `children.openai_peers` makes them); none without `openaiPort`."""
    port = spec.rollout.openai_port
    if not port:
        return []
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(job, COMPONENT, spec.image),
        "spec": {"replicas": REPLICAS if active else 0,
                 "selector": {"matchLabels": naming.selector_labels(job, COMPONENT)},
                 "template": _pod(job, spec, port)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(job, COMPONENT, spec.image, name=job.child(SERVICE)),
        "spec": {"selector": naming.selector_labels(job, COMPONENT),
                 "ports": [{"name": "openai", "port": port, "targetPort": "openai",
                            "protocol": "TCP", "appProtocol": "http"}]},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(job, COMPONENT, spec.image),
        "spec": {"podSelector": {"matchLabels": naming.selector_labels(job, COMPONENT)},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"port": port, "protocol": "TCP"}]},
                             {"ports": [{"port": METRICS_PORT, "protocol": "TCP"}]}]},
    }
    return [deployment, service, policy]


def router_pods(job: JobRef) -> dict[str, Any]:
    """The NetworkPolicy peer of the router's pods (the rollout pods' OpenAI port admits them)."""
    return {"podSelector": {"matchLabels": naming.selector_labels(job, COMPONENT)}}


def stale(job: JobRef, previous: RLJobSpec, spec: RLJobSpec) -> list[dict[str, Any]]:
    """The router's children when an edit removed `openaiPort`."""
    if not previous.rollout.openai_port or spec.rollout.openai_port:
        return []
    return [{"apiVersion": api, "kind": kind, "metadata": {"name": name, "namespace": job.namespace}}
            for api, kind, name in (("apps/v1", "Deployment", job.child(COMPONENT)),
                                    ("v1", "Service", job.child(SERVICE)),
                                    ("networking.k8s.io/v1", "NetworkPolicy", job.child(COMPONENT)))]
