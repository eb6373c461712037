"""Validation of RLJob manifests with errors a user can act on.

`validate_file(path)` parses every YAML document in a file and returns one `Problem` per mistake:
the file, the line, the field path as written in the manifest (`spec.stages[1].rl.groupSize`), and
what was expected and found. User mistakes never raise; `load_job(path)` raises `ManifestError`
(a `ValueError`) carrying the problems, for callers that need a single valid job.

Every job the schema accepts is also checked against the capability table
(`kiln.api.capabilities`): what the runtime would refuse is refused here, naming the field.

The job's name must make valid names for its children (`kiln.api.names`), on every path.

With `local=True` what needs this machine is checked too: the plugins a job names (`env:
{plugin: ...}`, `reward: {plugin: ...}`) are imported, and the checkpoint's model capabilities
are checked when it is here, and a model that is neither here nor made (`spec.model.init`)
nor downloaded (`spec.model.hub`) is refused; so is a task file that is not there, and a
teacher, reference, subagents or reward model that is neither a stage of the job nor a
checkpoint directory (a near miss of a stage's name is named). Relative paths resolve as
`kiln run` resolves them (`kiln.api.paths`: task files against the job file's folder,
checkpoints against the working directory). `kiln validate` and `kiln run` check these; the
operator does not, since user code lives in the job's image and the model on a PVC, not in
the operator.

Keys are the CRD's camelCase only (`groupSize`): a snake_case key (`group_size`) is refused
naming the camelCase one, as the Kubernetes API server would drop it. Python code building the
models by field name (`RLSettings(group_size=8)`) is unaffected.

`overrides` (`--set PATH=VALUE`, `kiln.api.overrides`) edit each parsed document before it is
validated; a problem at a field an override set names the override instead of a line.

Not covered: checks that need a cluster (does the model PVC exist?).
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kiln.api.capabilities import job_model_refusals, spec_refusals
from kiln.api.loss import LOSS_MODES, modes_with
from kiln.api.manifest_keys import REMOVED_STAGE_FIELDS, snake_case_hint
from kiln.api.model import HUB_ID
from kiln.api.names import job_name_problem
from kiln.api.overrides import OverrideError, apply_overrides, format_path
from kiln.api.paths import checkpoint_dir, checkpoint_refs, task_file
from kiln.api.rl import MOVED_TO_LOSS
from kiln.api.spec import API_GROUP, API_VERSION, KIND, RLJob

_STAGE_TAGS = {"sft", "rl"}


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


class ManifestError(ValueError):
    """The manifest is not a valid RLJob; `problems` says where and why. Fix the file and retry."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether `loc[i]` is a discriminator value pydantic inserted: a stage's type after
    `stages[i]`, a loss's mode after `rl.loss`."""
    part = loc[i]
    if i >= 2 and isinstance(loc[i - 1], int) and loc[i - 2] == "stages":
        return part in _STAGE_TAGS
    return i >= 1 and loc[i - 1] == "loss" and part in LOSS_MODES


