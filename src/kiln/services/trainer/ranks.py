"""The trainer's ranks: a world of `tensorParallel x dataParallel` processes behind one service.

Rank 0 serves `kiln.v1.Trainer` and runs the stages. Every other rank follows: it builds the
same engine and makes each engine call rank 0 makes, in the same order and with the same
arguments, which rank 0 broadcasts over the world before making the call itself
(`ReplicatedEngine` on rank 0, `follow` on the others). The engine's collectives (TP gathers,
the DP gradient sum) then line up on every rank. What rank 0 changes on the engine between
calls (stage, learning rate, loss settings) travels with each call.

Processes:
- a replica is one pod (one process tree locally). Its `kiln-trainer` is local rank 0 and starts
  the replica's other `tensorParallel - 1` ranks as child processes (`--local-rank i`) that die
  with it (PR_SET_PDEATHSIG) and ignore SIGTERM: they exit when rank 0 says so, after its final
  checkpoint, which they take part in;
- replica 0 serves the Trainer service; the other replicas' local rank 0 answers health checks
  only and follows;
- rendezvous is `MASTER_ADDR`/`MASTER_PORT` (replica 0's address, set by the operator); a single
  replica without them gets a loopback port from its local rank 0;
- the replica index is `KILN_TRAINER_REPLICA`, or `KILN_TRAINER_REPLICA_OFFSET` plus the
  StatefulSet ordinal at the end of the host name.

Failure: a rank that dies breaks the world; gloo (NCCL) reports it to the others at their next
collective, every rank exits non-zero and is restarted (Kubernetes, or the launcher), and
replica 0 resumes from its last checkpoint and hands that state to the other replicas. Rank 0
sends a heartbeat every `HEARTBEAT_S` while idle (waiting for the buffer, or between stages),
so a follower never waits long enough to hit the collective timeout.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

log = logging.getLogger("kiln.trainer.ranks")

HEARTBEAT_S = 30.0
_PR_SET_PDEATHSIG = 1

# Engine calls rank 0 forwards; anything else it does on the engine is local or travels in
# `_settings`.
FORWARDED = ("step", "sft_step", "new_version", "gathered_hf_tensors", "export_hf", "save_checkpoint",
             "load_checkpoint")


@dataclass(frozen=True)
class World:
    tp: int
    dp: int
    replica: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def rank(self) -> int:
        return self.replica * self.tp + self.local_rank

    @property
    def size(self) -> int:
        return self.tp * self.dp

    def env(self, local_rank: int) -> dict[str, str]:
        """Environment of this replica's `local_rank` process (torch's env:// rendezvous)."""
        return {"RANK": str(self.replica * self.tp + local_rank), "WORLD_SIZE": str(self.size),
                "LOCAL_RANK": str(local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), "KILN_TRAINER_REPLICA": str(self.replica)}


def replica_index(environ: dict[str, str] | os._Environ = os.environ) -> int:
    if "KILN_TRAINER_REPLICA" in environ:
        return int(environ["KILN_TRAINER_REPLICA"])
    if "KILN_TRAINER_REPLICA_OFFSET" in environ:
        host = environ.get("HOSTNAME") or socket.gethostname()
        m = re.search(r"-(\d+)$", host)
        if m is None:
            raise ValueError(f"KILN_TRAINER_REPLICA_OFFSET is set but host name {host!r} ends in no "
                             "StatefulSet ordinal (-N); set KILN_TRAINER_REPLICA instead")
        return int(environ["KILN_TRAINER_REPLICA_OFFSET"]) + int(m.group(1))
    return 0


def world_from(tp: int, dp: int, local_rank: int,
               environ: dict[str, str] | os._Environ = os.environ) -> World:
    """This process's place in the world, from its environment. ValueError when the
    environment cannot form the world the job asks for (a configuration error)."""
    replica = replica_index(environ)
    if not 0 <= replica < dp:
        raise ValueError(f"trainer replica {replica} is outside spec.trainer.dataParallel={dp}")
    if not 0 <= local_rank < tp:
        raise ValueError(f"--local-rank {local_rank} is outside spec.trainer.tensorParallel={tp}")
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr and port:
        return World(tp, dp, replica, local_rank, addr, int(port))
    if dp > 1:
        raise ValueError(f"spec.trainer.dataParallel={dp} needs MASTER_ADDR and MASTER_PORT "
                         "(replica 0's address; the operator sets them)")
    if local_rank != 0:
        raise ValueError("a local rank other than 0 needs MASTER_ADDR and MASTER_PORT from local rank 0")
    from kiln.models.parallel import free_port

    return World(tp, dp, replica, 0, "127.0.0.1", free_port())


