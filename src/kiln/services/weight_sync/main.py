"""`kiln-weight-sync`: the weight-sync service process (one per job).

Holds the latest policy version in memory and streams it to every subscribed rollout replica;
see `servicer.py` for the RPCs and `store.py` for the rules. Flags are the common service
flags (`kiln-weight-sync --help`).
"""
from __future__ import annotations

import argparse
import sys

from kiln.api.spec import RLJob, WeightSyncSpec
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.common.server import Registration, run_service
from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer
from kiln.services.weight_sync.store import WeightStore


async def build(job: RLJob | None, args: argparse.Namespace):
    spec = job.spec.weight_sync if job is not None else WeightSyncSpec()
    servicer = WeightSyncServicer(WeightStore(max_version_step=spec.max_version_step,
                                              abandon_after_s=2 * spec.timeout_seconds),
                                  commit_timeout=spec.timeout_seconds)
    return [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)], None


def main(argv: list[str] | None = None) -> int:
    return run_service("weight-sync", build, argv)


if __name__ == "__main__":
    sys.exit(main())
