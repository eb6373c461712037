"""`kiln validate`: every kind of mistake gets the file, line, field path and what was expected."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kiln.api.validate import ManifestError, load_job, validate_file, validate_text

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))

GOOD = textwrap.dedent("""\
    apiVersion: kiln.dev/v1alpha1
    kind: RLJob
    metadata:
      name: demo
    spec:
      model:
        path: /models/tiny
        pvc: models
      tasks:
        - name: train
          env: chain
          generate: {count: 10}
      stages:
        - name: rl
          type: rl
          tasks: [train]
          batchSize: 16
          microBatchSize: 8
          rl:
            groupSize: 8
    """)


def _mutate(fn) -> str:
    doc = yaml.safe_load(GOOD)
    fn(doc)
    return yaml.safe_dump(doc, sort_keys=False)


def _problems(text: str):
    jobs, problems = validate_text(text, file="job.yaml")
    assert not jobs
    assert problems
    return problems


def test_good_manifest_is_valid_and_defaults_filled():
    jobs, problems = validate_text(GOOD, file="job.yaml")
    assert problems == []
    (job,) = jobs
    stage = job.spec.stages[0]
    assert stage.rl.loss.mode == "masked" and stage.rl.loss.eps_low == 0.2 and stage.rl.loss.eps_high == 0.28
    assert stage.rl.loss.aggregation == "token-mean"
    assert job.spec.rollout.thinking == "interleaved"
    assert job.spec.sandbox.backend == "bubblewrap"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate(path):
    jobs, problems = validate_file(path)
    assert problems == [], "\n".join(map(str, problems))
    assert jobs


def test_forgetting_example_has_the_stages_and_evaluations_it_reports():
    """The OPD forgetting example's names are what its summary is read by: stages skill-a,
    skill-b and opd, both held-out sets evaluated after each, each skill taught by the stage
    that learned it."""
    (job,), problems = validate_file(REPO / "deploy" / "examples" / "opd-forgetting.yaml")
    assert problems == []
    stages = job.spec.stages
    assert [s.name for s in stages] == ["skill-a", "skill-b", "opd"]
    for s in stages:
        assert s.eval.tasks == ["skill-a-heldout", "skill-b-heldout"] and not s.eval.before
    assert stages[2].type == "opd" and stages[2].rl.advantage == "opd"  # implied by the type
    taught = {t.teacher: t.tasks for t in stages[2].rl.teachers}
    assert taught == {"skill-a": stages[0].tasks, "skill-b": stages[1].tasks}


def test_swarm_example_pins_its_subagents_to_an_earlier_stage():
    """The swarm example: one SFT stage on both roles (single chains for the subagents, serial
    demonstrations in the environment with the swarm tools for the orchestrator), and an RL
    stage with PARL whose subagents are that stage's weights, evaluated before and after on
    held-out tasks (what summary.json's before/after figures come from)."""
    (job,), problems = validate_file(REPO / "deploy" / "examples" / "swarm.yaml")
    assert problems == []
    sft, rl = job.spec.stages
    assert [s.type for s in job.spec.stages] == ["sft", "rl"]
    assert rl.swarm is not None and rl.swarm.subagents == sft.name
    assert rl.swarm.lambda_parallel > 0 and rl.swarm.anneal_start < rl.max_steps
    assert rl.eval.tasks == ["wide-heldout"] and rl.eval.before
    envs = {t.name: t.env for t in job.spec.tasks}
    assert sorted(envs[t] for t in sft.tasks) == ["wide", "wide-lookup"]
    assert [envs[t] for t in rl.tasks] == ["wide"]


CASES = {
    # name: (manifest text, expected field path, substring of the message)
    "yaml-syntax": (GOOD.replace("  name: demo", "  name: [demo"), "", "YAML syntax error"),
    "wrong-api-version": (GOOD.replace("kiln.dev/v1alpha1", "kiln.dev/v1"), "apiVersion",
                          "expected 'kiln.dev/v1alpha1'"),
    "wrong-kind": (GOOD.replace("kind: RLJob", "kind: Job"), "kind", "expected 'RLJob'"),
    "unknown-field": (GOOD.replace("groupSize: 8", "groupSize: 8\n        gropuSize: 4"),
                      "spec.stages[0].rl.gropuSize", "unknown field"),
    "wrong-type": (GOOD.replace("groupSize: 8", "groupSize: eight"),
                   "spec.stages[0].rl.groupSize", "valid integer"),
    "out-of-range": (GOOD.replace("groupSize: 8", "groupSize: 1"),
                     "spec.stages[0].rl.groupSize", "greater than or equal to 2"),
    "missing-required": (_mutate(lambda d: d["spec"]["model"].pop("path")),
                         "spec.model.path", "required"),
    "bad-enum": (_mutate(lambda d: d["spec"].setdefault("sandbox", {}).update(backend="gvisor")),
                 "spec.sandbox.backend", "'bubblewrap' or 'docker'"),
    "bad-stage-type": (GOOD.replace("type: rl", "type: dpo"), "spec.stages[0]", "one of"),
    "eps-bounds": (GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {epsLow: 1.5}"),
                   "spec.stages[0].rl.loss.epsLow", "less than 1"),
    "icepop-beta": (GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {mode: ppo, icepopBeta: 0.5}"),
                    "spec.stages[0].rl.loss.icepopBeta", "greater than 1"),
    "bad-loss-mode": (GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {mode: grpo}"),
                      "spec.stages[0].rl.loss", "expected mode to be one of 'masked', 'ppo', found 'grpo'"),
    "teacher-not-earlier": (_mutate(lambda d: d["spec"]["stages"][0]["rl"].update(
        advantage="opd", teacher=d["spec"]["stages"][0]["name"])),
                            "spec", "does not come before this one"),
    "opd-stage-with-group-advantage": (_mutate(lambda d: d["spec"]["stages"][0].update(
        type="opd", rl={"advantage": "group", "teacher": "/models/t"})),
                                       "spec.stages[0].opd", "an opd stage distils"),
    "opd-stage-without-teacher": (_mutate(lambda d: d["spec"]["stages"][0].update(type="opd", rl={})),
                                  "spec.stages[0].opd.rl", "needs a teacher"),
    "dual-clip-in-masked-mode": (GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {mode: masked, dualClip: 3}"),
                                 "spec.stages[0].rl.loss.dualClip",
                                 "dualClip applies to rl.loss.mode ppo only, not masked"),
    "icepop-beta-without-mode": (GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {icepopBeta: 2}"),
                                 "spec.stages[0].rl.loss.icepopBeta",
                                 "icepopBeta applies to rl.loss.mode ppo only, not masked"),
    "tau-negative": (GOOD.replace("groupSize: 8", "groupSize: 8\n        tau: -1"),
                     "spec.stages[0].rl.tau", "greater than or equal to 0"),
    "micro-batch-divides": (GOOD.replace("microBatchSize: 8", "microBatchSize: 5"),
                            "spec.stages[0]", "microBatchSize (5) must divide batchSize (16)"),
    "unknown-task-ref": (GOOD.replace("tasks: [train]", "tasks: [trian]"),
                         "spec", "refers to task set 'trian'"),
    "bad-name": (GOOD.replace("name: demo", "name: Demo_Job"), "metadata.name", "pattern"),
    "bad-quantity": (_mutate(lambda d: d["spec"].setdefault("sandbox", {}).update(memory="lots")),
                     "spec.sandbox.memory", "pattern"),
    "source-both": (_mutate(lambda d: d["spec"]["tasks"][0].update(path="x.jsonl")),
                    "spec.tasks[0]", "exactly one of path, source or generate"),
    "not-a-mapping": ("- just\n- a list\n", "", "expected a mapping"),
    "temperature-above-vllms-bound": (_mutate(lambda d: d["spec"].setdefault("rollout", {}).update(
        sampling={"temperature": 3.0})), "spec.rollout", "vLLM samples at most at 2"),
    "top-p-at-a-temperature": (_mutate(lambda d: d["spec"].setdefault("rollout", {}).update(
        sampling={"temperature": 0.7, "topP": 0.9})), "spec.rollout.sampling", "topP must be 1"),
    "turn-level-with-tags": (_mutate(lambda d: d["spec"].setdefault("rollout", {}).update(
        thinking="turn-level", toolCallFormat="tags")), "spec.rollout", "'turn-level' needs a chat-template"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mistake_is_named(name):
    text, path, needle = CASES[name]
    problems = _problems(text)
    assert any(p.path == path and needle in p.message for p in problems), (
        f"no problem at {path!r} mentioning {needle!r}; got:\n" + "\n".join(map(str, problems)))


@pytest.mark.parametrize("old, value, new", [
    ("lossMode", "ppo", "rl.loss.mode"), ("epsLow", "0.1", "rl.loss.epsLow"),
    ("epsHigh", "0.3", "rl.loss.epsHigh"), ("dualClip", "3", "rl.loss.dualClip"),
    ("icepopBeta", "2", "rl.loss.icepopBeta"), ("lossAggregation", "sequence-sum", "rl.loss.aggregation"),
])
def test_a_field_rl_had_before_rl_loss_names_its_new_place(old, value, new):
    text = GOOD.replace("groupSize: 8", f"groupSize: 8\n        {old}: {value}")
    (problem,) = _problems(text)
    assert problem.path == f"spec.stages[0].rl.{old}"
    assert f"rl.{old} moved to {new}" in problem.message
    assert old in text.splitlines()[problem.line - 1]


def test_both_loss_variants_parse_with_their_own_fields():
    ppo = GOOD.replace("groupSize: 8", "groupSize: 8\n        minibatches: 2\n        loss:\n"
                       "          mode: ppo\n          epsLow: 0.1\n          dualClip: 3\n"
                       "          icepopBeta: null\n          aggregation: sequence-sum")
    (job,), problems = validate_text(ppo, file="job.yaml")
    assert problems == []
    loss = job.spec.stages[0].rl.loss
    assert (loss.mode, loss.eps_low, loss.eps_high, loss.dual_clip, loss.icepop_beta, loss.aggregation) == (
        "ppo", 0.1, 0.28, 3.0, None, "sequence-sum")
    assert job.spec.stages[0].rl.minibatches == 2
    (job,), problems = validate_text(GOOD.replace("groupSize: 8", "groupSize: 8\n        loss: {mode: masked, "
                                                  "epsHigh: 0.5, aggregation: sequence-mean}"), file="job.yaml")
    assert problems == []
    loss = job.spec.stages[0].rl.loss
    assert (loss.mode, loss.eps_low, loss.eps_high, loss.aggregation) == ("masked", 0.2, 0.5, "sequence-mean")
    assert not hasattr(loss, "icepop_beta")  # masked has no IcePop at all


def test_cli_names_the_new_place_of_an_old_field(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(GOOD.replace("groupSize: 8", "groupSize: 8\n        lossMode: ppo"))
    res = _kiln("validate", str(old))
    assert res.returncode == 1
    assert "spec.stages[0].rl.lossMode: rl.lossMode moved to rl.loss.mode" in res.stderr


def test_line_numbers_point_at_the_field():
    text = GOOD.replace("groupSize: 8", "groupSize: eight")
    (problem,) = _problems(text)
    line = text.splitlines()[problem.line - 1]
    assert "groupSize" in line


def test_yaml_error_has_line():
    (problem,) = _problems(GOOD.replace("  name: demo", "  name: [demo"))
    assert problem.line is not None and problem.line >= 3


def test_several_documents_each_checked():
    bad = GOOD.replace("groupSize: 8", "groupSize: 1")
    jobs, problems = validate_text(GOOD + "---\n" + bad, file="multi.yaml")
    assert len(jobs) == 1
    assert len(problems) == 1 and "(document 2)" in problems[0].file


def test_load_job_raises_manifest_error(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(GOOD.replace("kind: RLJob", "kind: Job"))
    with pytest.raises(ManifestError) as info:
        load_job(f)
    assert isinstance(info.value, ValueError)
    assert "kind" in str(info.value)


def _kiln(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *args],
                          capture_output=True, text=True, cwd=cwd)


def test_cli_exit_codes_and_no_traceback(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("groupSize: 8", "groupSize: 1\n        gropuSize: 4"))
    ok = _kiln("validate", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    res = _kiln("validate", str(good), str(bad), str(tmp_path / "missing.yaml"))
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert f"{bad}:" in res.stderr and "spec.stages[0].rl.groupSize" in res.stderr
    assert "spec.stages[0].rl.gropuSize: unknown field" in res.stderr
    assert "missing.yaml: cannot read file" in res.stderr
    assert "2 of 3 file(s) invalid" in res.stderr


PLUGINS = REPO / "deploy" / "examples" / "plugins"


def _with_tasks(tasks: list[dict]) -> str:
    data = yaml.safe_load(GOOD)
    data["spec"]["tasks"] += tasks
    return yaml.safe_dump(data, sort_keys=False)


def test_plugins_are_imported_and_checked(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    (tmp_path / "not_an_env.py").write_text("class Thing:\n    pass\n\ndef reward(task):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where a task path of a text without a file is read from
    (tmp_path / "x.jsonl").write_text("{}\n")
    text = _with_tasks([
        {"name": "ok", "env": {"plugin": "echo_env:EchoFileEnv"},
         "reward": {"plugin": "echo_env:shorter_is_better"}, "path": "x.jsonl"},
        {"name": "missing", "env": {"plugin": "no_such_module:Env"}, "path": "x.jsonl"},
        {"name": "attr", "env": {"plugin": "echo_env:Nope"}, "path": "x.jsonl"},
        {"name": "kind", "env": {"plugin": "not_an_env:Thing"}, "path": "x.jsonl"},
        {"name": "sig", "env": "terminal", "path": "x.jsonl", "reward": {"plugin": "not_an_env:reward"}},
        {"name": "ep", "env": {"plugin": "no-entry-point"}, "path": "x.jsonl"},
    ])
    assert validate_text(text, file="job.yaml")[1] == []  # not imported unless asked
    _, problems = validate_text(text, file="job.yaml", local=True)
    got = {p.path: p.message for p in problems}
    assert set(got) == {"spec.tasks[2].env.plugin", "spec.tasks[3].env.plugin",
                        "spec.tasks[4].env.plugin", "spec.tasks[5].reward.plugin",
                        "spec.tasks[6].env.plugin"}
    assert "No module named 'no_such_module'" in got["spec.tasks[2].env.plugin"]
    assert "has no attribute 'Nope'" in got["spec.tasks[3].env.plugin"]
    assert "not a subclass of kiln.env.Environment" in got["spec.tasks[4].env.plugin"]
    assert "must take (task, grade, transcript)" in got["spec.tasks[5].reward.plugin"]
    assert "nor an entry point of group 'kiln.environments'" in got["spec.tasks[6].env.plugin"]
    lines = text.splitlines()
    for p in problems:
        assert "plugin" in lines[p.line - 1], p


def test_env_takes_a_builtin_name_or_a_plugin_mapping() -> None:
    _, problems = validate_text(_with_tasks([{"name": "x", "env": "gvisor", "path": "x.jsonl"}]),
                                file="job.yaml")
    assert [str(p) for p in problems] == [
        "job.yaml:15: spec.tasks[1].env: expected one of 'chain', 'lookup', 'terminal', 'swe', "
        "'search', 'code', 'wide', 'wide-lookup' or a {plugin: \"module:Name\"} mapping, found 'gvisor'"]


def test_validate_command_checks_the_plugin_example_job() -> None:
    env = {"PYTHONPATH": str(PLUGINS), "PATH": "/usr/bin:/bin"}
    job = REPO / "deploy" / "examples" / "plugin.yaml"
    ok = subprocess.run([sys.executable, "-m", "kiln.cli", "validate", str(job)],
                        capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "kiln.cli", "validate", str(job)],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert bad.returncode == 1
    assert "spec.tasks[0].env.plugin: 'echo_env:EchoFileEnv': cannot import module 'echo_env'" in bad.stderr


def test_a_model_nothing_will_get_here_is_refused_locally(tmp_path: Path) -> None:
    """`kiln validate` and `kiln run` refuse a model that is not on this machine unless
    spec.model.init makes it or spec.model.hub downloads it; a hub id is named as one."""
    def job(model: dict) -> str:
        data = yaml.safe_load(GOOD)
        data["spec"]["model"] = model
        return yaml.safe_dump(data, sort_keys=False)

    missing = str(tmp_path / "nowhere")
    _, problems = validate_text(job({"path": missing}), file="job.yaml", local=True)
    assert [(p.path, p.line) for p in problems] == [("spec.model.path", 7)]
    assert "holds no config.json, and neither spec.model.init nor spec.model.hub" in problems[0].message
    _, problems = validate_text(job({"path": "Qwen/Qwen3-8B"}), file="job.yaml", local=True)
    assert "set spec.model.hub: {id: Qwen/Qwen3-8B}" in problems[0].message
    for ok in ({"path": missing, "hub": {"id": "Qwen/Qwen3-8B"}}, {"path": missing, "init": {}},
               {"path": "qwen/7b", "pvc": "models"}):
        assert validate_text(job(ok), file="job.yaml", local=True)[1] == [], ok
    # The cluster (the operator) does not look for a model on its own machine.
    assert validate_text(job({"path": missing}), file="job.yaml")[1] == []
    _, problems = validate_text(job({"path": "m", "hub": {"id": "Qwen3-8B"}}), file="job.yaml")
    assert [p.path for p in problems] == ["spec.model.hub.id"]
    assert "expected owner/name" in problems[0].message
    _, problems = validate_text(job({"path": "m", "init": {}, "hub": {"id": "a/b"}}), file="job.yaml")
    assert "init and hub are two ways to get the model: set one" in problems[0].message


@pytest.mark.parametrize("port", [50050, 50051, 9090, 29500])
def test_the_endpoint_port_cannot_be_one_kiln_listens_on(port: int) -> None:
    data = yaml.safe_load(GOOD)
    data["spec"]["rollout"] = {"openaiPort": port}
    _, problems = validate_text(yaml.safe_dump(data), file="job.yaml")
    assert [p.path for p in problems] == ["spec.rollout.openaiPort"]
    assert f"{port} is the" in problems[0].message and "a port of its own" in problems[0].message
    data["spec"]["rollout"] = {"openaiPort": 8000, "openai": {"apiKeySecret": "keys"}}
    assert validate_text(yaml.safe_dump(data), file="job.yaml")[1] == []


def test_an_rl_stage_without_task_sets_needs_the_openai_endpoint() -> None:
    """`tasks: []`: the stage trains on outside agents' episodes alone, so it needs their door."""
    empty = GOOD.replace("tasks: [train]", "tasks: []")
    _, problems = validate_text(empty, file="job.yaml")
    assert len(problems) == 1 and "stages[0] (rl): tasks is empty" in problems[0].message
    assert "rollout.openaiPort" in problems[0].message
    served = empty + "  rollout:\n    openaiPort: 8000\n"
    (job,), problems = validate_text(served, file="job.yaml")
    assert problems == [] and job.spec.stages[0].tasks == []
    opd = served.replace("type: rl", "type: opd").replace("groupSize: 8", "groupSize: 8\n        teacher: /t")
    for other in (served.replace("type: rl", "type: sft"), opd):
        problems = validate_text(other, file="job.yaml")[1]
        assert any("tasks" in f"{p.path} {p.message}" for p in problems), problems
