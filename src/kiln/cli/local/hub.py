"""Download a job's checkpoint from the Hugging Face Hub (`spec.model.hub`) to `spec.model.path`.

- Only what a checkpoint needs: config and generation config, safetensors weights and their
  index, tokenizer files and chat template. Pickled weights (`*.bin`, `*.pt`) are never
  fetched: Kiln loads safetensors only, and a repository without them is refused by name.
- Resumable: huggingface_hub keeps partial files and their metadata under
  `PATH/.cache/huggingface`; a download that stopped (a killed init container, a dropped
  connection) continues where it stopped, and files already complete are not fetched again.
- Checked: every file's size and hash against the Hub's tree listing (sha256 for LFS files, the
  git blob sha1 for the others); a file that differs is deleted and the download fails, naming it.
- Recorded: `PATH/.kiln-hub.json` holds the repository, revision and commit the files came from,
  written last; a folder whose record matches is not downloaded again. A `config.json` alone
  does not count as a checkpoint here: a download that stopped half-way has one.

HF_ENDPOINT (a mirror, or a test's stand-in server) and HF_TOKEN are honoured as by every
huggingface_hub call; the token is never printed.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from kiln.api.model import HubModel

PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.jinja", "*.txt", "tokenizer*")
"""The files of a repository that are downloaded (in its root or any folder)."""
RECORD = ".kiln-hub.json"


class HubError(Exception):
    """The download failed. `retry` says whether running it again can help (it then resumes)."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def wanted(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in PATTERNS)


def recorded(hub: HubModel, path: Path) -> dict | None:
    """The record of a finished download of `hub` into `path`, or None."""
    try:
        rec = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if rec.get("id") != hub.id or hub.revision not in (rec.get("revision"), rec.get("commit")):
        return None
    return rec


def download(hub: HubModel, path: Path, out: TextIO | None = None) -> str:
    """Download `hub` into `path` (resuming, verifying); returns the commit it came from."""
    out = out or sys.stdout
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if (rec := recorded(hub, path)) is not None:
        return rec["commit"]
    # Read now, not when huggingface_hub was imported (it reads HF_ENDPOINT once, at import).
    endpoint, token = os.environ.get("HF_ENDPOINT") or None, os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)
    name = f"{hub.id}@{hub.revision}"
    t0 = time.monotonic()
    try:
        commit = api.repo_info(hub.id, revision=hub.revision).sha
        tree = {f.path: f for f in api.list_repo_tree(hub.id, revision=commit, recursive=True)
                if hasattr(f, "blob_id") and wanted(f.path)}
        if not any(p.endswith(".safetensors") for p in tree):
            raise HubError(f"spec.model.hub: {name} holds no *.safetensors weights (Kiln loads "
                           "safetensors only; convert the checkpoint first)", retry=False)
        size = sum(f.size for f in tree.values())
        out.write(f"downloading {name} (commit {commit[:12]}, {len(tree)} files, "
                  f"{size / 2**20:.1f} MiB) to {path}\n")
        snapshot_download(hub.id, revision=commit, local_dir=path, endpoint=endpoint,
                          token=token, allow_patterns=list(tree))
    except GatedRepoError as exc:
        raise HubError(f"spec.model.hub: {name} is gated or private and the token was refused "
                       f"or missing (HF_TOKEN; on a cluster spec.model.hub.tokenSecret): "
                       f"{_first_line(exc)}", retry=False) from None
    except RevisionNotFoundError:
        raise HubError(f"spec.model.hub.revision: {hub.revision!r} is not a branch, tag or "
                       f"commit of {hub.id}", retry=False) from None
    except RepositoryNotFoundError:
        raise HubError(f"spec.model.hub.id: no repository {hub.id!r} (or it is private and no "
                       "token was given)", retry=False) from None
    except (HfHubHTTPError, OSError, *_transport_errors()) as exc:
        raise HubError(f"downloading {name} stopped: {_first_line(exc)}; run again to resume",
                       retry=True) from None
    _verify(path, tree)
    (path / RECORD).write_text(json.dumps({"id": hub.id, "revision": hub.revision,
                                           "commit": commit, "files": sorted(tree)}, indent=1))
    out.write(f"downloaded {name} ({time.monotonic() - t0:.1f} s, checksums verified)\n")
    return commit


def _transport_errors() -> tuple[type[BaseException], ...]:
    """A dropped connection, as huggingface_hub's HTTP stack raises it once its own retries are
    spent (httpx2 in the huggingface_hub this project pins)."""
    try:
        import httpx2
    except ImportError:
        return ()
    return (httpx2.HTTPError,)


def _verify(path: Path, tree: dict) -> None:
    for rel, entry in sorted(tree.items()):
        file = path / rel
        data_ok = file.is_file() and file.stat().st_size == entry.size
        if data_ok:
            if entry.lfs is not None:
                data_ok = _sha256(file) == entry.lfs.sha256
            else:
                data_ok = _blob_sha1(file) == entry.blob_id
        if not data_ok:
            file.unlink(missing_ok=True)
            raise HubError(f"{file}: size or checksum differs from the Hub's (deleted; run "
                           "again to download it anew)", retry=True)


def _sha256(file: Path) -> str:
    return _digest(file, hashlib.sha256())


def _blob_sha1(file: Path) -> str:
    """git's blob id: the sha1 of a header and the contents."""
    return _digest(file, hashlib.sha1(b"blob %d\0" % file.stat().st_size))


def _digest(file: Path, h) -> str:  # type: ignore[no-untyped-def]
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
