"""`kiln run`'s access to the rollout's OpenAI endpoint (`spec.rollout.openaiPort`): an API key
generated into `RUN_DIR/openai/api-key` (mode 0600, kept across `--resume`), handed to the
rollout processes through `KILN_OPENAI_API_KEYS`, and where the user finds it.

The endpoint listens on 127.0.0.1 only (the rollout service's default); set `KILN_OPENAI_HOST`
in `kiln run`'s environment to listen elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path

from kiln.api.openai_endpoint import HOST_ENV, KEYS_ENV
from kiln.services.rollout.openai_auth import write_key


def grant(run_dir: Path, port: int) -> str:
    """Make sure the run has a key and the services will read it; the lines to print."""
    path = run_dir / "openai" / "api-key"
    write_key(path)
    os.environ[KEYS_ENV] = str(path)
    host = os.environ.get(HOST_ENV, "127.0.0.1")
    return (f"OpenAI endpoint: http://{host}:{port}/v1 (API key in {path}: send "
            "'Authorization: Bearer <key>')\n")
