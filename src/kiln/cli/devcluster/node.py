"""The development cluster's node agent: runs the pods of Deployments and StatefulSets as local
processes, so an applied RLJob really trains on one machine.

It is a test harness, not a kubelet. Every `interval` it lists the workloads in each namespace
and brings the processes to them:

- a workload with N replicas gets N pods (`<deployment>-<n>`, `<statefulset>-<n>`); a pod
  runs its init containers one after another to completion, then its containers, each as a
  process in its own session, in the agent's working directory (relative paths in a job mean
  what they mean to `kiln run`), with the container's env and args;
- `kiln-*` commands run from this Python environment; a container without a command (an image
  entrypoint, such as the docker:dind sidecar) cannot run here: the pod is reported failed with
  that reason;
- networking: each Service port gets a free loopback port (`addresses.json`, which the
  operator reads as its address map); a container's `0.0.0.0:<port>` argument binds the
  Service port of its pod, other ports become free ones, and env values `<service>:<port>` (the
  addresses the operator wires in) point at 127.0.0.1. Only the first replica of a workload
  backs its Service;
- volumes are folders: a ConfigMap's or Secret's keys are written as files (again when they
  change; Secret files readable by the owner only; a ConfigMap volume's `items` each at its
  path), a PVC
  is `pvc/<claim>` (kept across pods, deleted with its object), an emptyDir is per pod; paths
  under a mount in args and env are rewritten to the folder, and a path above mounts (such
  as the task sources' root) to a folder of links to them;
- a container that exits is restarted (restartPolicy Always) with backoff, its restart count
  reported; a changed pod template (such as the operator's config hash) replaces the pod;
- status goes back to the API: a Pod object per pod (phase, ready, restart counts), the
  workloads' replica counts; an object whose owner (by uid) is gone is deleted (GC).

Not modelled: scheduling, limits, probes (ready = its ports accept), security, images.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from kiln.cli.devcluster.apiclient import OWNED, RLJOBS, WORKLOADS, Api, free_port
from kiln.cli.devcluster.pods import Container, Pod, accepts, stop

log = logging.getLogger("kiln.devcluster")

_SERVICE_REF = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.[a-z0-9-]+)*?(\.svc(\.cluster\.local)?)?:(\d+)$")
BIN = Path(sys.executable).parent


class Node:
    """The agent; `run()` until `stop` is set, then every pod is stopped."""

    def __init__(self, api: Api, root: Path, workdir: Path, interval: float = 1.0) -> None:
        self.api, self.root, self.workdir, self.interval = api, root, workdir, interval
        self.pods: dict[tuple[str, str], Pod] = {}
        self.stop = threading.Event()
        self.addresses_file = root / "addresses.json"
        self.addresses: dict[str, str] = (json.loads(self.addresses_file.read_text())
                                          if self.addresses_file.exists() else {})
        self.pids_file = root / "pods.pids"

    # ------------------------------------------------------------------ networking
    def _service_port(self, namespace: str, service: str, port: int, bound: int = 0) -> int:
        """The loopback port of a Service port; `bound`: the one its pod already listens on
        (two Services that select one pod share it)."""
        key = f"{namespace}/{service}" + ("" if port == 50051 else f":{port}")
        if key not in self.addresses or (bound and self.addresses[key] != f"127.0.0.1:{bound}"):
            self.addresses[key] = f"127.0.0.1:{bound or free_port()}"
            tmp = self.addresses_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.addresses, indent=1, sort_keys=True))
            tmp.replace(self.addresses_file)
        return int(self.addresses[key].rsplit(":", 1)[1])

    def _ports_of(self, namespace: str, labels: dict[str, str], services: list[dict[str, Any]],
                  containers: list[dict[str, Any]]) -> dict[int, int]:
        """containerPort -> loopback port, for the Services that select this pod."""
        names = {p.get("name"): p["containerPort"] for c in containers for p in c.get("ports", [])}
        out: dict[int, int] = {}
        for svc in services:
            selector = (svc.get("spec") or {}).get("selector") or {}
            if not selector or any(labels.get(k) != v for k, v in selector.items()):
                continue
            for sp in svc["spec"].get("ports", []):
                target = sp.get("targetPort", sp["port"])
                target = names.get(target, target) if isinstance(target, str) else target
                out[int(target)] = self._service_port(namespace, svc["metadata"]["name"],
                                                      int(sp["port"]), out.get(int(target), 0))
        return out

    def _env_value(self, namespace: str, value: str, services: set[str]) -> str:
        m = _SERVICE_REF.match(value)
        if m and m.group(1) in services:
            return f"127.0.0.1:{self._service_port(namespace, m.group(1), int(m.group(6)))}"
        return value

    # ------------------------------------------------------------------ volumes
    def _volumes(self, namespace: str, pod: str, template: dict[str, Any],
                 configmaps: dict[str, dict[str, Any]]) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for vol in template["spec"].get("volumes", []):
            name = vol["name"]
            if "configMap" in vol:
                path = self.root / "pods" / namespace / pod / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                cm = configmaps.get(vol["configMap"]["name"]) or {}
                data = cm.get("data") or {}
                # `items`: only the keys named, each at its path (as the kubelet projects them).
                files = ({i["path"]: data[i["key"]] for i in vol["configMap"]["items"]
                          if i["key"] in data} if vol["configMap"].get("items") else data)
                for key, text in files.items():
                    if not (path / key).exists() or (path / key).read_text() != text:
                        (path / key).parent.mkdir(parents=True, exist_ok=True)
                        (path / key).write_text(text)
            elif "secret" in vol:
                path = self.root / "pods" / namespace / pod / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                secret = configmaps.get(f"secret/{vol['secret']['secretName']}") or {}
                for key, b64 in (secret.get("data") or {}).items():
                    data = base64.b64decode(b64)
                    if not (path / key).exists() or (path / key).read_bytes() != data:
                        (path / key).write_bytes(data)
                        os.chmod(path / key, 0o600)
            elif "persistentVolumeClaim" in vol:
                path = self.root / "pvc" / namespace / vol["persistentVolumeClaim"]["claimName"]
            else:  # emptyDir and anything else: a folder of the pod's own
                path = self.root / "pods" / namespace / pod / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            out[name] = path
        return out

    @staticmethod
    def _mounts(container: dict[str, Any], volumes: dict[str, Path]) -> list[tuple[str, str]]:
        """(mountPath, folder or file) pairs, longest mount first."""
        out = []
        for m in container.get("volumeMounts", []):
            host = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
            out.append((m["mountPath"].rstrip("/"), str(host)))
        return sorted(out, key=lambda pair: -len(pair[0]))

    @staticmethod
    def _mount_tree(tree: Path, mounts: list[tuple[str, str]]) -> None:
        """The container's mounts as links under `tree` (`tree/<mountPath>` -> its folder), so
        a path above several mounts (a root holding one mount per task set) means a folder too."""
        outer = [(m, h) for m, h in mounts
                 if not any(m != o and m.startswith(o + "/") for o, _ in mounts)]
        for mount, host in outer:
            link = tree / mount.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(host)

    @staticmethod
    def _remap(value: str, mounts: list[tuple[str, str]], tree: Path | None = None) -> str:
        for mount, host in mounts:
            if value == mount or value.startswith(mount + "/"):
                return host + value[len(mount):]
        if tree is not None and value.startswith("/") and len(value) > 1 and any(
                mount.startswith(value.rstrip("/") + "/") for mount, _ in mounts):
            return str(tree) + value
        return value

    # ------------------------------------------------------------------ pods
    def _container(self, namespace: str, pod: str, index: int, spec: dict[str, Any],
                   volumes: dict[str, Path], ports: dict[int, int], services: set[str]) -> Container:
        mounts = self._mounts(spec, volumes)
        tree = self.root / "pods" / namespace / pod / "volumes" / ".fs" / spec["name"]
        self._mount_tree(tree, mounts)
        command = list(spec.get("command") or [])
        if command and command[0].startswith("kiln") and (BIN / command[0]).exists():
            command[0] = str(BIN / command[0])
        argv = []
        for arg in [*command, *spec.get("args", [])]:
            m = re.fullmatch(r"0\.0\.0\.0:(\d+)", arg)
            if m:
                arg = f"127.0.0.1:{ports.get(int(m.group(1))) or free_port()}"
            argv.append(self._remap(arg, mounts, tree))
        # Other listening ports (metrics) get free ones: two pods cannot share a port here.
        for i, arg in enumerate(argv[:-1]):
            if arg == "--metrics-port":
                argv[i + 1] = "0"
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        field_values = {"metadata.namespace": namespace, "metadata.name": pod}
        for e in spec.get("env", []):
            if "value" in e:
                env[e["name"]] = self._remap(self._env_value(namespace, str(e["value"]), services),
                                             mounts, tree)
            elif "fieldRef" in (e.get("valueFrom") or {}):
                env[e["name"]] = field_values.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")
        env.setdefault("KILN_LOG_FORMAT", "json")
        logs = self.root / "pods" / namespace / pod / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return Container(spec, argv, env, logs / f"{index:02d}-{spec['name']}.log")

    @staticmethod
    def _desired(namespace: str, listed: dict[tuple[str, str], list[dict[str, Any]]],
                 ) -> dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], str]]:
        """(namespace, pod) -> (owner workload, its pod template, template hash)."""
        out = {}
        for kind in WORKLOADS:
            for wl in listed[kind]:
                template = wl["spec"]["template"]
                digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
                for n in range(int(wl["spec"].get("replicas", 1))):
                    out[(namespace, f"{wl['metadata']['name']}-{n}")] = (wl, template, digest)
        return out

    def _start_pod(self, namespace: str, name: str, owner: dict[str, Any],
                   template: dict[str, Any], digest: str, services: list[dict[str, Any]],
                   configmaps: dict[str, dict[str, Any]]) -> Pod:
        labels = (template.get("metadata") or {}).get("labels") or {}
        pod = Pod(namespace, name, owner, digest, labels)
        first = name.endswith("-0")
        containers = template["spec"].get("containers", [])
        ports = self._ports_of(namespace, labels, services, containers) if first else {}
        names = {s["metadata"]["name"] for s in services}
        volumes = self._volumes(namespace, name, template, configmaps)
        init = template["spec"].get("initContainers", [])
        for i, spec in enumerate(init):
            if spec.get("restartPolicy") == "Always":  # a native sidecar runs alongside
                containers = [spec, *containers]
                continue
            pod.init.append(self._container(namespace, name, i, spec, volumes, ports, names))
        for i, spec in enumerate(containers):
            pod.containers.append(self._container(namespace, name, 50 + i, spec, volumes, ports,
                                                  names))
        pod.ports = sorted(ports.values())
        missing = [c.name for c in (*pod.init, *pod.containers) if not c.spec.get("command")]
        if missing:
            pod.failure = (f"container(s) {', '.join(missing)} name no command (an image "
                           f"entrypoint), which the development cluster cannot run")
        log.info("pod %s/%s: starting (%s)", namespace, name, ", ".join(
            c.name for c in (*pod.init, *pod.containers)))
        return pod

    def _advance(self, pod: Pod) -> None:
        """Start what should run now: the next init container, else the containers; restart
        exited containers with backoff."""
        if pod.failure:
            return
        now = time.monotonic()
        for c in pod.init:
            if c.done:
                continue
            if c.proc is not None and c.proc.poll() is not None:
                if c.proc.returncode == 0:
                    c.done = True
                    continue
                c.restarts += 1
                c.next_start = now + min(30.0, 2.0 ** min(c.restarts, 5))
                c.proc = None
            if c.proc is None and now >= c.next_start:
                self._spawn(c)
            return  # init containers run one at a time, before the rest
        for c in pod.containers:
            if c.proc is not None and c.proc.poll() is not None:
                log.info("pod %s/%s: container %s exited with %s; restarting", pod.namespace,
                         pod.name, c.name, c.proc.returncode)
                c.restarts += 1
                c.next_start = now + min(10.0, 2.0 ** min(c.restarts - 1, 3))
                c.proc = None
            if c.proc is None and now >= c.next_start:
                self._spawn(c)

    def _spawn(self, c: Container) -> None:
        with open(c.log_path, "ab") as out:
            c.proc = subprocess.Popen(c.argv, stdout=out, stderr=subprocess.STDOUT, env=c.env,
                                      cwd=self.workdir, start_new_session=True)

    def _pod_object(self, pod: Pod) -> dict[str, Any]:
        running = [c for c in pod.containers if c.proc is not None and c.proc.poll() is None]
        ready = bool(running) and len(running) == len(pod.containers) and all(
            accepts(p) for p in pod.ports)
        phase = "Failed" if pod.failure else ("Running" if running else "Pending")
        owner = pod.owner["metadata"]
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels,
                         "ownerReferences": [{"apiVersion": pod.owner["apiVersion"],
                                              "kind": pod.owner["kind"], "name": owner["name"],
                                              "uid": owner["uid"], "controller": True}]},
            "spec": {"containers": [c.spec for c in pod.containers], "nodeName": "local"},
            "status": {
                "phase": phase, "message": pod.failure,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "containerStatuses": [
                    {"name": c.name, "ready": ready, "restartCount": c.restarts,
                     "started": c.proc is not None and c.proc.poll() is None}
                    for c in pod.containers],
            },
        }

    # ------------------------------------------------------------------ the loop
    def sync(self) -> None:
        # One list of each kind per namespace and sync; everything below works from these.
        # Workloads first: the operator creates a job's Services and ConfigMaps before its
        # workloads, so a workload listed here has them in the lists that follow. Listed the
        # other way round, a workload created between the two lists started without its
        # Services, its `<service>:<port>` env left unresolved for good.
        kinds = (*WORKLOADS, *(k for k in OWNED if k not in WORKLOADS), RLJOBS)
        listed = {ns: {kind: self.api.list(*kind, ns) for kind in kinds}
                  for ns in self.api.namespaces()}
        desired: dict[tuple[str, str], Any] = {}
        for ns, objs in listed.items():
            desired.update(self._desired(ns, objs))
        # ConfigMaps by name and Secrets as "secret/<name>": what pod volumes are made of.
        configmaps = {ns: {**{c["metadata"]["name"]: c for c in objs[("v1", "configmaps")]},
                           **{f"secret/{c['metadata']['name']}": c for c in objs[("v1", "secrets")]}}
                      for ns, objs in listed.items()}
        for key in [k for k, pod in self.pods.items()
                    if k not in desired or desired[k][2] != pod.template_hash]:
            pod = self.pods.pop(key)
            log.info("pod %s/%s: stopping", *key)
            stop(pod.processes(), grace=30)
            self.api.delete("v1", "pods", *key)
            shutil.rmtree(self.root / "pods" / key[0] / key[1] / "volumes", ignore_errors=True)
        for key, (owner, template, digest) in desired.items():
            if key not in self.pods:
                self.pods[key] = self._start_pod(*key, owner, template, digest,
                                                 listed[key[0]][("v1", "services")],
                                                 configmaps[key[0]])
            else:  # a ConfigMap that changed reaches the pod's files (not subPath ones in k8s)
                self._volumes(*key, template, configmaps[key[0]])
            self._advance(self.pods[key])
        self._write_pids()
        ready_pods: dict[str, int] = {}  # owner uid -> ready pods
        for key, pod in self.pods.items():
            obj = self._pod_object(pod)
            if obj["status"]["conditions"][0]["status"] == "True":
                uid = pod.owner["metadata"]["uid"]
                ready_pods[uid] = ready_pods.get(uid, 0) + 1
            if obj != pod.reported:  # report changes only
                self.api.put_pod(key[0], obj)
                pod.reported = obj
        for ns, objs in listed.items():
            self._report_workloads(ns, objs, ready_pods)
            self._collect_garbage(ns, objs)

    def _report_workloads(self, namespace: str, listed: dict[tuple[str, str], list[dict[str, Any]]],
                          ready_pods: dict[str, int]) -> None:
        for kind in WORKLOADS:
            for wl in listed[kind]:
                uid = wl["metadata"]["uid"]
                pods = sum(1 for (ns, _), p in self.pods.items()
                           if ns == namespace and p.owner["metadata"]["uid"] == uid)
                status = {"replicas": pods, "readyReplicas": ready_pods.get(uid, 0),
                          "availableReplicas": ready_pods.get(uid, 0),
                          "observedGeneration": wl["metadata"].get("generation", 1)}
                if {k: (wl.get("status") or {}).get(k) for k in status} != status:
                    self.api.patch_status(*kind, namespace, wl["metadata"]["name"], status)

    def _collect_garbage(self, namespace: str,
                         listed: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
        uids = {o["metadata"].get("uid") for objs in listed.values() for o in objs}
        for kind in OWNED:
            for obj in listed[kind]:
                owners = obj["metadata"].get("ownerReferences") or []
                if owners and not any(o.get("uid") in uids for o in owners):
                    name = obj["metadata"]["name"]
                    log.info("collecting %s %s/%s (owner gone)", kind[1], namespace, name)
                    self.api.delete(*kind, namespace, name)
                    if kind[1] == "persistentvolumeclaims":
                        shutil.rmtree(self.root / "pvc" / namespace / name, ignore_errors=True)

    def _write_pids(self) -> None:
        """Every process the agent started, so `kiln dev-cluster down` can stop them even if the
        agent itself was killed."""
        pids = [str(p.pid) for pod in self.pods.values() for p in pod.processes()
                if p.poll() is None]
        self.pids_file.write_text("\n".join(pids))

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sync()
            except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
                log.warning("sync failed: %s", exc)
            self.stop.wait(self.interval)
        procs = [p for pod in self.pods.values() for p in pod.processes()]
        stop(procs, grace=30)
        self.pids_file.write_text("")
