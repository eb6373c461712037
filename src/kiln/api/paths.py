"""Where a job's relative paths point on this machine (`kiln run`, `kiln validate`).

Two bases, one per kind of path:

- a task file (`spec.tasks[].path`) is read relative to the job file's folder: it is written
  beside the job, as the files a compose file or a kustomization names are;
- a checkpoint directory (`spec.model.path`, `spec.model.tokenizer`, and a teacher, reference,
  swarm subagents or reward model that is not a stage's name) is relative to the working
  directory, where `kiln run` keeps its run directories (`runs/<name>`) and where the pods of
  `kiln dev-cluster` run: a model that `spec.model.init` makes or `spec.model.hub` downloads
  lands beside the runs, and one manifest finds the same model under `kiln run` and on the
  development cluster.

Absolute paths are kept. On a cluster a model path is inside `spec.model.pvc` (or the pod's
run volume), which this module does not cover. Torch-free.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.api.spec import RLJob, RLJobSpec


def checkpoint_refs(spec: RLJobSpec) -> list[tuple[tuple[Any, ...], str]]:
    """(field path as written in the manifest, reference) of every frozen checkpoint the job
    names: each is a stage's name or a checkpoint directory."""
    out: list[tuple[tuple[Any, ...], str]] = []
    for i, stage in enumerate(spec.stages):
        rl = getattr(stage, "rl", None)
        loc = ("spec", "stages", i, "rl")
        if rl is not None:
            out += [(loc + (field,), ref) for field in ("teacher", "reference")
                    if (ref := getattr(rl, field))]
            out += [(loc + ("teachers", j, "teacher"), t.teacher) for j, t in enumerate(rl.teachers)]
        if (swarm := getattr(stage, "swarm", None)) is not None:
            out.append((("spec", "stages", i, "swarm", "subagents"), swarm.subagents))
    for i, ts in enumerate(spec.tasks):
        rules = ts.reward_rules
        for field in ("outcomeModel", "judge"):
            model = getattr(rules, "outcome_model" if field == "outcomeModel" else field, None) \
                if rules else None
            if model is not None:
                out.append((("spec", "tasks", i, "rewardRules", field, "model"), model.model))
    return out


def task_file(path: str, job_file: Path | None) -> Path:
    """Where a task set's `path` is: relative to the job file's folder (the working directory
    when there is no file)."""
    p = Path(path)
    base = job_file.resolve().parent if job_file is not None else Path.cwd()
    return p if p.is_absolute() else (base / p).resolve()


def checkpoint_dir(path: str) -> Path:
    """Where a checkpoint directory is: relative to the working directory."""
    p = Path(path)
    return p if p.is_absolute() else (Path.cwd() / p).resolve()


def resolve(job: RLJob, job_file: Path) -> RLJob:
    """`job` with every relative path made absolute, each against its base (module docstring)."""
    spec = job.spec
    model = spec.model.model_copy(update={
        "path": str(checkpoint_dir(spec.model.path)),
        "tokenizer": str(checkpoint_dir(spec.model.tokenizer)) if spec.model.tokenizer else None})
    tasks = [t.model_copy(update={"path": str(task_file(t.path, job_file))}) if t.path else t
             for t in spec.tasks]

    def checkpoint(ref: str | None) -> str | None:
        return ref if ref is None or spec.is_stage(ref) else str(checkpoint_dir(ref))

    def reward_models(rules):  # type: ignore[no-untyped-def]
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
                "teachers": [t.model_copy(update={"teacher": checkpoint(t.teacher)})
                             for t in rl.teachers]})})
        swarm = getattr(st, "swarm", None)
        if swarm is not None:
            st = st.model_copy(update={"swarm": swarm.model_copy(
                update={"subagents": checkpoint(swarm.subagents)})})
        stages.append(st)
    return job.model_copy(update={"spec": spec.model_copy(
        update={"model": model, "tasks": tasks, "stages": stages})})
