"""What every `kiln` command shares (`kiln.cli.exits`, `kiln.cli.conventions`): one exit-code
table, the job as the first argument (`--job` a deprecated alias), sizes as Kubernetes
quantities, `--set PATH=VALUE` overrides validated like the file, and manifests in the CRD's
camelCase only. Commands run in-process through `kiln.cli.main.main`, as `kiln` runs them, and
one through a real process to check the code a shell sees."""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers.capabilities import checkpoint_config
from kiln.api.overrides import OverrideError, apply_overrides
from kiln.api.validate import validate_text
from kiln.cli.conventions import byte_quantity, take_job
from kiln.cli.exits import Exit
from kiln.cli.main import COMMANDS, command_parser, main

GOOD = textwrap.dedent("""\
    apiVersion: kiln.dev/v1alpha1
    kind: RLJob
    metadata:
      name: conventions
    spec:
      model:
        path: MODEL
      tasks:
        - name: train
          env: chain
          generate: {count: 8}
      stages:
        - name: sft
          type: sft
          tasks: [train]
          maxSteps: 4
        - name: rl
          type: rl
          tasks: [train]
          maxSteps: 4
          batchSize: 16
          microBatchSize: 8
          rl:
            groupSize: 8
    """)


@pytest.fixture()
def jobs(tmp_path: Path) -> tuple[Path, Path]:
    """(a valid job whose model is here, the same job with one value out of range)."""
    good = tmp_path / "good.yaml"
    good.write_text(GOOD.replace("MODEL", str(checkpoint_config(tmp_path))))
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("groupSize: 8", "groupSize: 1"))
    return good, bad


def _code(argv: list[str]) -> int:
    """The exit code of `kiln ARGV`, whether the command returns it or argparse exits."""
    try:
        return int(main(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


# --- one exit-code table ------------------------------------------------------------------------

@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_flag_is_refused_input_for_every_command(command: str, capsys) -> None:
    # (Or a required argument or subcommand is missing first: a usage error all the same.)
    assert _code([command, "--no-such-flag"]) == Exit.REFUSED
    assert "error: " in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["validate", "{bad}"],
    ["run", "{bad}", "--run-dir", "{tmp}/run"],
    ["simulate", "{bad}"],
    ["prepare-model", "{bad}"],
    ["eval", "{bad}", "{tmp}", "--task-set", "train", "--out", "{tmp}/eval"],
], ids=lambda a: a[0])
def test_a_bad_manifest_is_refused_input_for_every_command_that_takes_a_job(
        argv: list[str], jobs, tmp_path: Path, capsys) -> None:
    _, bad = jobs
    argv = [a.format(bad=bad, tmp=tmp_path) for a in argv]
    assert _code(argv) == Exit.REFUSED
    err = capsys.readouterr().err
    assert "spec.stages[1].rl.groupSize" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "eval").exists()


def test_validate_and_run_exit_the_same_for_the_same_bad_manifest_in_a_shell(jobs, tmp_path) -> None:
    _, bad = jobs
    codes = [subprocess.run([sys.executable, "-m", "kiln.cli", *argv], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path).returncode
             for argv in (["validate", str(bad)], ["run", str(bad)], ["crd", "--nope"])]
    assert codes == [Exit.REFUSED] * 3


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys) -> None:
    import kiln.cli.crd

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(kiln.cli.crd, "run", interrupted)
    assert _code(["crd"]) == Exit.INTERRUPTED == 130
    assert "Traceback" not in capsys.readouterr().err


# --- the job as the first argument --------------------------------------------------------------

def _parse(argv: list[str]) -> argparse.Namespace:
    parser = command_parser(argv[0])
    args = parser.parse_args(argv)
    take_job(args, parser)
    return args


def test_the_job_is_the_first_argument_and_the_old_flag_still_works(jobs, capsys) -> None:
    good, _ = jobs
    assert _code(["prepare-model", str(good)]) == Exit.OK
    assert capsys.readouterr().err == ""
    assert _code(["prepare-model", "--job", str(good)]) == Exit.OK  # as older operators run it
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "--job JOB is deprecated" in warning[0]
    assert f"kiln prepare-model {good}" in warning[0]
    assert _code(["prepare-model", str(good), "--job", str(good)]) == Exit.REFUSED
    assert "the job is given twice" in capsys.readouterr().err
    assert _code(["prepare-model"]) == Exit.REFUSED
    assert "required: JOB" in capsys.readouterr().err


