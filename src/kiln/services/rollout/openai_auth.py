"""API keys of the OpenAI endpoint: where they come from and who a request's key belongs to.

Keys are read from a file (one key per non-empty line: `kiln serve --api-key-file`, `kiln run`'s
`RUN_DIR/openai/api-key`) or a folder (one key per file, named by the file: a Secret mounted
in the rollout pod, `spec.rollout.openai.apiKeySecret`). Each key is known by its *caller id*,
a hash prefix that is safe to log and that episodes and groups are bound to; the key itself is
only compared, in constant time over its hash. A key shorter than 16 characters is refused.

Not covered: rotation while serving (a restart reads the keys again).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from kiln.api.openai_endpoint import KEYS_ENV

MIN_KEY_CHARS = 16


def caller_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeys:
    """The keys a server accepts, by the sha256 of each."""

    def __init__(self, keys: dict[str, str]) -> None:
        """`keys`: key -> name (for logs)."""
        if not keys:
            raise ValueError("the OpenAI endpoint needs at least one API key")
        short = [name for key, name in keys.items() if len(key) < MIN_KEY_CHARS]
        if short:
            raise ValueError(f"API key {short[0]!r} is shorter than {MIN_KEY_CHARS} characters")
        self._by_digest = {hashlib.sha256(k.encode()).digest(): (caller_id(k), n)
                           for k, n in keys.items()}

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        """From a key file or a folder of them (see the module doc)."""
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            return cls({p.read_text().strip(): p.name for p in files if p.read_text().strip()})
        if not path.is_file():
            raise ValueError(f"API key file {path} does not exist")
        lines = [line.strip() for line in path.read_text().splitlines()]
        return cls({key: f"{path.name}:{i + 1}" for i, key in enumerate(lines) if key})

    @classmethod
    def from_env(cls) -> ApiKeys:
        where = os.environ.get(KEYS_ENV)
        if not where:
            raise ValueError(f"{KEYS_ENV} is not set: the OpenAI endpoint (spec.rollout.openaiPort) "
                             "serves only callers with an API key (spec.rollout.openai.apiKeySecret)")
        return cls.load(Path(where))

    def identify(self, authorization: str | None) -> str | None:
        """The caller id of an `Authorization: Bearer <key>` header, or None if it names no key
        of this server."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        for known, (cid, _) in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return cid
        return None


def write_key(path: Path) -> str:
    """A new random key in `path` (mode 0600; kept if it exists, so a resumed run keeps its
    key). Returns the key."""
    if path.exists():
        return path.read_text().strip()
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    key = "kiln-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key
