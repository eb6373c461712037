"""Task sets kept on the cluster, brought into the pods that read them; the output volume,
into the trainer that writes it.

A task set whose `source` is a ConfigMap key or a file on a PVC (`kiln.api.task_sources`) is
mounted read-only at `TASKS_ROOT/<task set name>` in every container that reads task files,
and those containers get `TASKS_ROOT_ENV`, so the service finds the file there:

- the sandbox service (its episodes load every task set of the job);
- the `prepare-model` init container of a job whose model `spec.model.init` makes: the
  tokenizer is learned from the job's own episodes, task files included.

An image source is copied, not mounted: an init container of that image, first in the pod,
copies its `/tasks` folder into an emptyDir (`IMAGE_TASKS`), which the readers mount read-only.
A Hub dataset (`hfDataset`) is fetched the same way, by an init container of the job's image
running `kiln fetch-tasks` for that task set alone (its token, if any, from the Secret as
HF_TOKEN, to that container only; the pod's other `HF_*` variables, such as a mirror's
HF_ENDPOINT, too).

The job file the services read keeps `source` as written: where it is mounted is the pod's
business, not the job's. The output PVC (`spec.output`, `kiln.api.outputs`) is mounted into the
trainer's replica 0 alone, which writes each stage's model there. Pure functions of the spec, as
the rest of the pod building blocks.
"""
from __future__ import annotations

from typing import Any

from kiln.api.outputs import OUTPUT_DIR_ENV, OUTPUT_ROOT
from kiln.api.spec import RLJobSpec
from kiln.api.task_sources import TASKS_ROOT, TASKS_ROOT_ENV
from kiln.operator.naming import JOB_FILE
from kiln.operator.pods import service_security

#: Containers that read task files.
READERS = ("sandbox", "prepare-model")
#: Where an image source's init container copies the image's `/tasks` folder to.
IMAGE_TASKS = "/tasks"
COPY_TARGET = "/var/lib/kiln-tasks"