def test_eval_takes_the_job_first_and_reads_the_old_order_with_the_flag(capsys) -> None:
    new = _parse(["eval", "job.yaml", "ckpt", "--task-set", "t", "--out", "o"])
    old = _parse(["eval", "ckpt", "--job", "job.yaml", "--task-set", "t", "--out", "o"])
    assert (new.job, new.model_dir) == (old.job, old.model_dir) == (Path("job.yaml"), Path("ckpt"))
    assert "deprecated" in capsys.readouterr().err
    assert _parse(["simulate", "job.yaml"]).job == Path("job.yaml")
    assert _parse(["run", "--resume", "runs/x"]).job is None  # run's job is optional with --resume


# --- sizes as Kubernetes quantities -------------------------------------------------------------

def test_sizes_are_kubernetes_quantities() -> None:
    parse = byte_quantity("--memory")
    assert parse("256Mi") == 256 << 20 and parse("1Gi") == 1 << 30
    assert parse("1M") == 1_000_000 and parse("4096") == 4096
    for bad in ("256m", "lots", "1g", "0", "0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_sandbox_memory_in_milli_is_refused_naming_the_flag_and_the_fix(capsys) -> None:
    assert _code(["sandbox", "exec", "--memory", "256m", "--", "true"]) == Exit.REFUSED
    err = capsys.readouterr().err
    assert "argument --memory: '256m'" in err and "write 256Mi" in err
    args = _parse(["sandbox", "exec", "--", "true"])
    assert (args.memory, args.disk, args.output_limit) == (512 << 20, 1 << 30, 1 << 20)


# --- --set PATH=VALUE ---------------------------------------------------------------------------

def test_set_overrides_are_applied_before_validation(jobs) -> None:
    good, _ = jobs
    text = good.read_text()
    (job,), problems = validate_text(text, file="j.yaml", overrides=[
        "spec.stages[1].rl.groupSize=4", "spec.stages[1].rl.tau=3", "metadata.name=renamed",
        "spec.stages[1].eval=null"])
    assert problems == []
    assert (job.spec.stages[1].rl.group_size, job.spec.stages[1].rl.tau) == (4, 3)
    assert job.metadata.name == "renamed"
    # A value the schema refuses is refused as the file's would be, naming the --set.
    _, (problem,) = validate_text(text, file="j.yaml", overrides=["spec.stages[1].rl.groupSize=1"])
    assert problem.path == "spec.stages[1].rl.groupSize" and problem.line is None
    assert problem.message.endswith("(set by --set spec.stages[1].rl.groupSize=1)")
    _, (problem,) = validate_text(text, file="j.yaml", overrides=["spec.stages[1].rl.grup=2"])
    assert "unknown field" in problem.message and problem.path == "spec.stages[1].rl.grup"


@pytest.mark.parametrize("setting, says", [
    ("spec.stages[7].rl.groupSize=4", "spec.stages[7]: spec.stages has 2 item(s), indexes 0 to 1"),
    ("spec.stages.1.rl.groupSize=4", "write spec.stages[1] for a list item"),
    ("spec.model.path.deeper=4", "spec.model.path.deeper: spec.model.path is not a mapping"),
    ("spec..model=4", "'spec..model' is not a field path"),
    ("spec.stages[x]=4", "[x] is not a list index"),
    ("spec.model.path", "expected PATH=VALUE"),
    ("spec.model.path=[unclosed", "the value is not valid YAML"),
])
def test_a_bad_set_names_its_path(setting: str, says: str) -> None:
    data = yaml.safe_load(GOOD)
    with pytest.raises(OverrideError) as err:
        apply_overrides(data, [setting])
    assert str(err.value).startswith(f"--set {setting}: ") and says in str(err.value)


def test_set_values_are_yaml_scalars() -> None:
    data: dict = {}
    apply_overrides(data, ["a.n=8", "a.f=0.5", "a.b=true", "a.s=hello", "a.q='8'", "a.z=null",
                           "a.l=[1, 2]", "labels.app\\.kubernetes\\.io/name=x"])
    assert data == {"a": {"n": 8, "f": 0.5, "b": True, "s": "hello", "q": "8", "z": None,
                          "l": [1, 2]}, "labels": {"app.kubernetes.io/name": "x"}}


def test_set_on_validate_simulate_and_run(jobs, tmp_path: Path, capsys) -> None:
    good, _ = jobs
    bad_set = ["--set", "spec.stages[1].rl.groupSize=1"]
    assert _code(["validate", str(good), *bad_set]) == Exit.REFUSED
    assert "(set by --set spec.stages[1].rl.groupSize=1)" in capsys.readouterr().err
    assert _code(["run", str(good), "--run-dir", str(tmp_path / "run"), *bad_set]) == Exit.REFUSED
    assert "set by --set" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert _code(["simulate", str(good), "--steps", "2", "--seeds", "1",
                  "--set", "spec.stages[1].rl.tau=3"]) == Exit.OK
    assert "tau 3)" in capsys.readouterr().out


def test_run_writes_the_overridden_job(jobs, tmp_path: Path) -> None:
    from kiln.cli.local.preflight import prepare

    good, _ = jobs
    args = argparse.Namespace(job=good, run_dir=tmp_path / "run", resume=None,
                              overrides=["spec.stages[0].maxSteps=2"])
    job, run_dir = prepare(args, io.StringIO(), io.StringIO())
    saved = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert job.spec.stages[0].max_steps == saved["spec"]["stages"][0]["maxSteps"] == 2
    # On a resumed run --set edits the saved job, and what cannot change is refused.
    resumed = argparse.Namespace(job=None, run_dir=None, resume=run_dir,
                                 overrides=["spec.stages[0].maxSteps=3"])
    out, err = io.StringIO(), io.StringIO()
    job, _ = prepare(resumed, out, err)
    assert job.spec.stages[0].max_steps == 3
    assert "spec.stages[0].maxSteps: 2 -> 3" in out.getvalue()
    resumed.overrides = ["metadata.name=other"]
    assert prepare(resumed, out, err) == Exit.REFUSED
    assert "these cannot change: metadata.name" in err.getvalue()


# --- manifests in camelCase only; removed fields --------------------------------------------------

def _edited(edit) -> str:
    data = yaml.safe_load(GOOD.replace("MODEL", "/models/x"))
    edit(data["spec"]["stages"])
    return yaml.safe_dump(data, sort_keys=False)


def test_a_snake_case_key_is_refused_naming_the_camel_case_one() -> None:
    def snake(stages: list) -> None:
        stages[0]["max_steps"] = stages[0].pop("maxSteps")
        stages[1]["rl"]["group_size"] = stages[1]["rl"].pop("groupSize")

    jobs, problems = validate_text(_edited(snake), file="j.yaml")
    assert jobs == []
    found = {p.path: p.message for p in problems}
    assert "write 'groupSize' instead of 'group_size'" in found["spec.stages[1].rl.group_size"]
    assert "write 'maxSteps' instead of 'max_steps'" in found["spec.stages[0].max_steps"]


def test_python_code_still_builds_models_by_field_name() -> None:
    from kiln.api.spec import RLSettings

    assert RLSettings(group_size=4).group_size == 4  # populate_by_name, for code, not manifests


def test_stage_epochs_is_gone_and_says_so() -> None:
    from kiln.api.crd import crd_yaml

    _, (problem,) = validate_text(_edited(lambda stages: stages[0].update(epochs=2)),
                                  file="j.yaml")
    assert problem.path == "spec.stages[0].epochs" and "epochs was removed" in problem.message
    assert "epochs:" not in crd_yaml()


def test_a_size_in_milli_is_refused_in_the_manifest_too() -> None:
    data = yaml.safe_load(GOOD.replace("MODEL", "/models/x"))
    data["spec"]["sandbox"] = {"memory": "256m"}
    _, (problem,) = validate_text(yaml.safe_dump(data), file="j.yaml")
    assert problem.path == "spec.sandbox.memory" and "for mebibytes write 256Mi" in problem.message
    data["spec"]["sandbox"] = {"memory": "256Mi"}
    assert validate_text(yaml.safe_dump(data), file="j.yaml")[1] == []
