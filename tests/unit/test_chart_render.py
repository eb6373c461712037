"""The Helm chart, rendered by the real helm binary and checked against the Kubernetes schemas.

`helm lint --strict` and `helm template` run offline; every built-in object is validated with
kubernetes-validate (custom resources are checked for their required fields here, and the
PrometheusRule contents by promtool in tests/integration/test_chart_prometheus.py).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kiln.api.crd import build_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kiln"
HELM = ROOT / ".tools" / "bin" / "helm"
K8S_VERSION = "1.30.0"
ALL_ON = ["--set", "prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
          "--set", "metrics.podMonitor.enabled=true"]

pytestmark = pytest.mark.skipif(not HELM.exists(), reason=f"helm not installed at {HELM} (deploy/setup.sh)")


def helm(*args: str) -> str:
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def render(*extra: str) -> list[dict[str, Any]]:
    out = helm("template", "kiln", str(CHART), "--namespace", "kiln-system", "--include-crds", *extra)
    return [d for d in yaml.safe_load_all(out) if d]


def kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("extra", [[], ALL_ON, [*ALL_ON, "--set", "operator.watchNamespaces={team-a,team-b}"]],
                         ids=["defaults", "monitoring", "namespaced"])
def test_lint_strict_passes(extra: list[str]) -> None:
    out = helm("lint", "--strict", str(CHART), *extra)
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("extra", [[], ALL_ON, [*ALL_ON, "--set", "operator.watchNamespaces={team-a,team-b}"]],
                         ids=["defaults", "monitoring", "namespaced"])
def test_rendered_objects_pass_kubernetes_validation(extra: list[str]) -> None:
    docs = render(*extra)
    custom = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    for doc in docs:
        if doc["kind"] in custom:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        labels = doc["metadata"].get("labels", {})
        if doc["kind"] != "CustomResourceDefinition":
            assert labels["app.kubernetes.io/instance"] == "kiln", doc["kind"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_chart_ships_the_generated_crd() -> None:
    (crd,) = kinds(render())["CustomResourceDefinition"]
    assert crd == build_crd()


def test_operator_deployment_runs_kiln_operator_with_liveness_and_metrics() -> None:
    by_kind = kinds(render("--set", "operator.statusInterval=7"))
    (dep,) = by_kind["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/kiln-dev/kiln-operator:0.1.0"
    assert c["command"] == ["kiln-operator"]
    assert "--all-namespaces" in c["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "KILN_OPERATOR_STATUS_INTERVAL", "value": "7"} in c["env"]
    assert pod["serviceAccountName"] == "kiln"
    (svc,) = by_kind["Service"]
    assert svc["spec"]["ports"][0]["name"] == "metrics"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege_cluster_wide_or_per_namespace() -> None:
    cluster = _rules(kinds(render())["ClusterRole"][0])
    assert cluster[("kiln.dev", "rljobs/status")] == {"get", "patch", "update"}
    assert cluster[("", "persistentvolumeclaims")] == {"get", "create", "patch", "delete"}
    # delete: the children of frozen deployments an edited job no longer names.
    assert cluster[("apps", "deployments")] == {"get", "create", "patch", "delete"}
    assert cluster[("apps", "statefulsets")] == {"get", "create", "patch"}
    assert cluster[("", "namespaces")] == {"get", "list", "watch"}
    assert not any("*" in verbs for verbs in cluster.values())
    # Secrets: the jobs' certificates, read and written by name only (no list, watch or delete:
    # the operator never browses other Secrets; owner references delete its own).
    assert cluster[("", "secrets")] == {"get", "create", "patch"}
    assert ("", "pods") not in cluster

    by_kind = kinds(render("--set", "operator.watchNamespaces={team-a,team-b}"))
    assert _rules(by_kind["ClusterRole"][0]) == {("", "namespaces"): {"get", "list", "watch"}}
    assert sorted(r["metadata"]["namespace"] for r in by_kind["Role"]) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind["RoleBinding"]) == ["team-a", "team-b"]
    assert _rules(by_kind["Role"][0])[("kiln.dev", "rljobs")] == {"get", "list", "watch", "patch", "update"}
    args = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


def test_no_rbac_and_no_service_account_when_disabled() -> None:
    by_kind = kinds(render("--set", "rbac.create=false", "--set", "serviceAccount.create=false",
                           "--set", "serviceAccount.name=existing"))
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"} & set(by_kind)
    assert by_kind["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_dashboard_configmap_holds_the_dashboard() -> None:
    (cm,) = kinds(render())["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kiln-off-policy-drift.json"])
    assert dash["title"] == "Kiln / Off-policy drift"
    assert dash == json.loads((CHART / "files" / "kiln-off-policy-drift.json").read_text())


def test_pod_monitor_labels_series_with_the_rljob_name() -> None:
    (pm,) = kinds(render(*ALL_ON))["PodMonitor"]
    relabel = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
            "targetLabel": "rljob"} in relabel
    # It selects the labels the operator puts on every job pod.
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "kiln",
                                                     "app.kubernetes.io/managed-by": "kiln-operator"}


@pytest.mark.parametrize(("setting", "message"), [
    ("metrics.port=abc", "metrics.port: Invalid type. Expected: integer, given: string"),
    ("operator.healthPort=70000", "operator.healthPort: Must be less than or equal to 65535"),
    ("image.pullPolicy=Sometimes", "image.pullPolicy: image.pullPolicy must be one of the following"),
    ("prometheusRule.forDuration=ten", "prometheusRule.forDuration: Does not match pattern"),
    ("operater.verbose=true", "Additional property operater is not allowed"),
    ("operator.allowed.imageRegistries={ghcr.io}",
     "operator.allowed.imageRegistries.0: Does not match pattern"),
])
def test_bad_values_fail_lint_and_template_with_the_value_named(setting: str, message: str) -> None:
    for command in (["lint", "--strict"], ["template", "kiln"]):
        proc = subprocess.run([str(HELM), *command, str(CHART), "--set", setting],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0, f"helm {command[0]} accepted --set {setting}"
        assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_values_schema_documents_every_default_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict, vals: dict, path: str) -> list[str]:
        missing = []
        for key, value in vals.items():
            sub = node.get("properties", {}).get(key)
            if sub is None or not sub.get("description"):
                missing.append(f"{path}{key}")
            elif isinstance(value, dict) and "properties" in sub:
                missing += walk(sub, value, f"{path}{key}.")
        return missing

    assert walk(schema, values, "") == []