def task_source_volumes(spec: RLJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the job's mounted task sources; both empty when there are none."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, ts in enumerate(spec.tasks):
        source = ts.source
        if source is None or source.kind == "path":
            continue
        name = f"tasks-{i}"
        if source.config_map is not None:
            cm = source.config_map
            volumes.append({"name": name, "configMap": {
                "name": cm.name, "items": [{"key": cm.key, "path": cm.key}]}})
        elif source.image is not None:
            volumes.append({"name": name, "emptyDir": {"sizeLimit": source.image.size}})
        elif source.hf_dataset is not None:
            volumes.append({"name": name, "emptyDir": {"sizeLimit": source.hf_dataset.size}})
        else:
            volumes.append({"name": name, "persistentVolumeClaim": {
                "claimName": source.pvc.claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{TASKS_ROOT}/{ts.name}", "readOnly": True})
    return volumes, mounts


def image_copiers(spec: RLJobSpec) -> list[dict[str, Any]]:
    """One init container per image source: its image's `/tasks` copied into the task set's
    folder (`cp` from the image itself, as an unprivileged user)."""
    out = []
    for i, ts in enumerate(spec.tasks):
        if ts.source is None or ts.source.image is None:
            continue
        amounts = {"cpu": "100m", "memory": "128Mi", "ephemeral-storage": ts.source.image.size}
        out.append({
            "name": f"tasks-{i}",
            "image": ts.source.image.ref,
            "imagePullPolicy": "IfNotPresent",
            "command": ["cp", "-R", f"{IMAGE_TASKS}/.", COPY_TARGET],
            "resources": {"requests": amounts, "limits": amounts},
            "volumeMounts": [{"name": f"tasks-{i}", "mountPath": COPY_TARGET}],
            "securityContext": service_security(),
        })
    return out


def dataset_fetchers(spec: RLJobSpec, hub_env: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One init container per Hub dataset source: `kiln fetch-tasks` writes the task set's
    rows as its task file into the set's folder (a restarted container finds it recorded).
    `hub_env`: the pod's own `HF_*` variables (a mirror's HF_ENDPOINT, ...), which it gets too."""
    out = []
    for i, ts in enumerate(spec.tasks):
        if ts.source is None or ts.source.hf_dataset is None:
            continue
        src = ts.source.hf_dataset
        folder = f"{COPY_TARGET}/{ts.name}"
        # The download's cache inside the folder (the root file system may be read-only);
        # `kiln fetch-tasks` removes it once the task file is written.
        env: list[dict[str, Any]] = [*hub_env, {"name": "HF_HOME", "value": f"{folder}/.cache"}]
        if src.token_secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": src.token_secret, "key": "token"}}})
        amounts = {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": src.size}
        out.append({
            "name": f"tasks-{i}",
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["kiln", "fetch-tasks", JOB_FILE, "--task-set", ts.name,
                        "--out", COPY_TARGET],
            "env": env,
            "resources": {"requests": amounts, "limits": amounts},
            "volumeMounts": [{"name": "job", "mountPath": JOB_FILE, "subPath": "job.yaml",
                              "readOnly": True},
                             {"name": f"tasks-{i}", "mountPath": folder}],
            "securityContext": service_security(),
        })
    return out


def mount_task_sources(template: dict[str, Any], spec: RLJobSpec) -> dict[str, Any]:
    """`template` (a pod template) with the task sources mounted into its readers; the same
    object, changed in place, for chaining."""
    volumes, mounts = task_source_volumes(spec)
    if not volumes:
        return template
    pod = template["spec"]
    # Only a model that is made reads the tasks (a downloaded one does not).
    names = READERS if spec.model.init is not None else ("sandbox",)
    readers = [c for c in (*pod.get("initContainers", []), *pod["containers"])
               if c["name"] in names]
    if not readers:
        return template
    pod["volumes"] = [*pod.get("volumes", []), *volumes]
    # Copies first: every reader, a prepare-model init container too, finds the files there.
    pod["initContainers"] = [*image_copiers(spec), *dataset_fetchers(spec, _hub_env(pod)),
                             *pod.get("initContainers", [])]
    if not pod["initContainers"]:
        del pod["initContainers"]
    for container in readers:
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
        container["env"] = [*container.get("env", []), {"name": TASKS_ROOT_ENV, "value": TASKS_ROOT}]
    return template


def _hub_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The `HF_*` variables the pod's containers are given (`spec.<component>.pod.env`), each
    once; not HF_TOKEN (a dataset's token is its own `tokenSecret`) nor HF_HOME."""
    seen: dict[str, dict[str, Any]] = {}
    for container in pod["containers"]:
        for var in container.get("env", []):
            if var["name"].startswith("HF_") and var["name"] not in ("HF_TOKEN", "HF_HOME"):
                seen.setdefault(var["name"], var)
    return list(seen.values())


def mount_output(template: dict[str, Any], spec: RLJobSpec) -> dict[str, Any]:
    """The trainer's pod template with the output volume mounted (writable) into its
    container, or the S3 location's endpoint and credentials given to it, and the folder
    named to it; unchanged without `spec.output`."""
    output = spec.output
    if output is None:
        return template
    pod = template["spec"]
    (trainer,) = [c for c in pod["containers"] if c["name"] == "trainer"]
    env = [{"name": OUTPUT_DIR_ENV, "value": output.trainer_dir()}]
    if output.pvc is not None:
        pod["volumes"] = [*pod.get("volumes", []), {"name": "output", "persistentVolumeClaim": {
            "claimName": output.pvc.claim}}]
        trainer["volumeMounts"] = [*trainer.get("volumeMounts", []),
                                   {"name": "output", "mountPath": OUTPUT_ROOT}]
    if output.endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": output.endpoint})
    if output.credentials_secret is not None:
        # By reference: the keys never pass through the job's ConfigMap or the pod template.
        env += [{"name": key, "valueFrom": {"secretKeyRef": {
            "name": output.credentials_secret, "key": key, "optional": optional}}}
            for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                                  ("AWS_SESSION_TOKEN", True), ("AWS_DEFAULT_REGION", True))]
    trainer["env"] = [*trainer.get("env", []), *env]
    return template