def enter(world: World) -> None:
    """Make `world` this process's torch.distributed rendezvous (read by `init_parallel`)."""
    os.environ.update(world.env(world.local_rank))


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn_local_ranks(world: World, argv: list[str]) -> list[subprocess.Popen]:
    """Start this replica's local ranks 1..tp-1: `kiln-trainer ARGV --local-rank i`."""
    procs = []
    for i in range(1, world.tp):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kiln.services.trainer.main", *argv, "--local-rank", str(i)],
            env={**os.environ, **world.env(i)}, preexec_fn=_die_with_parent))
    return procs


def _settings(engine) -> dict[str, Any]:
    return {
        "config": engine.config, "stage": engine.stage, "policy_version": engine.policy_version,
        # A rollback (`selection.restore_weights`) keeps rank 0's counters, not the checkpoint's.
        "step_count": engine.step_count, "published_step": engine.published_step,
        "groups": [{k: g[k] for k in ("lr", "initial_lr", "betas") if k in g}
                   for g in engine.optimizer.param_groups],
        "base_lrs": list(engine.scheduler.base_lrs),
    }


def _apply(engine, settings: dict[str, Any]) -> None:
    engine.config, engine.stage = settings["config"], settings["stage"]
    engine.policy_version = settings["policy_version"]
    engine.step_count, engine.published_step = settings["step_count"], settings["published_step"]
    for group, values in zip(engine.optimizer.param_groups, settings["groups"]):
        group.update(values)
    engine.scheduler.base_lrs = list(settings["base_lrs"])


class ReplicatedEngine:
    """Rank 0's engine: each forwarded call is broadcast to the other ranks, then made here.
    Other attributes read and write the engine itself."""

    def __init__(self, engine, heartbeat_s: float = HEARTBEAT_S) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_closed", threading.Event())
        object.__setattr__(self, "_last_sent", time.monotonic())
        beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                                name="trainer-heartbeat")
        beat.start()

    def __getattr__(self, name: str):
        if name in FORWARDED:
            return lambda *args: self._call(name, *args)
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._engine, name, value)

    def named_hf_tensors(self):
        return iter(self._call("gathered_hf_tensors"))

    def _send(self, message: list) -> None:
        dist.broadcast_object_list([message], src=0)
        object.__setattr__(self, "_last_sent", time.monotonic())

    def _call(self, name: str, *args):
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the trainer's ranks have been released")
            try:
                self._send([name, args, _settings(self._engine)])
                return getattr(self._engine, name)(*args)
            except ValueError:
                raise  # refused inputs: every rank refused them alike, before any collective
            except Exception:
                # Anything else (a rank gone, a collective failed) may have left the ranks out
                # of step; only a restart of all of them from the last checkpoint is safe.
                log.exception("%s failed on rank 0; exiting so that every rank restarts", name)
                os._exit(1)

    def _heartbeat(self, every: float) -> None:
        while not self._closed.wait(every / 4):
            if time.monotonic() - self._last_sent < every or not self._lock.acquire(timeout=1):
                continue
            try:
                if not self._closed.is_set():
                    self._send(["ping", (), None])
            except Exception:  # a rank is gone: the world cannot train any more
                log.exception("a trainer rank stopped answering; exiting so that all restart")
                os._exit(1)
            finally:
                self._lock.release()

    def close(self) -> None:
        """Tell the other ranks to exit (after the final checkpoint)."""
        with self._lock:
            if not self._closed.is_set():
                self._closed.set()
                self._send(["exit", (), None])


def follow(engine) -> None:
    """A follower's loop: make each call rank 0 broadcasts until it says exit. A failed
    collective (a rank died) raises: the caller exits and is restarted."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        name, args, settings = box[0]
        if name == "exit":
            return
        if name == "ping":
            continue
        if name not in FORWARDED:
            raise RuntimeError(f"rank 0 sent an unknown call {name!r}")
        _apply(engine, settings)
        try:
            getattr(engine, name)(*args)
        except (ValueError, RuntimeError) as exc:
            # Same inputs, same code: rank 0 met the same error and reports it.
            log.warning("%s failed on this rank as on rank 0: %s", name, exc)
