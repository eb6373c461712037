"""`kiln dev-cluster up DIR` / `kiln dev-cluster down DIR`: a one-machine stand-in for a
Kubernetes cluster, to run an applied RLJob end to end (the operator's stage driver included)
where no real cluster can run.

`up` starts, in the background: the API-and-node process (`kiln.cli.devcluster.cluster`: the
fake API server, the RLJob CRD, and the node agent that runs pods as local processes) and the
real operator process (`kiln-operator`) pointed at it; writes `DIR/kubeconfig`; and returns
once the API answers and the operator is live. Logs: `DIR/logs/`, each pod's under
`DIR/pods/<namespace>/<pod>/logs/`. Pods run in the directory `up` was started from. A second
`up` on a running DIR starts only what is not running (an operator that was killed, say).

`down` stops the operator, then the node agent (which stops every pod), and kills whatever is
left of them; no process stays behind. The API's contents go with it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kiln.cli.devcluster.apiclient import free_port
from kiln.cli.exits import Exit

OPERATOR_SETTINGS = {
    # Quick reactions for a one-machine cluster.
    "KILN_OPERATOR_STATUS_INTERVAL": "2",
    "KILN_OPERATOR_REPAIR_INTERVAL": "5",
    # The node agent runs pods as processes of whoever started it: there is no node kernel to
    # keep sandbox pods away from, so they are allowed as they are.
    "KILN_OPERATOR_ALLOW_PRIVILEGED_SANDBOXES": "true",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dev-cluster", help="a local stand-in cluster: fake API, the operator, pods as processes",
        description="Start or stop a development cluster in DIR: a fake Kubernetes API server, "
                    "the Kiln operator, and a node agent that runs pods as local processes. Not "
                    "a Kubernetes: a harness to run applied RLJobs on one machine.")
    p.add_argument("action", choices=("up", "down", "status"), help="what to do")
    p.add_argument("dir", type=Path, metavar="DIR", help="the cluster's folder (kubeconfig, logs, volumes)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds `up` waits (default 60)")
    p.set_defaults(func=run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def _pid(root: Path, name: str) -> int | None:
    try:
        pid = int((root / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _spawn(root: Path, name: str, argv: list[str], env: dict[str, str]) -> int:
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    (root / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _wait(what: str, check, timeout: float, root: Path, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = ""
    try:
        tail = "\n".join((root / "logs" / f"{log}.log").read_text().splitlines()[-15:])
    except OSError:
        pass
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s; {root}/logs/{log}.log:\n{tail}")


def _live(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def up(root: Path, timeout: float) -> None:
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    if _pid(root, "cluster") is None:
        (root / "kubeconfig").unlink(missing_ok=True)
        (root / "operator.pid").unlink(missing_ok=True)  # an operator of the old API is useless
        _spawn(root, "cluster", [sys.executable, "-m", "kiln.cli.devcluster.cluster", str(root),
                                 "--workdir", os.getcwd()], env)
        _wait("the API server", lambda: (root / "kubeconfig").exists(), timeout, root, "cluster")
    if _pid(root, "operator") is None:
        port = free_port()
        (root / "operator.port").write_text(str(port))
        op_env = {**env, **OPERATOR_SETTINGS, "KUBECONFIG": str(root / "kubeconfig"),
                  "KILN_OPERATOR_ADDRESS_MAP": str(root / "addresses.json"),
                  # The stage driver's TensorBoard files: DIR/tracking/<namespace>/<job>/driver.
                  "KILN_OPERATOR_TRACKING_DIR": str(root / "tracking")}
        _spawn(root, "operator", [str(bin_dir / "kiln-operator"), "--namespace", "default",
                                  "--liveness", f"http://127.0.0.1:{port}/healthz",
                                  "--metrics-port", "0"], op_env)
        _wait("the operator", lambda: _live(port), timeout, root, "operator")


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def down(root: Path, timeout: float) -> None:
    root = root.resolve()
    for name in ("operator", "cluster"):
        pid = _pid(root, name)
        if pid is None:
            continue
        _killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _killpg(pid, signal.SIGKILL)
        (root / f"{name}.pid").unlink(missing_ok=True)
    # Pods the node agent could not stop (it was killed itself): each leads its own session.
    pids_file = root / "pods.pids"
    if pids_file.exists():
        for line in pids_file.read_text().split():
            _killpg(int(line), signal.SIGKILL)
        pids_file.unlink()
    (root / "kubeconfig").unlink(missing_ok=True)


def status(root: Path) -> dict[str, bool]:
    root = root.resolve()
    return {name: _pid(root, name) is not None for name in ("cluster", "operator")}


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "up":
            up(args.dir, args.timeout)
            print(f"dev cluster up: export KUBECONFIG={args.dir.resolve()}/kubeconfig")
            print("apply jobs with: kubectl apply -f JOB.yaml")
        elif args.action == "down":
            down(args.dir, args.timeout)
            print("dev cluster down")
        else:
            print(json.dumps(status(args.dir)))
    except RuntimeError as exc:
        print(f"kiln dev-cluster {args.action}: {exc}", file=sys.stderr)
        return Exit.FAILED
    return Exit.OK
