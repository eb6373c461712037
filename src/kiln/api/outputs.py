"""Where a job's results go (`spec.output`): the model out of the cluster.

At the end of each stage the trainer writes to the output folder:

- `stages/<stage>/`: the stage's final weights as a Hugging Face checkpoint (safetensors,
  config, tokenizer and chat template), as `kiln run` keeps them under `trainer/stages/`;
- `final-hf/`: the newest finished stage's, which is the job's model once the last stage ends;
- `job.yaml` and `summary.json` (the stages finished, their steps, selected steps and policy
  versions).

`kiln export OUTPUT --out DIR` copies the model from there (`kiln.cli.export`).

The output is a PersistentVolumeClaim (`pvc: {claim, path}`), which the operator mounts into
the trainer at `OUTPUT_ROOT`, or an S3-compatible bucket (`uri: s3://bucket/prefix`, written with
fsspec/s3fs; `endpoint` for a store other than AWS, credentials from the Secret
`credentialsSecret`, whose `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` keys become the
trainer's variables). The trainer is told where by `OUTPUT_DIR_ENV`. Torch-free.
"""
from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, model_validator

from kiln.api.base import Model

OUTPUT_ROOT = "/var/lib/kiln-output"
"""Where the operator mounts the output volume in the trainer's pod."""
OUTPUT_DIR_ENV = "KILN_OUTPUT_DIR"
"""The variable that tells the trainer its output folder."""


class OutputPVC(Model):
    """A folder on a PersistentVolumeClaim (ReadWriteMany to read it while the job runs, or
    after it from another pod)."""

    claim: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                       max_length=253)
    """The PersistentVolumeClaim, in the job's namespace."""
    path: str = ""
    """The folder inside it, relative to the volume's root (empty: the root)."""

    @model_validator(mode="after")
    def _relative(self) -> OutputPVC:
        p = PurePosixPath(self.path)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"path: {self.path!r} must be relative to the volume's root, "
                             "without '..'")
        return self


class OutputSpec(Model):
    """Where each stage's model, the summary and the job file go: exactly one of `pvc`, `uri`."""

    pvc: OutputPVC | None = None
    """A folder on a PersistentVolumeClaim."""
    uri: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
    """An S3-compatible location, `s3://bucket/prefix`."""
    endpoint: str | None = Field(None, pattern=r"^https?://[^\s/]+(/.*)?$")
    """With `uri`: the S3 API's address when it is not AWS (MinIO, Ceph, R2, ...)."""
    credentials_secret: str | None = Field(
        None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    """With `uri`: a Secret whose keys `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and
    `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`, if given) the trainer gets as variables. Unset:
    the pod's own credentials (a service account's workload identity)."""

    @model_validator(mode="after")
    def _one(self) -> OutputSpec:
        if (self.pvc is None) == (self.uri is None):
            raise ValueError("exactly one of pvc or uri must be set")
        extra = [n for n, v in (("endpoint", self.endpoint),
                                ("credentialsSecret", self.credentials_secret)) if v is not None]
        if self.pvc is not None and extra:
            raise ValueError(f"{', '.join(extra)}: only with uri (an S3 location), not with pvc")
        return self

    def trainer_dir(self) -> str:
        """The output folder, or location, as the trainer sees it."""
        if self.uri is not None:
            return self.uri.rstrip("/")
        return str(PurePosixPath(OUTPUT_ROOT) / self.pvc.path)


def local_refusals(output: OutputSpec | None) -> list[str]:
    """`kiln run` keeps its results in its run directory; a cluster's volume is not here."""
    if output is None:
        return []
    what = (f"output.pvc: the PersistentVolumeClaim {output.pvc.claim!r} is on a cluster"
            if output.pvc is not None else f"output.uri: {output.uri} is written by a cluster's trainer")
    return [f"spec.{what}; `kiln run` keeps the same files in its run directory (final-hf/, "
            "trainer/stages/, summary.json): remove spec.output to run this job here"]
