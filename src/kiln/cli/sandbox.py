"""`kiln sandbox ...`: run a command in a fresh sandbox, check a TaskSet, build the local image.

    kiln sandbox exec [--backend bubblewrap|docker] [--timeout S] [--memory SIZE] [--pids N]
                      [--disk SIZE] [--network] [--workdir DIR] [--output-limit SIZE] -- COMMAND...
    kiln sandbox verify TASKSET.jsonl --solutions DIR [--null-fails] [--backend ...]
    kiln sandbox image                 (build the docker backend's image from the host's /usr)
    kiln sandbox reap [--owner NAME]   (remove sandboxes a killed process left behind)

`exec` exits with the command's exit code, 124 after a timeout and 137 after an OOM kill (each
with a one-line explanation on stderr). Sizes are Kubernetes quantities, as in the manifest's
`sandbox` limits (`256Mi`; `256m` is refused: `m` is milli there). Heavy imports happen inside
the handlers so `kiln --help` stays fast. `register(subparsers)` is what the top-level `kiln` command calls.
"""
from __future__ import annotations

import argparse
import sys

from kiln.cli.conventions import byte_quantity
from kiln.cli.exits import Exit


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sandbox", help="run commands and verifiers in sandboxes",
        description="Run a command in a fresh sandbox, check a task set's reference solutions "
                    "against its verifiers, build the docker backend's image, or remove what a "
                    "killed process left behind.")
    sub = parser.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")

    def backend_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--backend", choices=("bubblewrap", "docker"), default="bubblewrap",
                       help="sandbox backend (default bubblewrap)")
        p.add_argument("--owner", default="cli", help="owner part of sandbox names")
        p.add_argument("--image", default=None, help="image for the docker backend")
        p.add_argument("--docker-url", default=None,
                       help="engine socket (default: DOCKER_HOST, else a private podman)")

    p = sub.add_parser(
        "exec", help="run one command in a fresh sandbox",
        description="Run one command in a fresh sandbox with the given limits and exit with its "
                    "exit code (124 after a timeout, 137 after an OOM kill).")
    backend_args(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--memory", type=byte_quantity("--memory"), default="512Mi",
                   help="memory limit, a Kubernetes quantity (default 512Mi; e.g. 256Mi, 1Gi)")
    p.add_argument("--disk", type=byte_quantity("--disk"), default="1Gi",
                   help="workspace size (a tmpfs; writes past it fail with ENOSPC), a Kubernetes "
                        "quantity (default 1Gi)")
    p.add_argument("--pids", type=int, default=256,
                   help="processes and threads alive at once (default 256)")
    p.add_argument("--cpu", type=float, default=1.0, help="CPU cores (default 1)")
    p.add_argument("--network", action="store_true", help="give the sandbox the host network")
    p.add_argument("--workdir", default=None, help="folder inside /workspace to run in")
    p.add_argument("--output-limit", type=byte_quantity("--output-limit"), default="1Mi",
                   help="bytes kept of stdout and of stderr each, a Kubernetes quantity "
                        "(default 1Mi)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=_run_exec)

    p = sub.add_parser(
        "verify", help="run each task's reference solution through its verifier",
        description="For every task of a task set: set a sandbox up, play the task's reference "
                    "solution, run the verifier; prints PASS or FAIL per task and exits 3 if "
                    "any fails.")
    backend_args(p)
    p.add_argument("taskset", help="TaskSet JSONL file")
    p.add_argument("--solutions", required=True, help="folder of reference solutions")
    p.add_argument("--null-fails", action="store_true",
                   help="also play each task with no solution; a task that passes that way "
                        "fails the check")
    p.set_defaults(func=_run_verify)

    p = sub.add_parser(
        "image", help="build the docker backend's image from the host's /usr",
        description="Build the docker backend's default image (localhost/kiln-sandbox) from the "
                    "host's /usr with a private podman service.")
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.set_defaults(func=_run_image)

    p = sub.add_parser(
        "reap", help="remove sandboxes left behind by a killed process",
        description="Kill and remove every sandbox (cgroups, workspaces, containers) of an "
                    "owner; prints the names removed.")
    backend_args(p)
    p.set_defaults(func=_run_reap)


def _config(args: argparse.Namespace, limits: dict | None = None):
    from kiln.services.sandbox.config import parse_config
    data: dict = {"type": args.backend, "owner": args.owner}
    if limits:
        data["limits"] = limits
    if args.backend == "docker":
        if args.image:
            data["image"] = args.image
        if args.docker_url:
            data["base_url"] = args.docker_url
    return parse_config(data)


def _engine(config):
    import contextlib
    if config.type == "docker":
        from kiln.services.sandbox.podman_service import LocalEngine
        return LocalEngine(config)
    return contextlib.nullcontext(config)


def _run_exec(args: argparse.Namespace) -> int:
    import asyncio

    from kiln.services.sandbox.factory import make_sandbox
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("kiln sandbox exec: no command given (put it after --)", file=sys.stderr)
        return Exit.REFUSED
    config = _config(args, {"memory_bytes": args.memory, "disk_bytes": args.disk,
                            "pids": args.pids, "cpu": args.cpu,
                            "timeout_seconds": args.timeout, "network": args.network,
                            "output_limit_bytes": args.output_limit})

    async def go(cfg):
        async with make_sandbox(cfg) as sandbox:
            return await sandbox.exec(command, workdir=args.workdir)

    with _engine(config) as cfg:
        result = asyncio.run(go(cfg))
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)
    if result.timed_out:
        print(f"kiln sandbox: killed after the {args.timeout:g} s timeout (exit 124)",
              file=sys.stderr)
    elif result.oom_killed:
        print(f"kiln sandbox: killed by the OOM killer at the {args.memory / 2**20:g}Mi memory "
              "limit (exit 137)", file=sys.stderr)
    return result.exit_code


def _run_verify(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from kiln.services.sandbox.runner import verify_taskset
    config = _config(args)
    with _engine(config) as cfg:
        outcomes = asyncio.run(verify_taskset(cfg, Path(args.taskset), Path(args.solutions),
                                              null_fails=args.null_fails))
    failed = 0
    for o in outcomes:
        if o.passed:
            print(f"PASS {o.task_id} reward={o.result.reward:g}")
            continue
        failed += 1
        detail = o.error or f"reward={o.result.reward:g} flags={o.result.flags} " \
                            f"{o.result.output.strip().splitlines()[-1:] or ''}"
        print(f"FAIL {o.task_id} {detail}")
    print(f"{len(outcomes) - failed}/{len(outcomes)} tasks pass")
    return Exit.PROBLEMS_FOUND if failed else Exit.OK


def _run_image(args: argparse.Namespace) -> int:
    from kiln.services.sandbox.podman_service import build_host_image
    print(build_host_image(force=args.force))
    return 0


def _run_reap(args: argparse.Namespace) -> int:
    from kiln.services.sandbox.factory import reap_orphans
    config = _config(args)
    with _engine(config) as cfg:
        removed = reap_orphans(cfg)
    for name in removed:
        print(name)
    return 0


def main(argv: list[str] | None = None) -> int:
    from kiln.cli.exits import KilnParser
    parser = KilnParser(prog="kiln")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
