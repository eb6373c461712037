"""`kiln run JOB.yaml`: the whole job on one machine, every service its own process.

    validate -> run directory -> model (created if `spec.model.init`) -> start services ->
    wait for health -> drive the stages -> summary.json + report

The services are the same entry points the operator runs in pods, on loopback ports. The run
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
import yaml

from kiln.api.spec import RLJob
from kiln.api.validate import ManifestError, load_job


def _resolve(job: RLJob, job_file: Path) -> RLJob:
    """Relative paths in the job are relative to the job file; make them absolute."""
    base = job_file.resolve().parent
    spec = job.spec
    model_path = Path(spec.model.path)
    if not model_path.is_absolute():
        # The quickstart's model lives under the working directory's runs/, beside the run.
        model_path = (Path.cwd() / model_path).resolve()
    model = spec.model.model_copy(update={"path": str(model_path)})
    tasks = [t.model_copy(update={"path": str((base / t.path).resolve())})
             if t.path and not Path(t.path).is_absolute() else t for t in spec.tasks]

    def checkpoint(ref: str | None) -> str | None:
        # A teacher checkpoint, like the model, lives under the working directory.
        if ref is None or spec.is_stage(ref) or Path(ref).is_absolute():
            return ref
        return str((Path.cwd() / ref).resolve())

    def reward_models(rules):
        if rules is None:
            return None
        return rules.model_copy(update={
            key: m.model_copy(update={"model": checkpoint(m.model)})
            for key in ("outcome_model", "judge") if (m := getattr(rules, key)) is not None})
    tasks = [t.model_copy(update={"reward_rules": reward_models(t.reward_rules)}) for t in tasks]

    stages = []
    for st in spec.stages:
        rl = getattr(st, "rl", None)
        if rl is not None:
            st = st.model_copy(update={"rl": rl.model_copy(update={
                "teacher": checkpoint(rl.teacher), "reference": checkpoint(rl.reference),
                "teachers": [t.model_copy(update={"teacher": checkpoint(t.teacher)}) for t in rl.teachers]})})
        swarm = getattr(st, "swarm", None)
        if swarm is not None:
            st = st.model_copy(update={"swarm": swarm.model_copy(
                update={"subagents": checkpoint(swarm.subagents)})})
        stages.append(st)
    return job.model_copy(update={"spec": spec.model_copy(
        update={"model": model, "tasks": tasks, "stages": stages})})


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


def _dump(job: RLJob) -> str:
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False)


def main(args: argparse.Namespace) -> int:
    from kiln.cli.local import processes
    from kiln.cli.local.fleet import RolloutFleet
    from kiln.cli.local.progress import LocalProgress
    from kiln.control.driver import ControlPlane, Driver, DriverHooks, DriverOptions, FileStore, RunState
    from kiln.cli.local.report import write_report, write_summary
    from kiln.control.clients import BufferStatusClient, RolloutControlClient, TrainerControlClient
    from kiln.control.retry import ServiceUnavailable
    from kiln.services.common.tracking import Tracker

    out = sys.stdout
    started = time.time()
    if args.resume:
        run_dir = args.resume.resolve()
        job_file = run_dir / "job.yaml"
        if not job_file.exists():
            print(f"kiln run: --resume {args.resume}: no job.yaml there; not a run directory", file=sys.stderr)
            return 2
    elif args.job is None:
        print("kiln run: give a job file, or --resume RUN_DIR", file=sys.stderr)
        return 2
    try:
        job = load_job(job_file if args.resume else args.job, local=True)
    except ManifestError as exc:
        print(f"kiln run: invalid job:\n{exc}", file=sys.stderr)
        return 2
    if not args.resume:
        job = _resolve(job, args.job)
        run_dir = (args.run_dir or Path("runs") / job.metadata.name).resolve()
        # A run stopped during its first stage has no state.json yet, but its job.yaml (and
        # maybe checkpoints) would be mixed into this one's.
        if (run_dir / "state.json").exists() or (run_dir / "job.yaml").exists():
            print(f"kiln run: {run_dir} holds a previous run; use --resume {run_dir} or another "
                  "--run-dir", file=sys.stderr)
            return 2
        run_dir.mkdir(parents=True, exist_ok=True)
        job_file = run_dir / "job.yaml"
        job_file.write_text(_dump(job))
    model = job.spec.model
    if model.init is None and model.hub is None and not (Path(model.path) / "config.json").exists():
        print(f"kiln run: spec.model.path: {model.path} holds no config.json, and neither "
              "spec.model.init nor spec.model.hub is set to get one there", file=sys.stderr)
        return 2
    from kiln.api.capabilities import job_model_refusals
    from kiln.cli.local.hub import HubError
    from kiln.cli.local.model import prepare_model

    try:
        prepare_model(job, out)
    except HubError as exc:
        again = f"; continue with kiln run --resume {run_dir}" if exc.retry else ""
        print(f"kiln run: {exc}{again}", file=sys.stderr)
        return 1 if exc.retry else 2
    teachers = teachers_of(job, run_dir)
    for _, teacher, teacher_stage in teachers:
        if teacher_stage is None and not (Path(teacher) / "config.json").exists():
            print(f"kiln run: teacher {teacher} holds no config.json (a Hugging Face checkpoint "
                  "directory, e.g. an earlier run's `kiln export`)", file=sys.stderr)
            return 2
    # The model capabilities once more: spec.model.init may just have made the checkpoint.
    try:
        problems = [r.message for r in job_model_refusals(job.spec)]
    except ValueError as exc:
        problems = [str(exc)]
    if problems:
        print(f"kiln run: spec.model.path: {job.spec.model.path}: {problems[0]}", file=sys.stderr)
        return 2

    try:
        tracker = Tracker(run_dir / "tensorboard", run_name="driver", group=job.metadata.name,
                          spec=job.spec.tracking)
    except ValueError as exc:
        print(f"kiln run: {exc}", file=sys.stderr)
        return 2
    services: dict[str, processes.ServiceProcess] = {}
    fleet = None
    interrupted = failed = False

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
            return dead

        shown = LocalProgress(run_dir, out)
        fleet = RolloutFleet(services, start_worker, lambda svc: RolloutControlClient(svc.address),
                             drain_seconds=job.spec.rollout.episode_timeout_seconds, say=shown.say)
        fleet.scale(max(1, job.spec.rollout.replicas))  # the others join once healthy
        driver = Driver(job, ControlPlane(trainer, fleet, buffer, scaler=fleet),
                        RunState.load(FileStore(run_dir / "state.json")),
                        DriverHooks(say=shown.say, on_progress=shown.progress, on_event=shown.event,
                                    supervise=supervise, tracker=tracker),
                        DriverOptions(transient=(ServiceUnavailable,)))
        state = driver.run()
    except KeyboardInterrupt:
        interrupted = True
        out.write(f"\ninterrupted: stopping services (the trainer checkpoints); continue with\n"
                  f"  kiln run --resume {run_dir}\n")
    except (processes.ServiceFailed, RuntimeError, grpc.RpcError) as exc:
        # The services' logs hold the details; the run directory keeps everything done so far.
        out.write(f"\nkiln run: {exc}\nlogs: {run_dir / 'logs'}; continue with kiln run --resume {run_dir}\n")
        failed = True
    finally:
        if fleet is not None:
            fleet.close()  # workers already retired by autoscaling, still on their way out
        _stop_all(services)
        tracker.close()
    if failed:
        return 1
    if interrupted:
        return 130
    from kiln.cli.export import final_hf

    final = final_hf(run_dir, job)
    if final is not None:
        out.write(f"final weights (Hugging Face checkpoint): {final}\n")
    summary = write_summary(job, run_dir, state, wall_seconds=time.time() - started)
    write_report(run_dir, rl_stages={s.name for s in job.spec.stages if s.type != "sft"},
                 evaluations=summary["evaluations"])
    out.write(json.dumps(summary, indent=2) + "\n")
    return 0


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
