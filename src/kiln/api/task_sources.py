"""Where a task set's file comes from (`spec.tasks[].source`), and where a service finds it.

A task set is read from one file of task records. `path` names a file the reading process can
open (beside the job file under `kiln run`, inside the image or a pod volume on a cluster);
`source` names where a team keeps it on a cluster:

- `configMap: {name, key}`: a ConfigMap key, as `kubectl create configmap NAME --from-file=KEY`
  makes it;
- `pvc: {claim, path}`: a file on a PersistentVolumeClaim, `path` relative to the volume's root
  (the files beside it, such as a SWE set's repositories, are there too);
- `image: {ref, path}`: a file in an OCI image's `/tasks` folder (`FROM busybox`, `COPY tasks
  /tasks`: the image needs `cp`), copied with the rest of that folder by an init container
  into the pod before anything reads it;
- `hfDataset: {id, split, revision, tokenSecret, columns}`: a split of a dataset on the Hugging
  Face Hub, loaded with the `datasets` library by `kiln fetch-tasks` (an init container on a
  cluster, `kiln run`'s pre-flight locally) and written as JSONL (`HF_TASKS_FILE`): each row is
  one task record, each column the record's field of the same name, `columns` mapping a
  record field to a column named otherwise (`kiln.cli.hf_tasks`).

The operator mounts each source, read-only, at `TASKS_ROOT/<task set name>` in the pods that
read task sets and tells them the root (`TASKS_ROOT_ENV`); a service turns a sourced entry into
a plain path with `located`. `kiln run` refuses a cluster-only source by field
(`local_refusals`): nothing on this machine holds a ConfigMap, a claim or a pulled image; a Hub
dataset it fetches into the run directory and reads from there as a pod would.
Torch-free.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from kiln.api.base import Model

if TYPE_CHECKING:
    from kiln.api.spec import RLJobSpec, TaskSetSpec

TASKS_ROOT = "/etc/kiln/tasks"
"""Where the operator mounts task sources in a pod: one folder per task set, by its name."""
TASKS_ROOT_ENV = "KILN_TASKS_ROOT"
"""The variable that tells a service where the task sources are mounted."""

HF_TASKS_FILE = "tasks.jsonl"
"""The file a Hub dataset's rows are written to, in its task set's folder."""

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_HUB_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"


class ConfigMapSource(Model):
    """A ConfigMap key holding the task file (`kubectl create configmap NAME --from-file=KEY`;
    a ConfigMap holds at most 1 MiB: a larger set belongs on a PVC)."""

    name: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253)
    """The ConfigMap, in the job's namespace."""
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)
    """Its key that holds the JSONL task records (with `--from-file`, the file's name)."""


class PVCSource(Model):
    """A task file on a PersistentVolumeClaim, mounted read-only."""

    claim: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253)
    """The PersistentVolumeClaim, in the job's namespace."""
    path: str = Field(min_length=1)
    """The task file, relative to the volume's root."""

    @model_validator(mode="after")
    def _relative(self) -> PVCSource:
        p = PurePosixPath(self.path)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"path: {self.path!r} must be relative to the volume's root, "
                             "without '..'")
        return self


class ImageSource(Model):
    """A task file in an OCI image, under its `/tasks` folder (repositories beside it)."""

    ref: str = Field(min_length=1, pattern=r"^[^\s]+$")
    """The image reference, e.g. `registry.example.com/team/swe-tasks:2024-06` (pulled with the
    pod's imagePullSecrets)."""
    path: str = Field(min_length=1)
    """The task file, relative to the image's `/tasks` folder."""
    size: str = Field("1Gi", pattern=r"^[0-9]+(\.[0-9]+)?(k|Ki|M|Mi|G|Gi|T|Ti)?$")
    """Room for the copy of `/tasks` in each pod (the folder's sizeLimit, a Kubernetes quantity)."""

    @model_validator(mode="after")
    def _relative(self) -> ImageSource:
        p = PurePosixPath(self.path)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"path: {self.path!r} must be relative to the image's /tasks "
                             "folder, without '..'")
        return self