def _strip_tag(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop the discriminator values pydantic inserts; the user never wrote them."""
    return tuple(part for i, part in enumerate(loc) if not _is_tag(loc, i))


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """An unknown field's message: where it moved (a field `rl` had before `rl.loss`), the loss
    mode it belongs to (a field of the other mode), or a hint at a misspelling. `loc` is
    pydantic's, tags included: a loss's mode is read from it."""
    field, written = loc[-1], _strip_tag(loc)
    if len(written) >= 2 and written[-2] == "rl" and field in MOVED_TO_LOSS:
        new = MOVED_TO_LOSS[field]
        only = modes_with(new)
        return f"rl.{field} moved to rl.loss.{new}" + (
            f" (loss mode {only[0]} only)" if len(only) == 1 else "")
    mode = loc[-2] if len(loc) >= 3 and loc[-3] == "loss" else None
    if mode in LOSS_MODES and modes_with(field):
        other = " or ".join(modes_with(field))
        return f"{field} applies to rl.loss.mode {other} only, not {mode} (set mode: {other})"
    if len(written) >= 3 and written[-3] == "stages" and field in REMOVED_STAGE_FIELDS:
        return REMOVED_STAGE_FIELDS[field]
    if isinstance(field, str) and (hint := snake_case_hint(field)) is not None:
        return hint
    return "unknown field (not part of the RLJob schema; check the spelling)"


def _node_line(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Line (1-based) of the deepest node along `loc` that exists in the YAML tree."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
            if nxt is None:
                break
            # For a mapping entry report the key's line: that is where the user looks.
            key = next(k for k, v in node.value if v is nxt)
            node, line = nxt, key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_field(tuple(err["loc"]))
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"expected one of {expected}, found {_describe(err['input'])}"
    if kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        key = str(ctx.get("discriminator", "'type'")).strip("'")
        return f"expected {key} to be one of {ctx.get('expected_tags', '')}, found {_describe(ctx.get('tag'))}"
    if kind == "union_tag_not_found":
        return "missing the 'type' field that says which kind of stage this is (sft or rl)"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    msg = err["msg"]
    if "input" in err and kind not in ("model_type", "dict_type"):
        return f"{msg[0].lower() + msg[1:]}, found {_describe(err['input'])}"
    return f"{msg[0].lower() + msg[1:]}, found {type(err.get('input')).__name__}"


def validate_document(data: Any, *, file: str, node: yaml.Node | None = None,
                      doc_index: int | None = None) -> tuple[RLJob | None, list[Problem]]:
    """Validate one parsed YAML document; returns the job (if valid) and its problems."""
    prefix = f"{file} (document {doc_index + 1})" if doc_index is not None else file
    if not isinstance(data, dict):
        found = "an empty document" if data is None else type(data).__name__
        return None, [Problem(prefix, _node_line(node, ()), "",
                              f"expected a mapping with apiVersion, kind, metadata and spec; found {found}")]
    api, kind = data.get("apiVersion"), data.get("kind")
    expected_api = f"{API_GROUP}/{API_VERSION}"
    problems: list[Problem] = []
    if api != expected_api:
        problems.append(Problem(prefix, _node_line(node, ("apiVersion",)), "apiVersion",
                                f"expected {expected_api!r}, found {_describe(api)}"))
    if kind != KIND:
        problems.append(Problem(prefix, _node_line(node, ("kind",)), "kind",
                                f"expected {KIND!r}, found {_describe(kind)}"))
    if problems:
        # Without the right kind the rest of the schema does not apply.
        return None, problems
    try:
        # Aliases only: a manifest's keys are the CRD's camelCase (populate_by_name would
        # accept snake_case too, which the API server drops silently).
        job = RLJob.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        # loc -> messages, in order. A field that takes a name or a {plugin: ...} mapping gets
        # one line, not one per alternative pydantic tried.
        found: dict[tuple[Any, ...], list[str]] = {}
        for err in exc.errors():
            loc = tuple(p for p in _strip_tag(tuple(err["loc"])) if not _is_union_branch(p))
            # Errors raised by a model validator point at the model; the message names the field.
            found.setdefault(loc, []).append(_message(err))
        return None, [Problem(prefix, _node_line(node, loc), _format_loc(loc), _join(messages))
                      for loc, messages in found.items()]
    # What the schema allows but the runtime would refuse (the capability table).
    refused = [Problem(prefix, _node_line(node, r.capability.field), r.capability.path, r.message)
               for r in spec_refusals(job.spec)]
    if (bad_name := job_name_problem(job.metadata.name)) is not None:
        refused.insert(0, Problem(prefix, _node_line(node, ("metadata", "name")), "metadata.name",
                                  bad_name))
    return (None, refused) if refused else (job, [])


def model_check_problems(job: RLJob, *, file: str, node: yaml.Node | None = None) -> list[Problem]:
    """The model capabilities `job`'s checkpoint fails, when the checkpoint is on this machine
    (not on a PVC, not yet to be made by spec.model.init or downloaded by spec.model.hub); a
    problem when it is not here and nothing would get it here."""
    model = job.spec.model
    if model.pvc:
        return []
    if not (Path(model.path) / "config.json").exists():
        line = _node_line(node, ("spec", "model", "path"))
        if model.init is not None or model.hub is not None:
            return []  # made or downloaded before the job starts; checked then
        hint = (f" (if {model.path!r} is a Hugging Face Hub id, set spec.model.hub: "
                f"{{id: {model.path}}}; spec.model.path is then where the download is kept)"
                if HUB_ID.match(model.path) and not Path(model.path).exists() else "")
        return [Problem(file, line, "spec.model.path",
                        f"{model.path} holds no config.json, and neither spec.model.init nor "
                        f"spec.model.hub is set to get one there{hint}")]
    try:
        refusals = job_model_refusals(job.spec)
    except ValueError as exc:
        return [Problem(file, _node_line(node, ("spec", "model", "path")), "spec.model.path", str(exc))]
    return [Problem(file, _node_line(node, r.capability.field), r.capability.path,
                    f"{model.path}: {r.message}") for r in refusals]


def plugin_problems(job: RLJob, *, file: str, node: yaml.Node | None = None) -> list[Problem]:
    """One problem per plugin of `job` that cannot be imported or is not what it must be."""
    from kiln.env import PluginError, load_plugin

    problems = []
    for i, ts in enumerate(job.spec.tasks):
        for field, kind in (("env", "environment"), ("reward", "reward")):
            ref = getattr(ts, field)
            if ref is None or isinstance(ref, str):
                continue
            try:
                load_plugin(ref.plugin, kind)
            except PluginError as exc:
                loc = ("spec", "tasks", i, field, "plugin")
                problems.append(Problem(file, _node_line(node, loc), _format_loc(loc),
                                        f"{ref.plugin!r}: {exc}"))
    return problems


def path_problems(job: RLJob, *, file: str, node: yaml.Node | None = None,
                  job_file: Path | None = None) -> list[Problem]:
    """A task file that is not there; a checkpoint reference that is neither a stage of the
    job nor a checkpoint directory here (not looked for when the model is on a PVC)."""
    problems = []
    for i, ts in enumerate(job.spec.tasks):
        if ts.path is not None and not (where := task_file(ts.path, job_file)).is_file():
            loc = ("spec", "tasks", i, "path")
            problems.append(Problem(file, _node_line(node, loc), _format_loc(loc),
                                    f"{ts.path}: no such task file ({where}; a relative path is "
                                    "read from the job file's folder)"))
    stages = [s.name for s in job.spec.stages]
    model = job.spec.model
    # The job's own model, made (init) or downloaded (hub) before anything starts, may serve as
    # a frozen teacher or reference too.
    made = checkpoint_dir(model.path) if model.init is not None or model.hub is not None else None
    for loc, ref in checkpoint_refs(job.spec):
        if job.spec.is_stage(ref) or (made is not None and checkpoint_dir(ref) == made):
            continue
        near = difflib.get_close_matches(ref, stages, n=1, cutoff=0.6)
        if (checkpoint_dir(ref) / "config.json").exists() or (job.spec.model.pvc and not near):
            continue
        hint = f"; did you mean {near[0]!r}?" if near else (
            f" ({checkpoint_dir(ref)}: a relative checkpoint is read from the working directory)")
        problems.append(Problem(file, _node_line(node, loc), _format_loc(loc),
                                f"{ref!r} is neither a stage of this job ({', '.join(stages)}) "
                                f"nor a checkpoint directory holding config.json{hint}"))
    return problems


def _is_union_branch(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith("literal[") or part == "PluginRef")


def _join(messages: list[str]) -> str:
    """One message for a field: as is, or a name-or-plugin union's alternatives in one."""
    literal = next((m for m in messages if m.startswith("expected one of")), None)
    if len(messages) == 1 or literal is None:
        return "; ".join(dict.fromkeys(messages))
    head, sep, found = literal.rpartition(", found ")
    return f"{head.replace(' or ', ', ')} or a {{plugin: \"module:Name\"}} mapping{sep}{found}"


def validate_text(text: str, *, file: str, local: bool = False, job_file: Path | None = None,
                  overrides: Sequence[str] = ()) -> tuple[list[RLJob], list[Problem]]:
    """Validate every document of `text`, each edited by `overrides` (`PATH=VALUE`) first;
    `job_file` is where relative task paths start (with `local`; default the working
    directory)."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        reason = getattr(exc, "problem", None) or str(exc)
        return [], [Problem(file, line, "", f"YAML syntax error: {reason}")]
    if not docs:
        return [], [Problem(file, None, "", "the file holds no YAML document")]
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    multi = len(docs) > 1
    for i, (data, node) in enumerate(zip(docs, nodes)):
        set_paths: list[tuple[str, str]] = []
        if overrides:
            try:
                set_paths = [(format_path(p), s) for p, s in
                             zip(apply_overrides(data, overrides), overrides)]
            except OverrideError as exc:
                where = f"{file} (document {i + 1})" if multi else file
                problems.append(Problem(where, None, "", str(exc)))
                continue
        job, probs = validate_document(data, file=file, node=node, doc_index=i if multi else None)
        if job is not None and local:
            probs = (plugin_problems(job, file=file, node=node)
                     + model_check_problems(job, file=file, node=node)
                     + path_problems(job, file=file, node=node, job_file=job_file))
        if job is not None and not probs:
            jobs.append(job)
        problems.extend(_name_overrides(probs, set_paths))
    return jobs, problems


def _name_overrides(problems: list[Problem], set_paths: list[tuple[str, str]]) -> list[Problem]:
    """Point a problem at the `--set` that wrote its field (the file's line would mislead)."""
    out = []
    for problem in problems:
        setting = next((s for path, s in reversed(set_paths)
                        if problem.path == path or problem.path.startswith((path + ".", path + "["))),
                       None)
        out.append(problem if setting is None else dataclasses.replace(
            problem, line=None, message=f"{problem.message} (set by --set {setting})"))
    return out


def validate_file(path: str | Path, *, local: bool = False,
                  overrides: Sequence[str] = ()) -> tuple[list[RLJob], list[Problem]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        return [], [Problem(str(path), None, "", f"cannot read file: {exc.strerror}")]
    except UnicodeDecodeError:
        return [], [Problem(str(path), None, "", "not a UTF-8 text file")]
    return validate_text(text, file=str(path), local=local, job_file=path, overrides=overrides)


def load_job(path: str | Path, *, local: bool = False, overrides: Sequence[str] = ()) -> RLJob:
    """The single valid RLJob in `path` (edited by `overrides`, `PATH=VALUE`), or ManifestError
    naming every problem."""
    jobs, problems = validate_file(path, local=local, overrides=overrides)
    if problems:
        raise ManifestError(problems)
    if len(jobs) != 1:
        raise ManifestError([Problem(str(path), None, "", f"expected one RLJob, found {len(jobs)}")])
    return jobs[0]
