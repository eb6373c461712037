"""Process entry point of the sandbox service (`kiln-sandbox`).

    kiln-sandbox --address 127.0.0.1:50061 --metrics-port 0 [--job job.yaml]
                 [--backend bubblewrap|docker] [--owner NAME] [--max-concurrent N]
                 [--warm-pool N] [--tasks-dir DIR]

With `--job`, the backend and limits come from the RLJob's `spec.sandbox`; flags given on the
command line win. The docker backend uses DOCKER_HOST (the dind sidecar in a pod) or, when
unset, a private podman service started here. At start the service reaps every sandbox of its
owner left by an earlier, killed process.
"""
from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

from kiln.api.task_sources import TASKS_ROOT_ENV


def _parser():
    from kiln.services.common.server import service_argparser
    p = service_argparser("sandbox")
    p.add_argument("--backend", choices=("bubblewrap", "docker"), default=None)
    p.add_argument("--owner", default=None,
                   help="unique per live service (default: the host name); names sandboxes")
    p.add_argument("--max-concurrent", type=int, default=None)
    p.add_argument("--warm-pool", type=int, default=None)
    p.add_argument("--max-parallel-starts", type=int, default=8)
    p.add_argument("--tasks-dir", type=Path, default=None,
                   help="folder relative task paths (repos, corpora) resolve against")
    return p


def _owner(args) -> str:
    import re
    raw = args.owner or os.environ.get("POD_NAME") or socket.gethostname()
    return re.sub(r"[^a-z0-9-]", "-", raw.lower()).strip("-")[:40] or "sandbox"


async def build(job, args):
    from kiln.protos.kiln.v1 import sandbox_pb2_grpc
    from kiln.services.common.server import Registration

    from .config import BubblewrapConfig, DockerConfig, config_from_spec
    from .servicer import SandboxServicer
    from .sessions import PoolConfig, SessionManager

    owner = _owner(args)
    spec = job.spec.sandbox if job is not None else None
    if spec is not None:
        config = config_from_spec(spec, owner)
    else:
        config = BubblewrapConfig(owner=owner)
    if args.backend and args.backend != config.type:
        config = (DockerConfig if args.backend == "docker" else BubblewrapConfig)(
            owner=owner, limits=config.limits)
    if job is not None and job.spec.rollout.openai_port:
        # The job's OpenAI endpoint feeds training: no networked sandbox may call it.
        config = config.model_copy(update={"egress_ports": [job.spec.rollout.openai_port]})
    engine = None
    if isinstance(config, DockerConfig):
        from .podman_service import LocalEngine
        engine = LocalEngine(config)
        config = engine.__enter__()
    pool = PoolConfig(
        max_concurrent=args.max_concurrent or (spec.max_concurrent if spec else 64),
        max_per_owner=spec.max_per_owner if spec else None,
        warm_pool=args.warm_pool if args.warm_pool is not None else (spec.warm_pool if spec else 0),
        max_parallel_starts=args.max_parallel_starts,
        tasks_dir=(args.tasks_dir or Path.cwd()).resolve())
    manager = SessionManager(config, pool)
    await manager.start()

    registrations = [Registration(sandbox_pb2_grpc.add_SandboxServicer_to_server,
                                  SandboxServicer(manager), "kiln.v1.Sandbox")]
    episodes = None
    if job is not None:
        # Episodes of the job's task sets (kiln.v1.Environment), for the rollout service.
        from kiln.protos.kiln.v1 import env_pb2_grpc

        from .env_servicer import EnvironmentServicer
        from .episodes import EpisodeManager

        # One bound on living sandboxes, sessions' and episodes' together.
        episodes = EpisodeManager(job, base_dir=Path.cwd(), config=config.model_copy(
            update={"owner": f"{owner[:37]}-ep"}), room=manager.room,
            # An episode waits for a sandbox as long as it may run at all.
            room_timeout_s=job.spec.rollout.episode_timeout_seconds,
            # Where the operator mounted the task sets kept in ConfigMaps and PVCs.
            tasks_root=os.environ.get(TASKS_ROOT_ENV))
        registrations.append(Registration(env_pb2_grpc.add_EnvironmentServicer_to_server,
                                          EnvironmentServicer(episodes), "kiln.v1.Environment"))

    reaper = None
    if episodes is not None:
        # Episodes whose rollout died are never closed by it: reclaim their sandboxes after
        # the episode deadline plus grading (the manager's idle TTL).
        async def reap_forever() -> None:
            while True:
                await asyncio.sleep(30)
                await episodes.reap_idle()

        reaper = asyncio.ensure_future(reap_forever())

    async def on_stop():
        if reaper is not None:
            reaper.cancel()
        if episodes is not None:
            await episodes.close_all()
            episodes.close_plugins()
        await manager.close()
        if engine is not None:
            engine.__exit__(None, None, None)

    return registrations, on_stop


#: Largest request the sandbox service accepts.
SANDBOX_MAX_REQUEST_BYTES = 16 << 20


def main(argv: list[str] | None = None) -> int:
    from kiln.services.common.server import ServerLimits, run_service
    # Requests are actions, commands and single files: 16 MiB is a large file, not a batch.
    return run_service("sandbox", build, argv, parser=_parser(),
                       limits=ServerLimits(max_receive_bytes=SANDBOX_MAX_REQUEST_BYTES))


if __name__ == "__main__":
    sys.exit(main())
