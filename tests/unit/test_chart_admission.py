"""The chart's least-privilege pieces, rendered by the real helm binary: the
ValidatingAdmissionPolicy that confines the operator's ServiceAccount to the objects it manages
(its CEL expressions compiled and evaluated with cel-python against admission requests: the
operator's own objects pass, taking over or deleting anyone else's is denied), the
single-namespace install mode, and the allowlists rendered into the operator's settings."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml

from kiln.operator.config import OperatorConfig

from helpers.operator_jobs import FULL, spec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kiln"
HELM = ROOT / ".tools" / "bin" / "helm"
K8S_VERSION = "1.30.0"
OPERATOR = "system:serviceaccount:kiln-system:kiln"

pytestmark = pytest.mark.skipif(not HELM.exists(), reason=f"helm not installed at {HELM} (deploy/setup.sh)")


def render(*extra: str) -> dict[str, list[dict[str, Any]]]:
    proc = subprocess.run([str(HELM), "template", "kiln", str(CHART), "--namespace", "kiln-system",
                           *extra], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(proc.stdout):
        if doc:
            out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    by_kind = render()
    (vap,) = by_kind["ValidatingAdmissionPolicy"]
    (binding,) = by_kind["ValidatingAdmissionPolicyBinding"]
    for doc in (vap, binding):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    return vap


class Admission:
    """The API server's evaluation of one ValidatingAdmissionPolicy, as its docs define it:
    match conditions, then the variables in order, then every validation."""

    def __init__(self, vap: dict[str, Any]) -> None:
        env = celpy.Environment()
        compile_ = lambda e: env.program(env.compile(e))  # noqa: E731 - a parse error fails here
        spec_ = vap["spec"]
        self.conditions = [compile_(c["expression"]) for c in spec_["matchConditions"]]
        self.variables = [(v["name"], compile_(v["expression"])) for v in spec_["variables"]]
        self.validations = [(compile_(v["expression"]), v["message"]) for v in spec_["validations"]]

    def __call__(self, user: str, operation: str, kind: str, obj: dict | None,
                 old: dict | None) -> list[str]:
        """The messages of the failed validations ([]: admitted)."""
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel({"operation": operation, "kind": {"kind": kind},
                                          "userInfo": {"username": user}}),
            "object": celpy.json_to_cel(obj) if obj is not None else None,
            "oldObject": celpy.json_to_cel(old) if old is not None else None}
        if not all(bool(c.evaluate(activation)) for c in self.conditions):
            return []
        variables = celpy.celtypes.MapType()
        activation["variables"] = variables
        for name, program in self.variables:
            variables[celpy.celtypes.StringType(name)] = program.evaluate(activation)
        return [message for program, message in self.validations if not bool(program.evaluate(activation))]


def kiln_object(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a",
                         "labels": {"app.kubernetes.io/managed-by": "kiln-operator", **labels},
                         "ownerReferences": [{"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob",
                                              "name": "demo", "uid": "u"}]}}


FOREIGN = {"metadata": {"name": "db-password", "namespace": "team-a", "labels": {"app": "db"}}}


def test_the_policy_admits_the_operators_own_objects_and_nothing_else(policy) -> None:
    admit = Admission(policy)
    own = kiln_object("demo-ca")
    assert admit(OPERATOR, "CREATE", "Secret", own, None) == []
    assert admit(OPERATOR, "UPDATE", "Secret", own, own) == []
    assert admit(OPERATOR, "DELETE", "Deployment", None, kiln_object("demo-teacher")) == []
    # Retention: the finalizer strips a PVC's owner reference and labels it retained.
    retained = kiln_object("demo-checkpoints", **{"kiln.dev/retained-from": "demo"})
    retained["metadata"].pop("ownerReferences")
    assert admit(OPERATOR, "UPDATE", "PersistentVolumeClaim", retained,
                 kiln_object("demo-checkpoints")) == []

    # Taking over someone else's Secret by labelling it, changing or deleting it: denied.
    relabelled = {**kiln_object("db-password")}
    assert admit(OPERATOR, "UPDATE", "Secret", relabelled, FOREIGN)
    assert admit(OPERATOR, "DELETE", "Secret", None, FOREIGN)
    assert admit(OPERATOR, "DELETE", "Deployment", None, {"metadata": {"name": "web"}})
    # Creating an object that is not labelled as Kiln's or owned by an RLJob: denied.
    assert admit(OPERATOR, "CREATE", "ConfigMap", FOREIGN, None)
    unowned = kiln_object("x")
    unowned["metadata"].pop("ownerReferences")
    assert admit(OPERATOR, "CREATE", "Secret", unowned, None) == [
        "the Kiln operator's objects are owned by an RLJob (or are PVCs retained from one)"]
    # Anyone else is not this policy's business (their RBAC is).
    assert admit("system:serviceaccount:team-a:ci", "DELETE", "Secret", None, FOREIGN) == []


def test_single_namespace_mode_has_no_cluster_wide_role() -> None:
    by_kind = render("--set", "operator.singleNamespace=true",
                     "--set", "operator.watchNamespaces={team-a}")
    assert "ClusterRole" not in by_kind and "ClusterRoleBinding" not in by_kind
    (role,) = by_kind["Role"]
    (binding,) = by_kind["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "kiln-system"
    args = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=kiln-system" in args and "--all-namespaces" not in args
    assert not any(a == "--namespace=team-a" for a in args)


def test_the_allowlists_reach_the_operators_settings_and_refuse_by_field() -> None:
    by_kind = render("--set", "operator.allowed.secrets={hf,agents}",
                     "--set", "operator.allowed.imageRegistries={registry.example.com/,docker.io/library/}")
    (container,) = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    config = OperatorConfig.from_env(env)
    assert config.lifetimes.cert.days == 90
    refused = config.allowlist.refusals(spec(FULL))
    assert [line.split(":")[0] for line in refused] == [
        "trainer.pod.imagePullSecrets[0]", "trainer.pod.envFrom[0].secretRef.name",
        "trainer.pod.serviceAccountName"]
    assert set(config.refusals(spec(FULL))) >= set(refused)  # what the reconcile refuses on
    # The chart's defaults: Kiln's own registry only, no Secrets, no ServiceAccounts.
    (default,) = render()["Deployment"]
    env = {e["name"]: e["value"] for e in default["spec"]["template"]["spec"]["containers"][0]["env"]}
    fields = [line.split(":")[0] for line in OperatorConfig.from_env(env).allowlist.refusals(spec(FULL))]
    assert fields[:2] == ["image", "sandbox.image"] and len(fields) == 7
