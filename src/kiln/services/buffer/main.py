"""`kiln-buffer`: the buffer service process.

    kiln-buffer --job job.yaml --run-dir runs/x --address 0.0.0.0:50055 [--stage rl]

The store lives in `<run-dir>/buffer`. Capacity comes from `spec.buffer.capacity`; group size and
tau from the RL stage named by `--stage` (default: the job's first RL stage; without one, group
size 1 and no freshness bound, which suits SFT). `--capacity`, `--group-size` and `--tau`
override the job; `--lease-timeout` (default 300 s) is how long a served batch may go unacked
before it is served again. A Configure call recorded in the store (e.g. at a stage boundary)
wins over both on restart, since it is the newer intent.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Sequence

from kiln.api.base import quantity_value
from kiln.api.spec import RLJob, RLStage
from kiln.protos.kiln.v1 import buffer_pb2_grpc
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.records import CorruptLog
from kiln.services.buffer.servicer import BufferServicer
from kiln.services.buffer.types import BufferConfig
from kiln.services.common.server import Registration, run_service, service_argparser


def _tau(text: str) -> int | str:
    if text == "none":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of versions (0 or more) or 'none', "
                                         f"got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = service_argparser("buffer")
    p.add_argument("--stage", help="RL stage whose groupSize and tau apply (default: the first)")
    p.add_argument("--capacity", type=int, help="override spec.buffer.capacity")
    p.add_argument("--group-size", type=int, help="override the stage's rl.groupSize")
    p.add_argument("--tau", type=_tau, help="override the stage's rl.tau: a number of versions, "
                   "or 'none' for no bound")
    p.add_argument("--lease-timeout", type=float, default=300.0,
                   help="seconds a served batch may go unacknowledged before it is served again")
    p.add_argument("--segment-bytes", type=int, default=64 << 20, help="segment file size")
    return p


def config_from(job: RLJob | None, args: argparse.Namespace) -> BufferConfig:
    values: dict = {"segment_bytes": args.segment_bytes, "lease_timeout": args.lease_timeout}
    if job is not None:
        values["capacity"] = job.spec.buffer.capacity
        values["capacity_bytes"] = int(quantity_value(job.spec.buffer.capacity_bytes))
        rl = [s for s in job.spec.stages if isinstance(s, RLStage)]
        if args.stage is not None:
            named = [s for s in job.spec.stages if s.name == args.stage]
            if not named:
                raise ValueError(f"--stage {args.stage!r}: no such stage in the job "
                                 f"(stages: {[s.name for s in job.spec.stages]})")
            rl = [s for s in named if isinstance(s, RLStage)]
        if rl:
            values["group_size"] = rl[0].rl.group_size
            values["tau"] = rl[0].rl.tau
    elif args.stage is not None:
        raise ValueError("--stage needs --job")
    if args.capacity is not None:
        values["capacity"] = args.capacity
    if args.group_size is not None:
        values["group_size"] = args.group_size
    if args.tau is not None:
        values["tau"] = None if args.tau == "none" else args.tau
    return BufferConfig(**values)


async def build(job: RLJob | None, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    config = config_from(job, args)
    # Replaying a large log takes a while; keep the event loop free for health checks.
    buffer = await asyncio.to_thread(TrajectoryBuffer.open, args.run_dir / "buffer", config)
    servicer = BufferServicer(buffer)
    reg = Registration(buffer_pb2_grpc.add_BufferServicer_to_server, servicer, "kiln.v1.Buffer")
    return [reg], servicer.close


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_service("buffer", build, argv, build_parser())
    except CorruptLog as exc:
        # Damage a restart cannot fix, and no record is dropped to get past it: say where.
        print(f"kiln-buffer: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
