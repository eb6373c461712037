"""A private Docker-compatible engine for one machine: `podman system service` on its own socket.

In a pod the docker backend talks to the dind sidecar. Everywhere else (a laptop, CI) this
module starts podman's Docker API service with its own storage and socket under `root_dir`, so
it shares nothing with any other podman user on the host, and stops it again. On these hosts
podman needs `--runtime runc` (crun fails on hybrid cgroups) and explicit ulimits (root lacks
CAP_SYS_RESOURCE); `DockerConfig.ulimits` carries the latter.

`build_host_image` makes a small image from the host's own /usr: a chosen set of tools (shell,
coreutils, grep/sed/awk, git, python3 with its standard library) plus the shared libraries they
link, imported with `podman import`. It needs no registry and no network.

Several services may share one `root_dir` (two test runs, or `kiln run` beside a test run on
one machine): podman locks its storage for concurrent users, and each service gets its own
socket and configuration file, so starting or stopping one never touches another's.

Not covered: rootless podman, registries, Dockerfiles.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

DEFAULT_ROOT = Path(os.environ.get("KILN_PODMAN_ROOT", "/var/tmp/kiln-podman"))
DEFAULT_IMAGE = "localhost/kiln-sandbox:latest"
#: Seconds an exec session's conmon waits after the command exits (podman's default is 300).
EXEC_EXIT_DELAY_S = 5

#: Host tools copied into the image built by `build_host_image`, with their libraries.
IMAGE_TOOLS = [
    "sh", "dash", "bash", "cat", "ls", "echo", "mkdir", "rm", "rmdir", "cp", "mv", "ln", "head",
    "tail", "wc", "sort", "uniq", "tr", "cut", "tee", "touch", "chmod", "env", "id", "sleep",
    "true", "false", "test", "[", "printf", "pwd", "readlink", "realpath", "dirname", "basename",
    "mktemp", "seq", "yes", "nohup", "setsid", "timeout", "kill", "ps", "grep", "sed", "mawk",
    "awk", "find", "xargs", "diff", "cmp", "patch", "tar", "gzip", "stat", "date", "du", "df",
    "python3", "python3.11", "git", "sha256sum", "md5sum", "expr", "uname", "whoami", "dd",
]
IMAGE_TREES = ["/usr/lib/python3.11", "/usr/lib/git-core", "/usr/share/git-core"]


def podman_base_args(root_dir: Path) -> list[str]:
    return ["podman", "--root", str(root_dir / "storage"), "--runroot", str(root_dir / "run"),
            "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]


class PodmanService:
    """Runs `podman system service` on a socket of its own under `root_dir` until `stop()`."""

    def __init__(self, root_dir: Path = DEFAULT_ROOT) -> None:
        self.root_dir = Path(root_dir)
        # The pid in the name lets a later start remove the sockets of services whose process
        # died without stop(); the random part separates services of one process.
        self.name = f"api-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.socket = self.root_dir / f"{self.name}.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 30.0) -> "PodmanService":
        if shutil.which("podman") is None:
            raise RuntimeError("podman not found: install podman and runc (not retryable)")
        for sub in ("storage", "run"):
            (self.root_dir / sub).mkdir(parents=True, exist_ok=True)
        _remove_dead_sockets(self.root_dir)
        # By default each exec leaves two conmon processes waiting 300 s for someone to read
        # its exit code; we read it (exec_inspect) right after the output ends, so a few
        # seconds suffice (0 would remove the session before exec_inspect sees it).
        conf = self.root_dir / f"{self.name}.conf"
        conf.write_text(f"[engine]\nexit_command_delay = {EXEC_EXIT_DELAY_S}\n")
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        log = open(self.root_dir / "service.log", "ab")
        # Run in the service's own folder: conmon writes an `oom` marker file into its working
        # directory when an exec session is OOM-killed.
        self.proc = subprocess.Popen(
            [*podman_base_args(self.root_dir), "system", "service", "--time", "0",
             self.base_url], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env, cwd=self.root_dir)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"podman system service exited with {self.proc.returncode}; "
                                   f"see {self.root_dir / 'service.log'}")
            if self.socket.exists() and self._ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"podman system service did not answer within {timeout_s} s "
                           "(retryable)")

    def _ping(self) -> bool:
        import docker
        try:
            client = docker.DockerClient(base_url=self.base_url, timeout=2)
            ok = client.ping()
            client.close()
            return bool(ok)
        except Exception:  # not listening yet; the caller polls until its deadline
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.socket.unlink(missing_ok=True)
        (self.root_dir / f"{self.name}.conf").unlink(missing_ok=True)

    def __enter__(self) -> "PodmanService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _remove_dead_sockets(root_dir: Path) -> None:
    """Remove the sockets and configuration files left by services whose process is gone."""
    for path in [*root_dir.glob("api-*-*.sock"), *root_dir.glob("api-*-*.conf")]:
        try:
            pid = int(path.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


# -- image from the host's /usr -------------------------------------------------------------
def _closure(tools: list[str]) -> set[str]:
    """Absolute paths of `tools` and every shared library they (and python's extension
    modules) load."""
    files: set[str] = set()
    for tool in tools:
        path = shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if path:
            files.add(path)
    dynload = Path("/usr/lib/python3.11/lib-dynload")
    objects = sorted(files) + [str(p) for p in dynload.glob("*.so")]
    for chunk in range(0, len(objects), 64):
        out = subprocess.run(["ldd", *objects[chunk:chunk + 64]], capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            for token in line.split():
                if token.startswith("/") and not token.endswith(":"):
                    files.add(token)
    return files


def _add_path(tar: tarfile.TarFile, path: str, seen: set[str]) -> None:
    """Add `path` with its parents resolved, following and recording symlink chains."""
    while True:
        real_parent = os.path.realpath(os.path.dirname(path))
        path = os.path.join(real_parent, os.path.basename(path))
        if path in seen or not os.path.lexists(path):
            return
        seen.add(path)
        if os.path.islink(path):
            tar.add(path, arcname=path.lstrip("/"), recursive=False)
            target = os.readlink(path)
            path = target if target.startswith("/") else os.path.join(real_parent, target)
            continue
        tar.add(path, arcname=path.lstrip("/"), recursive=True,
                filter=lambda t: None if "__pycache__" in t.name else t)
        return


def _add_dir(tar: tarfile.TarFile, name: str, mode: int, uid: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, uid
    tar.addfile(info)


def _add_text(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def write_host_rootfs_tar(out: Path, uid: int = 65534) -> None:
    files = _closure(IMAGE_TOOLS)
    seen: set[str] = set()
    with tarfile.open(out, "w") as tar:
        for d in ("usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin", "etc", "proc", "sys",
                  "dev", "run", "var", "var/tmp", "root"):
            _add_dir(tar, d, 0o755)
        _add_dir(tar, "tmp", 0o1777)
        _add_dir(tar, "workspace", 0o755, uid=uid)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                             ("sbin", "usr/sbin")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for path in sorted(files) + IMAGE_TREES:
            _add_path(tar, path, seen)
        _add_text(tar, "etc/passwd", f"root:x:0:0:root:/root:/bin/sh\n"
                                     f"sandbox:x:{uid}:{uid}:sandbox:/workspace:/bin/sh\n")
        _add_text(tar, "etc/group", f"root:x:0:\nsandbox:x:{uid}:\n")
        _add_text(tar, "etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")


def image_fingerprint() -> str:
    """Changes when the tool list or the host's binaries change, so the image is rebuilt."""
    h = hashlib.sha256("\n".join(IMAGE_TOOLS + IMAGE_TREES).encode())
    for tool in IMAGE_TOOLS:
        path = shutil.which(tool, path="/usr/bin:/bin")
        if path:
            st = os.stat(path)
            h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_host_image(root_dir: Path = DEFAULT_ROOT, tag: str = DEFAULT_IMAGE,
                     force: bool = False) -> str:
    """Build (or reuse) `tag` from the host's /usr; returns the tag."""
    base = podman_base_args(root_dir)
    fingerprint = image_fingerprint()
    if not force:
        got = subprocess.run([*base, "image", "inspect", "--format",
                              '{{ index .Labels "kiln.fingerprint" }}', tag],
                             capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == fingerprint:
            return tag
    (root_dir / "storage").mkdir(parents=True, exist_ok=True)
    # Its own file: another process may be building the same image from the same root.
    tar_path = root_dir / f"rootfs-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"
    write_host_rootfs_tar(tar_path)
    try:
        subprocess.run([*base, "import", "--change", f"LABEL kiln.fingerprint={fingerprint}",
                        "--change", "WORKDIR /workspace", "--change", "CMD /bin/sh",
                        str(tar_path), tag], check=True, capture_output=True)
    finally:
        tar_path.unlink(missing_ok=True)
    return tag


class LocalEngine:
    """Context manager giving a DockerConfig an engine: the configured `base_url` or
    DOCKER_HOST when set (a dind sidecar), else a private podman service started here (and the
    host image built when the default image is asked for), stopped on exit."""

    def __init__(self, config, root_dir: Path = DEFAULT_ROOT) -> None:
        self.config = config
        self.root_dir = root_dir
        self.service: PodmanService | None = None

    def __enter__(self):
        if self.config.base_url or os.environ.get("DOCKER_HOST"):
            return self.config
        self.service = PodmanService(self.root_dir).start()
        if self.config.image == DEFAULT_IMAGE:
            build_host_image(self.root_dir, DEFAULT_IMAGE)
        return self.config.model_copy(update={"base_url": self.service.base_url})

    def __exit__(self, *exc: object) -> None:
        if self.service is not None:
            self.service.stop()
