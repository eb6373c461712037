"""The development cluster's node agent, without processes: how a pod template becomes a
command line (Service ports bound on loopback, peers' addresses rewritten, mounts mapped to
folders, ConfigMaps written as files)."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.cli.devcluster.node import Node

TEMPLATE = {
    "metadata": {"labels": {"app": "j", "component": "trainer"}},
    "spec": {
        "containers": [{
            "name": "trainer", "command": ["kiln-trainer"],
            "args": ["--job", "/etc/kiln/job.yaml", "--address", "0.0.0.0:50051",
                     "--metrics-port", "9090", "--run-dir", "/var/lib/kiln"],
            "ports": [{"name": "grpc", "containerPort": 50051}],
            "env": [{"name": "KILN_BUFFER_ADDR", "value": "j-buffer:50051"},
                    {"name": "OTHER", "value": "example.com:443"},
                    {"name": "KILN_POD_NAME",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "volumeMounts": [{"name": "job", "mountPath": "/etc/kiln/job.yaml",
                              "subPath": "job.yaml"},
                             {"name": "run", "mountPath": "/var/lib/kiln"}],
        }],
        "volumes": [{"name": "job", "configMap": {"name": "j-config"}},
                    {"name": "run", "persistentVolumeClaim": {"claimName": "j-checkpoints"}}],
    },
}
SERVICES = [
    {"metadata": {"name": "j-trainer"},
     "spec": {"selector": {"component": "trainer"}, "ports": [{"port": 50051, "targetPort": "grpc"}]}},
    {"metadata": {"name": "j-trainer-headless"},
     "spec": {"selector": {"component": "trainer"}, "ports": [{"port": 50051, "targetPort": 50051}]}},
    {"metadata": {"name": "j-buffer"},
     "spec": {"selector": {"component": "buffer"}, "ports": [{"port": 50051}]}},
]
CONFIGMAPS = {"j-config": {"data": {"job.yaml": "kind: RLJob\n"}}}
WORKLOAD = {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "j-trainer", "uid": "u1"}}


def test_a_pod_template_becomes_a_local_command_line(tmp_path: Path) -> None:
    node = Node(api=None, root=tmp_path, workdir=tmp_path)
    pod = node._start_pod("ns", "j-trainer-0", WORKLOAD, TEMPLATE, "h", SERVICES, CONFIGMAPS)
    assert not pod.failure
    (c,) = pod.containers
    addresses = json.loads((tmp_path / "addresses.json").read_text())
    # Both Services that select the pod lead to the one port it binds.
    assert addresses["ns/j-trainer"] == addresses["ns/j-trainer-headless"]
    bound = addresses["ns/j-trainer"]
    assert c.argv[c.argv.index("--address") + 1] == bound
    assert c.argv[c.argv.index("--metrics-port") + 1] == "0"
    assert c.argv[0].endswith("/kiln-trainer")
    job_file = Path(c.argv[c.argv.index("--job") + 1])
    assert job_file.read_text() == "kind: RLJob\n"
    run_dir = Path(c.argv[c.argv.index("--run-dir") + 1])
    assert run_dir == tmp_path / "pvc" / "ns" / "j-checkpoints" and run_dir.is_dir()
    assert c.env["KILN_BUFFER_ADDR"] == addresses["ns/j-buffer"]
    assert c.env["OTHER"] == "example.com:443"
    assert c.env["KILN_POD_NAME"] == "j-trainer-0"


def test_a_container_without_a_command_fails_the_pod_with_the_reason(tmp_path: Path) -> None:
    template = json.loads(json.dumps(TEMPLATE))
    template["spec"]["initContainers"] = [{"name": "dind", "image": "docker:27-dind",
                                           "restartPolicy": "Always"}]
    node = Node(api=None, root=tmp_path, workdir=tmp_path)
    pod = node._start_pod("ns", "j-trainer-0", WORKLOAD, template, "h", SERVICES, CONFIGMAPS)
    assert "dind" in pod.failure and "entrypoint" in pod.failure
    assert node._pod_object(pod)["status"]["phase"] == "Failed"