class HfDatasetSource(Model):
    """A split of a dataset on the Hugging Face Hub, one task record per row."""

    id: str = Field(pattern=_HUB_ID)
    """Repository id, `owner/name` (e.g. `princeton-nlp/SWE-bench_Lite`)."""
    split: str = Field("train", pattern=r"^[\w.-]+(\[[\w%:.-]*\])?$")
    """The split (`train`, `test`, or a slice such as `test[:100]`)."""
    revision: str = Field("main", min_length=1)
    """Branch, tag or commit; a commit hash pins the exact rows."""
    token_secret: str | None = Field(None, pattern=_DNS_SUBDOMAIN, max_length=253)
    """On a cluster: a Secret whose key `token` is the Hub token (gated and private datasets);
    it reaches the loader as HF_TOKEN and nothing else. Locally, HF_TOKEN from the environment."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Record field -> dataset column, for the fields whose column is named otherwise (e.g.
    `{id: instance_id}`); every other column is the field of its own name."""
    size: str = Field("1Gi", pattern=r"^[0-9]+(\.[0-9]+)?(k|Ki|M|Mi|G|Gi|T|Ti)?$")
    """On a cluster: room for the download and the task file in each pod that reads it (the
    folder's sizeLimit, a Kubernetes quantity)."""


class TaskSource(Model):
    """Where a task set's file is kept: exactly one of `path`, `configMap`, `pvc`,
    `image`, `hfDataset`."""

    path: str | None = None
    """A file the services can open (the same as the task set's own `path`)."""
    config_map: ConfigMapSource | None = None
    """A ConfigMap key (cluster only)."""
    pvc: PVCSource | None = None
    """A file on a PersistentVolumeClaim (cluster only)."""
    image: ImageSource | None = None
    """A file in an OCI image's `/tasks` folder (cluster only)."""
    hf_dataset: HfDatasetSource | None = None
    """A split of a Hugging Face Hub dataset (fetched on a cluster and by `kiln run`)."""

    def _given(self) -> list[str]:
        return [name for name, value in (("path", self.path), ("configMap", self.config_map),
                                         ("pvc", self.pvc), ("image", self.image),
                                         ("hfDataset", self.hf_dataset))
                if value is not None]

    @model_validator(mode="after")
    def _one(self) -> TaskSource:
        given = self._given()
        if len(given) != 1:
            raise ValueError("exactly one of path, configMap, pvc, image or hfDataset must be set"
                             + (f" (found {', '.join(given)})" if given else ""))
        return self

    @property
    def kind(self) -> str:
        """The wire name of the alternative that is set."""
        return self._given()[0]

    def mounted_file(self) -> str:
        """The task file, relative to the folder its source is mounted at."""
        if self.config_map is not None:
            return self.config_map.key
        if self.image is not None:
            return self.image.path
        if self.hf_dataset is not None:
            return HF_TASKS_FILE
        assert self.pvc is not None, "a path source is not mounted"
        return self.pvc.path


def located(ts: TaskSetSpec, tasks_root: str | Path | None) -> TaskSetSpec:
    """`ts` reading a plain `path`: a mounted source's file under `tasks_root` (where the
    operator mounts them). ValueError naming the field when the source is not mounted here."""
    source = ts.source
    if source is None:
        return ts
    if source.path is not None:
        return ts.model_copy(update={"path": source.path, "source": None})
    if tasks_root is None:
        raise ValueError(f"spec.tasks[{ts.name}].source.{source.kind}: this source is mounted "
                         f"by the Kiln operator on a cluster ({TASKS_ROOT_ENV} is not set here); "
                         "locally, give the task file as `path`")
    file = Path(tasks_root) / ts.name / source.mounted_file()
    return ts.model_copy(update={"path": str(file), "source": None})


def local_refusals(spec: RLJobSpec) -> list[str]:
    """One message per task set whose source only a cluster has (`kiln run` cannot read it)."""
    out = []
    for i, ts in enumerate(spec.tasks):
        if ts.source is not None and ts.source.kind not in ("path", "hfDataset"):
            what = (f"ConfigMap {ts.source.config_map.name!r}" if ts.source.config_map
                    else f"image {ts.source.image.ref!r}" if ts.source.image
                    else f"PersistentVolumeClaim {ts.source.pvc.claim!r}")
            out.append(f"spec.tasks[{i}].source.{ts.source.kind}: the {what} is on a cluster, "
                       f"which `kiln run` cannot read; give task set {ts.name!r} a local file "
                       "as `path` (e.g. the file you made the ConfigMap or image from)")
    return out
