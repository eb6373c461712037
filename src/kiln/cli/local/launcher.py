"""`kiln run JOB.yaml`: the whole job on one machine, every service its own process.

    validate -> run directory -> model (created if `spec.model.init`) -> start services ->
    wait for health -> drive the stages -> summary.json + report

What is checked before anything is written, and which job a resumed run runs, is
`kiln.cli.local.preflight`. The services are the same entry points the operator runs in pods,
on loopback ports. The run
directory holds the resolved job (`job.yaml`), `metrics.jsonl`, `state.json` (finished stages
and evaluations), each service's state (`trainer/checkpoints`, `buffer/` segments, ...), logs,
`report/*.png` and `summary.json`. Ctrl-C stops the services in order, the trainer writing a
checkpoint on its way out; `kiln run --resume RUN_DIR` starts them again on the same directory:
the trainer resumes from its latest checkpoint, the buffer from its log, and finished stages
are skipped.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import grpc

from kiln.api.spec import RLJob
from kiln.cli.exits import Exit
from kiln.cli.local.deadline import DEADLINE_EXCEEDED, Deadline, mark_failed, ttl_note
from kiln.cli.local.preflight import prepare


def teachers_of(job: RLJob, run_dir: Path) -> list[tuple[str, str, str | None]]:
    """(process name, checkpoint directory, stage that makes it or None) of every teacher the
    job's on-policy distillation stages learn from, in `teacher_refs` order. A stage's final
    weights are where the trainer exports them (`trainer/stages/<name>`), there once that stage
    is done."""
    from kiln.api.distillation import teacher_process, teacher_refs
    from kiln.services.trainer.stages import stage_export_dir

    out = []
    for i, ref in enumerate(teacher_refs(job.spec)):
        stage = ref if job.spec.is_stage(ref) else None
        path = stage_export_dir(run_dir / "trainer", stage) if stage else Path(ref)
        out.append((teacher_process(i), str(path), stage))
    return out


def main(args: argparse.Namespace) -> int:
    from kiln.cli.local import openai_access, processes
    from kiln.cli.local.fleet import RolloutFleet
    from kiln.cli.local.progress import LocalProgress
    from kiln.control.driver import (ControlPlane, Driver, DriverHooks, DriverOptions, FileStore,
                                     RunState, Stopped)
    from kiln.cli.local.report import write_report, write_summary
    from kiln.control.clients import BufferStatusClient, RolloutControlClient, TrainerControlClient
    from kiln.control.retry import ServiceUnavailable
    from kiln.tracking import Tracker

    out = sys.stdout
    started = time.time()
    prepared = prepare(args, out)
    if isinstance(prepared, int):
        return prepared
    job, run_dir = prepared
    job_file = run_dir / "job.yaml"
    deadline = Deadline(job.spec, time.monotonic())  # spec.activeDeadlineSeconds, from now
    if note := ttl_note(job.spec):
        out.write(note + "\n")
    teachers = teachers_of(job, run_dir)
    try:
        tracker = Tracker(run_dir / "tensorboard", run_name="driver", group=job.metadata.name,
                          spec=job.spec.tracking)
    except ValueError as exc:
        print(f"kiln run: {exc}", file=sys.stderr)
        return Exit.REFUSED
    services: dict[str, processes.ServiceProcess] = {}
    fleet = router = None
    interrupted = failed = expired = False

    def _interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        order = list(processes.ORDER)
        order[order.index("rollout"):order.index("rollout")] = [name for name, _, _ in teachers]
        teacher_args = {name: ("--teacher", path) + (("--teacher-wait",) if stage else ())
                        for name, path, stage in teachers}
        service_args = {**teacher_args, "sandbox": ("--owner", processes.sandbox_owner(run_dir))}
        out.write(f"run directory: {run_dir}\nstarting services: {', '.join(order)}\n")
        processes.issue_certificates(run_dir, job.metadata.name)
        if job.spec.rollout.openai_port:
            out.write(openai_access.grant(run_dir, job.spec.rollout.openai_port))
            router = openai_access.LocalRouter(run_dir, job.spec.rollout.openai_port)
            router.start()
        group = processes.trainer_group(job.spec.trainer.data_parallel)
        for name in order:
            addrs = {n: s.address for n, s in services.items()}
            args = service_args.get(name, ())
            for member, env in (group.items() if name == "trainer" else [(name, {})]):
                services[member] = processes.start(member, job_file, run_dir, addrs, env, args=args)
            # A teacher made by an earlier stage only loads once that stage is done: rollout
            # waits for it when it first needs a score.
            ready_now = ("buffer", "sandbox", "weight_sync",
                         *(name for name, _, stage in teachers if stage is None))
            if name in ready_now:
                processes.wait_ready(services[name])
            elif name in teacher_args:
                processes.wait_port(services[name])  # rollout needs its address
        for name in (*group, "rollout"):
            processes.wait_ready(services[name])
        out.write(f"all services healthy after {time.time() - started:.1f} s\n")
        trainer = TrainerControlClient(services["trainer"].address)
        buffer = BufferStatusClient(services["buffer"].address)

        def start_worker(name: str) -> processes.ServiceProcess:
            return processes.start(name, job_file, run_dir, {n: s.address for n, s in services.items()})

        def supervise() -> list[str]:
            """Restart any service that died, on its old port; it resumes from its state."""
            dead = [n for n, s in services.items() if s.proc.poll() is not None]
            addrs = {n: s.address for n, s in services.items()}
            for name in dead:
                out.write(f"\n{name} exited with code {services[name].proc.returncode}; restarting\n")
            if len(group) > 1 and any(n in group for n in dead):
                processes.restart_group(group, services, job_file, run_dir)
            for name in dead:
                if name not in group or len(group) == 1:
                    services[name] = processes.restart(services[name], job_file, run_dir, addrs)
            if router is not None and router.supervise():
                out.write("\nthe OpenAI endpoint's router exited; restarted\n")
            return dead

        shown = LocalProgress(run_dir, out, job)
        fleet = RolloutFleet(services, start_worker, lambda svc: RolloutControlClient(svc.address),
                             drain_seconds=job.spec.rollout.episode_timeout_seconds, say=shown.say)
        fleet.scale(max(1, job.spec.rollout.replicas))  # the others join once healthy
        driver = Driver(job, ControlPlane(trainer, fleet, buffer, scaler=fleet),
                        RunState.load(FileStore(run_dir / "state.json")),
                        DriverHooks(say=shown.say, on_progress=shown.progress, on_event=shown.event,
                                    supervise=supervise, tracker=tracker,
                                    should_stop=deadline.passed),
                        DriverOptions(transient=(ServiceUnavailable,)))
        state = driver.run()
    except Stopped:  # only the deadline stops the driver here
        expired = True
        out.write(f"\nkiln run: {deadline.message()}\n")
    except KeyboardInterrupt:
        interrupted = True
        out.write(f"\ninterrupted: stopping services (the trainer checkpoints); continue with\n"
                  f"  kiln run --resume {run_dir}\n")
    except (processes.ServiceFailed, RuntimeError, grpc.RpcError) as exc:
        # The services' logs hold the details; the run directory keeps everything done so far.
        out.write(f"\nkiln run: {exc}\nlogs: {run_dir / 'logs'}; continue with kiln run --resume {run_dir}\n")
        failed = True
    finally:
        if router is not None:
            router.stop()
        if fleet is not None:
            fleet.close()  # workers already retired by autoscaling, still on their way out
        _stop_all(services)
        tracker.close()
    from kiln.cli.local.progress import run_table

    if failed or interrupted or expired:
        out.write("\n" + run_table(job, run_dir) + "\n")
        _report_so_far(run_dir, out)
    if expired:
        # What was done, from the recorded state; then the reason it ended.
        write_summary(job, run_dir, RunState.load(FileStore(run_dir / "state.json")),
                      wall_seconds=time.time() - started)
        mark_failed(run_dir, DEADLINE_EXCEEDED, deadline.message())
        return Exit.FAILED
    if failed:
        return Exit.FAILED
    if interrupted:
        return Exit.INTERRUPTED
    from kiln.cli.export import final_hf

    final = final_hf(run_dir, job)
    if final is not None:
        out.write(f"final weights (Hugging Face checkpoint): {final}\n")
    summary = write_summary(job, run_dir, state, wall_seconds=time.time() - started)
    write_report(run_dir, rl_stages={s.name for s in job.spec.stages if s.type != "sft"},
                 evaluations=summary["evaluations"])
    out.write(json.dumps(summary, indent=2) + "\n\n" + run_table(job, run_dir) + "\n")
    return Exit.OK


def _report_so_far(run_dir: Path, out) -> None:
    """report/*.png of a run that failed or was interrupted, from the steps it recorded (a
    second Ctrl-C while it draws skips it; `kiln report RUN_DIR` draws it again)."""
    from kiln.cli.local.report import remake

    try:
        written = remake(run_dir)
    except ValueError as exc:  # stopped before the first progress record
        out.write(f"no report: {exc}\n")
        return
    except KeyboardInterrupt:
        out.write(f"report skipped; draw it with kiln report {run_dir}\n")
        return
    out.write(f"report of the steps so far: {written[0].parent}\n")


def _stop_all(services) -> None:
    """Stop every service: rollout first, then the trainer (its checkpoint is written while the
    rest still runs), then the others. A second Ctrl-C kills whatever is left, never orphans it."""
    from kiln.cli.local import processes

    # The trainer's replicas after replica 0, which releases them after its final checkpoint.
    replicas = sorted(n for n in services if n.startswith(processes.REPLICA_PREFIX))
    teachers = sorted(n for n in services if processes.is_teacher(n))
    workers = sorted(n for n in services if n.startswith(processes.ROLLOUT_WORKER_PREFIX))
    order = [n for n in ("rollout", *workers, *teachers, "trainer", *replicas, "weight_sync",
                         "sandbox", "buffer") if n in services]
    try:
        for name in order:
            processes.stop(services[name])
    except KeyboardInterrupt:
        for name in order:
            if services[name].proc.poll() is None:
                services[name].proc.kill()
        raise
