"""`kiln run`'s access to the rollout's OpenAI endpoint (`spec.rollout.openaiPort`): an API key
generated into `RUN_DIR/openai/api-key` (mode 0600, kept across `--resume`), handed to the
rollout processes and the router through `KILN_OPENAI_API_KEYS`, and where the user finds it;
and the fleet's router (`kiln.services.rollout.router`), which holds `openaiPort` and sends each
call to the rollout worker that serves its episode (each worker's own endpoint listens on a
free loopback port it announces in `RUN_DIR/<worker>/openai.json`).

The router listens on 127.0.0.1 only; set `KILN_OPENAI_HOST` in `kiln run`'s environment to
listen elsewhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kiln.api.openai_endpoint import HOST_ENV, KEYS_ENV
from kiln.cli.local.processes import ANNOUNCEMENT, terminate
from kiln.services.rollout.openai_auth import write_key


def grant(run_dir: Path, port: int) -> str:
    """Make sure the run has a key and the services will read it; the lines to print."""
    path = run_dir / "openai" / "api-key"
    write_key(path)
    os.environ[KEYS_ENV] = str(path)
    host = os.environ.get(HOST_ENV, "127.0.0.1")
    return (f"OpenAI endpoint: http://{host}:{port}/v1 (API key in {path}: send "
            "'Authorization: Bearer <key>')\n")


class LocalRouter:
    """The router process of one run, restarted on its port if it dies (it keeps no state:
    episode ids name their replica)."""

    def __init__(self, run_dir: Path, port: int) -> None:
        self.run_dir, self.port = run_dir, port
        self.log_path = run_dir / "logs" / "router.log"
        self.ready_file = run_dir / "openai" / "router.json"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kiln.services.rollout.router_main",
               "--host", os.environ.get(HOST_ENV, "127.0.0.1"), "--port", str(self.port),
               "--discover-files", str(self.run_dir / "rollout*" / ANNOUNCEMENT),
               "--ready-file", str(self.ready_file)]
        env = {**os.environ, "KILN_LOG_FORMAT": os.environ.get("KILN_LOG_FORMAT", "json")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.run_dir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace").splitlines()[-10:]
                raise RuntimeError(f"the OpenAI endpoint's router did not start on port "
                                   f"{self.port}:\n" + "\n".join(tail))
            time.sleep(0.05)

    def supervise(self) -> bool:
        """Start it again if it died; whether it had."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.start()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout)
