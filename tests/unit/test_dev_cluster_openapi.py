"""The development cluster's fake API answers what plain kubectl asks: OpenAPI v3 documents (so
`kubectl apply -f` validates without `--validate=false`, leaving validation to the server), a
422 naming the field for an RLJob that `kiln validate` refuses, and Tables with the CRD's
printer columns for `kubectl get`. Checked over HTTP, and with the real kubectl when
`.tools/bin/kubectl` is there."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from kiln.api.crd import build_crd
from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig
from kiln.cli.devcluster.openapi import age

REPO = Path(__file__).resolve().parents[2]
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
QUICKSTART = REPO / "deploy" / "examples" / "quickstart.yaml"
RLJOBS = "/apis/kiln.dev/v1alpha1/namespaces/default/rljobs"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


def _call(url: str, method: str = "GET", body: object = None, accept: str = "application/json",
          content_type: str = "application/json") -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": content_type, "Accept": accept})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture()
def api():
    with running_fake_api() as (fake, url):
        fake.add_namespace("default")
        status, _ = _call(f"{url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                          "POST", build_crd())
        assert status in (200, 201)
        yield fake, url


def test_openapi_v3_says_the_server_validates_every_kind(api) -> None:
    _, url = api
    status, index = _call(f"{url}/openapi/v3")
    assert status == 200
    assert {"api/v1", "apis/apps/v1", "apis/kiln.dev/v1alpha1"} <= set(index["paths"])
    status, doc = _call(url + index["paths"]["apis/kiln.dev/v1alpha1"]["serverRelativeURL"])
    assert status == 200
    item = doc["paths"]["/apis/kiln.dev/v1alpha1/namespaces/{namespace}/rljobs/{name}"]
    gvk = {"group": "kiln.dev", "version": "v1alpha1", "kind": "RLJob"}
    assert item["patch"]["x-kubernetes-group-version-kind"] == gvk
    assert {"name": "fieldValidation", "in": "query"}.items() <= item["patch"]["parameters"][2].items()
    schema = doc["components"]["schemas"]["dev.kiln.v1alpha1.RLJob"]
    assert schema["x-kubernetes-group-version-kind"] == [gvk]
    assert "spec" in schema["properties"]
    assert _call(f"{url}/openapi/v3/apis/nothing.example/v1")[0] == 404


def test_an_rljob_the_schema_refuses_is_refused_with_its_field(api) -> None:
    _, url = api
    job = yaml.safe_load(QUICKSTART.read_text())
    job["spec"]["tasks"][0]["generate"]["count"] = "many"
    status, body = _call(url + RLJOBS, "POST", job)
    assert status == 422 and body["reason"] == "Invalid"
    assert "spec.tasks[0].generate.count" in body["message"]
    assert body["details"]["causes"][0]["field"] == "spec.tasks[0].generate.count"
    job["spec"]["tasks"][0]["generate"]["count"] = 10
    assert _call(url + RLJOBS, "POST", job)[0] in (200, 201)
    # A merge patch that breaks the spec is refused; one that touches metadata only is not.
    item = f"{url}{RLJOBS}/quickstart"
    bad = {"spec": {"stages": [{"name": "sft", "type": "sft", "tasks": ["chain-train"],
                                "maxSteps": -1}]}}
    status, body = _call(item, "PATCH", bad, content_type="application/merge-patch+json")
    assert status == 422 and "spec.stages[0].maxSteps" in body["message"]
    # What only Kiln's cross-field rules refuse gets past the API, as on a real cluster
    # (the operator refuses it in the job's status).
    cross = {"spec": {"stages": [{"name": "sft", "type": "sft", "tasks": ["nope"]}]}}
    assert _call(item, "PATCH", cross, content_type="application/merge-patch+json")[0] == 200
    ok = {"metadata": {"finalizers": ["kiln.dev/pvc-retention"]}}
    assert _call(item, "PATCH", ok, content_type="application/merge-patch+json")[0] == 200
    # The status subresource is the operator's, never checked.
    status_patch = {"status": {"phase": "Running", "step": 3}}
    assert _call(f"{item}/status", "PATCH", status_patch,
                 content_type="application/merge-patch+json")[0] == 200


def test_get_asks_for_a_table_and_gets_the_printer_columns(api) -> None:
    _, url = api
    job = yaml.safe_load(QUICKSTART.read_text())
    assert _call(url + RLJOBS, "POST", job)[0] in (200, 201)
    _call(f"{url}{RLJOBS}/quickstart/status", "PATCH", {"status": {"phase": "Running", "step": 7}},
          content_type="application/merge-patch+json")
    status, table = _call(url + RLJOBS, accept=TABLE)
    assert status == 200 and table["kind"] == "Table"
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Phase", "Stage", "Version", "Step", "Reward", "Staleness", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:5] == ["quickstart", "Running", None, None, 7]
    assert row["object"]["metadata"]["name"] == "quickstart"
    status, one = _call(f"{url}{RLJOBS}/quickstart", accept=TABLE)
    assert status == 200 and one["rows"][0]["cells"][0] == "quickstart"
    assert _call(f"{url}{RLJOBS}/nope", accept=TABLE)[0] == 404
    # Without the Table media type, the objects themselves.
    assert _call(url + RLJOBS)[1]["kind"] == "RLJobList"


def test_ages_print_as_kubectl_prints_them() -> None:
    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    stamp = lambda d: (now - d).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    assert [age(stamp(timedelta(seconds=s)), now) for s in (5, 150, 900, 4 * 3600 + 60, 86400 * 3)] \
        == ["5s", "2m30s", "15m", "4h1m", "3d"]


@pytest.mark.skipif(not KUBECTL.exists(), reason="no .tools/bin/kubectl")
def test_plain_kubectl_apply_validates_and_get_prints_columns(api, tmp_path: Path) -> None:
    _, url = api
    env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(tmp_path / "kc", url, "default"))}

    def kubectl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(KUBECTL), *args], capture_output=True, text=True, env=env,
                              timeout=60)
    applied = kubectl("apply", "-f", str(QUICKSTART))
    assert applied.returncode == 0, applied.stderr
    listed = kubectl("get", "rljob")
    assert listed.stdout.split()[:7] == ["NAME", "PHASE", "STAGE", "VERSION", "STEP", "REWARD", "AGE"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("count: 6000", "count: many"))
    refused = kubectl("apply", "-f", str(bad))
    assert refused.returncode != 0
    assert "spec.tasks[0].generate.count" in refused.stderr and "download openapi" not in refused.stderr
