"""Host-side file access to a sandbox workspace that cannot be tricked into leaving it.

The service runs as root and the workspace is written by untrusted code, so a path is walked
one component at a time with `openat(..., O_NOFOLLOW)`: a symlink anywhere on the way (even
one created between our check and our open) fails the call instead of being followed, and `..`
never reaches the walk (`workspace_relpath` rejects it first).

Not covered: file access inside containers (the docker backend goes through the engine API).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .interface import PathEscapeError, workspace_relpath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk_parent(root: Path, rel: str, create: bool, uid: int, gid: int) -> tuple[int, str]:
    """Open the parent directory of `rel` beneath `root`; return (dir fd, final name)."""
    parts = rel.split("/")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathEscapeError(f"path: {rel!r} goes through a symlink or non-folder "
                                          f"{part!r}") from None
                raise
            os.close(fd)
            fd = nxt
        return fd, parts[-1]
    except BaseException:
        os.close(fd)
        raise


def _open_beneath(root: Path, path: str, flags: int, *, mode: int = 0, create: bool = False,
                  uid: int = -1, gid: int = -1):
    """A regular file beneath `root` opened with `flags` (plus O_NOFOLLOW), as a file object;
    PathEscapeError for a symlink or anything that is not a regular file."""
    rel = workspace_relpath(path)
    dfd, name = _walk_parent(root, rel, create=create, uid=uid, gid=gid)
    try:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                         dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathEscapeError(f"path: {path!r} is a symlink") from None
            raise
    finally:
        os.close(dfd)
    f = os.fdopen(fd, "rb" if flags == os.O_RDONLY else "wb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise PathEscapeError(f"path: {path!r} is not a regular file")
    return f


def read_beneath(root: Path, path: str, max_bytes: int | None = None) -> bytes:
    with _open_beneath(root, path, os.O_RDONLY) as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def write_beneath(root: Path, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
    with _open_beneath(root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode=mode, create=True,
                       uid=uid, gid=gid) as f:
        os.fchown(f.fileno(), uid, gid)
        os.fchmod(f.fileno(), mode)
        f.write(data)
