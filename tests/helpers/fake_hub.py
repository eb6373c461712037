"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that huggingface_hub's
downloads use (repository info, the file tree, and `resolve` with HEAD, GET and Range), served
from a folder, so that tests download through the real client (HF_ENDPOINT) and never reach the
internet. Dataset repositories (`datasets`) are served under the Hub's dataset routes
(`/api/datasets/...`, `/datasets/<id>/resolve/...`, and the `paths-info` POST), which the
`datasets` library reads through huggingface_hub's file system.

Files are plain or "LFS" (every *.safetensors file), with the Hub's checksums: a git blob sha1
for each file, and a sha256 for LFS files. A repository may be gated (only `token` is let in),
and `drop` makes the next GETs of a file stop half-way, as a dropped connection does.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    folder: Path
    token: str | None = None
    """Gated: requests must carry `Authorization: Bearer <token>`."""
    commit: str = COMMIT
    revisions: tuple[str, ...] = ("main",)

    def files(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.folder)): p.read_bytes()
                for p in sorted(self.folder.rglob("*")) if p.is_file()}


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop: dict[str, int] = field(default_factory=dict)
    """File -> how many of its next GETs send half the bytes and close the connection."""
    gets: list[str] = field(default_factory=list)
    """Every file GET (path in the repository), in order, with its Range header if any."""
    corrupt: dict[str, bytes] = field(default_factory=dict)
    """Files served with other bytes than the checksums say (a bad mirror, a flipped bit)."""
    datasets: dict[str, Repo] = field(default_factory=dict)
    """Dataset repositories, by id."""

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def do_POST(self) -> None:  # noqa: N802
                # /api/datasets/{owner}/{name}/paths-info/{revision}: the entries of the paths
                # named in the form body (which files exist, and their checksums).
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                if parts[:2] != ["api", "datasets"] or parts[4:5] != ["paths-info"]:
                    self._error(404, "EntryNotFound", self.path)
                    return
                repo = self._repo("/".join(parts[2:4]), hub.datasets)
                if repo is None:
                    return
                files, wanted = repo.files(), form.get("paths", [])
                folders = {str(PurePosixPath(f).parent) for f in files}
                self._json([_tree_entry(p, files[p]) for p in wanted if p in files]
                           + [{"type": "directory", "path": p, "oid": COMMIT}
                              for p in wanted if p in folders])

            def _json(self, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, code: int, error_code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _repo(self, repo_id: str, repos: dict[str, Repo] | None = None) -> Repo | None:
                repo = (hub.repos if repos is None else repos).get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                    return None
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
                    return None
                return repo

            def _serve(self, body: bool) -> None:
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                repos = hub.repos
                if parts[:2] == ["api", "datasets"]:
                    parts, repos = ["api", "models", *parts[2:]], hub.datasets
                elif parts[:1] == ["datasets"]:
                    parts, repos = parts[1:], hub.datasets
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id = "/".join(parts[2:4])
                    repo = self._repo(repo_id, repos)
                    if repo is None:
                        return
                    rest = parts[4:]
                    if rest[:1] == ["revision"]:
                        if rest[1] not in (*repo.revisions, repo.commit):
                            self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                            return
                        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit,
                                    "private": False, "siblings": [{"rfilename": f} for f in repo.files()]})
                        return
                    if rest[:1] == ["tree"]:
                        # tree/{revision}[/{folder}]: the folder's entries (all, with ?recursive)
                        folder = "/".join(rest[2:])
                        recursive = "recursive" in parse_qs(url.query)
                        self._json(_listing(repo.files(), folder, recursive))
                        return
                    self._error(404, "EntryNotFound", self.path)
                    return
                # /{owner}/{name}/resolve/{revision}/{path...}
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, rev, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    repo = self._repo(repo_id, repos)
                    if repo is None:
                        return
                    files = repo.files()
                    if path not in files or rev not in (*repo.revisions, repo.commit):
                        self._error(404, "EntryNotFound", f"{path} not found")
                        return
                    data = files[path]
                    served = hub.corrupt.get(path, data)
                    start = 0
                    if rng := self.headers.get("Range"):
                        start = int(rng.removeprefix("bytes=").split("-")[0])
                    self.send_response(206 if start else 200)
                    self.send_header("X-Repo-Commit", repo.commit)
                    etag = _tree_entry(path, data).get("lfs", {}).get("oid") or _blob_sha1(data)
                    self.send_header("ETag", f'"{etag}"')
                    self.send_header("Content-Length", str(len(served) - start))
                    self.send_header("Accept-Ranges", "bytes")
                    if start:
                        self.send_header("Content-Range", f"bytes {start}-{len(served) - 1}/{len(served)}")
                    self.end_headers()
                    if not body:
                        return
                    hub.gets.append(path + (f" from {start}" if start else ""))
                    if hub.drop.get(path, 0) > 0:
                        hub.drop[path] -= 1
                        self.wfile.write(served[start:start + (len(served) - start) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    self.wfile.write(served[start:])
                    return
                self._error(404, "EntryNotFound", self.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _tree_entry(path: str, data: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(data), "oid": _blob_sha1(data)}
    if path.endswith(".safetensors"):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return entry


def _listing(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
    """A `tree` answer: the files and folders under `folder` ("" for the root)."""
    prefix = f"{folder}/" if folder else ""
    out, folders = [], set()
    for path, data in files.items():
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix):].split("/")
        for depth in range(1, len(rest)):
            if recursive or depth == 1:
                folders.add(prefix + "/".join(rest[:depth]))
        if recursive or len(rest) == 1:
            out.append(_tree_entry(path, data))
    return [{"type": "directory", "path": f, "oid": COMMIT} for f in sorted(folders)] + out
