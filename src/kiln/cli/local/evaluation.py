"""`kiln eval JOB MODEL_DIR --task-set NAME --samples N --out DIR`: one checkpoint's
held-out numbers, without a training run.

The job gives the task sets, the sandbox and the rollout settings (engine, format, sampling);
the checkpoint replaces its model. The services a rollout needs are started as `kiln run` starts
them (`processes.py`, loopback, mutual TLS), with no trainer: sandbox, rollout, and the buffer
and weight-sync services that rollout connects to at start (idle here, nothing is trained or
published). Rollout's own `Evaluate` then plays each task N times at the job's sampling
temperature and once greedily, and `DIR/eval.json` gets the per-task counts and the pass@k
derived from them (`kiln.evaluation`). Service state and logs stay in `DIR/services/`.

Not covered: jobs whose episodes need a frozen deployment (teachers, swarm subagents, reward
models): those are refused, naming the fields.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TextIO

import yaml

from kiln.api.distillation import teacher_refs
from kiln.api.paths import resolve
from kiln.api.spec import RLJob
from kiln.api.validate import ManifestError, load_job
from kiln.cli.exits import Exit

#: Started in this order (each after those it talks to), stopped in the reverse one.
SERVICES = ("buffer", "sandbox", "weight_sync", "rollout")


def eval_job(job: RLJob, model_dir: Path) -> RLJob:
    """`job` with `model_dir` as its model (its own tokenizer when it has one) and nothing a
    lone evaluation must not do (serve the OpenAI endpoint, create or download a model)."""
    own_tokenizer = (model_dir / "tokenizer_config.json").exists()
    model = job.spec.model.model_copy(update={
        "path": str(model_dir.resolve()), "init": None, "hub": None,
        "tokenizer": None if own_tokenizer else job.spec.model.tokenizer})
    rollout = job.spec.rollout.model_copy(update={"openai_port": None})
    spec = job.spec.model_copy(update={"model": model, "rollout": rollout})
    tree = job.model_copy(update={"spec": spec}).model_dump(mode="json", by_alias=True,
                                                           exclude_none=True)
    return RLJob.model_validate(tree)  # re-checked as a whole: the services load it so


def refusals(job: RLJob, model_dir: Path, task_set: str, samples: int) -> list[str]:
    """Why this evaluation cannot run, each naming the argument or field."""
    out = []
    if not (model_dir / "config.json").is_file():
        out.append(f"MODEL_DIR: {model_dir} holds no config.json (a Hugging Face checkpoint "
                   "directory is expected)")
    names = [t.name for t in job.spec.tasks]
    if task_set not in names:
        out.append(f"--task-set: {task_set!r} is not a task set of the job (spec.tasks: {names})")
    if samples < 1:
        out.append(f"--samples: {samples} must be 1 or more")
    if teacher_refs(job.spec):
        out.append(f"JOB: the job needs frozen deployments ({teacher_refs(job.spec)}: teachers, "
                   "swarm subagents or reward models), which kiln eval does not start")
    return out


def load(job_file: Path, err: TextIO) -> RLJob | None:
    try:
        return resolve(load_job(job_file, local=True), job_file)
    except ManifestError as exc:
        print(f"kiln eval: {job_file}: invalid job:\n{exc}", file=err)
        return None


def main(model_dir: Path, job_file: Path, task_set: str, samples: int, out_dir: Path, *,
         max_tasks: int = 0, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    from kiln.evaluation import eval_report

    job = load(job_file, err)
    if job is None:
        return Exit.REFUSED
    if problems := refusals(job, model_dir, task_set, samples):
        print("kiln eval: " + "\n".join(problems), file=err)
        return Exit.REFUSED
    job = eval_job(job, model_dir)
    run_dir = (out_dir / "services").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def _interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt  # the services run in sessions of their own: stop them first

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ev = _evaluate(job, run_dir, task_set, samples, max_tasks, out)
    except KeyboardInterrupt:
        out.write("\ninterrupted: services stopped\n")
        return Exit.INTERRUPTED
    except RuntimeError as exc:  # ServiceFailed, an Evaluate that failed: the logs say more
        print(f"kiln eval: {exc}\nlogs: {run_dir / 'logs'}", file=err)
        return Exit.FAILED
    report = eval_report(
        ev.task_counts, model=str(model_dir.resolve()), job=str(job_file.resolve()),
        task_set=task_set, samples=samples, temperature=job.spec.rollout.sampling.temperature,
        policy_version=ev.policy_version, seconds=round(time.time() - started, 1))
    path = out_dir / "eval.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    figures = [f"pass@{k} {v:.3f}" for k, v in report["pass_at_k"].items()]
    if report["greedy"] is not None:
        figures.append(f"greedy {report['greedy']:.3f}")
    out.write(f"{task_set}: {len(ev.task_counts)} tasks x {samples} samples: "
              f"{', '.join(figures)}\nwrote {path}\n")
    return Exit.OK


def _evaluate(job: RLJob, run_dir: Path, task_set: str, samples: int, max_tasks: int,
              out: TextIO):
    """Start the services, run rollout's Evaluate once, stop them all (whatever happens)."""
    import grpc

    from kiln.cli.local import processes
    from kiln.control.clients import RolloutControlClient
    from kiln.control.progress import evaluate_reporting
    from kiln.control.retry import ServiceUnavailable

    job_file = run_dir / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True),
                                       sort_keys=False))
    processes.issue_certificates(run_dir, job.metadata.name)
    services: dict[str, processes.ServiceProcess] = {}
    client = None
    try:
        for name in SERVICES:
            args = ("--owner", processes.sandbox_owner(run_dir)) if name == "sandbox" else ()
            services[name] = processes.start(name, job_file, run_dir,
                                             {n: s.address for n, s in services.items()}, args=args)
            processes.wait_ready(services[name])
        client = RolloutControlClient(services["rollout"].address)
        # Rollout's Evaluate, with its tasks-done figures every few seconds while it runs.
        limited = SimpleNamespace(status=client.status, evaluate=lambda task_set, *, samples, greedy:
                                  client.evaluate(task_set, samples=samples, greedy=greedy,
                                                  max_tasks=max_tasks))

        def say(text: str) -> None:
            out.write(text + "\n")
            out.flush()
        say("services ready")
        try:
            return evaluate_reporting(
                limited, task_set, samples=samples, say=say,
                label=f"evaluating {task_set} ({samples} samples per task and one greedy)",
                transient=(ServiceUnavailable,))
        except grpc.RpcError as exc:
            raise RuntimeError(f"rollout's Evaluate failed: {exc.code().name}: {exc.details()}") from exc
    finally:
        if client is not None:
            client.close()
        for name in reversed(list(services)):
            processes.stop(services[name])
