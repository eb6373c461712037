"""The `kiln` command's surface: a version, and a description on every subcommand and help text
on every option (what `kiln ... --help` shows), checked over the whole parser tree."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kiln.cli.main import COMMANDS, command_parser


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_and_option_is_described(command: str) -> None:
    top = command_parser(command)
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    problems = []
    for path, parser in _parsers(sub, f"kiln {command}"):
        if not (parser.description or "").strip():
            problems.append(f"{path}: no description")
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                problems.append(f"{path}: {'/'.join(action.option_strings) or action.dest} has no help")
    assert problems == []


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "--version"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == f"kiln {metadata.version('kiln')}"


def test_top_level_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0
    for name, (_, help_) in COMMANDS.items():
        assert name in out.stdout and help_ in out.stdout
    bad = subprocess.run([sys.executable, "-m", "kiln.cli", "nope"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 1 and "invalid choice: 'nope'" in bad.stderr


def test_trajectories_prints_turns_spans_and_reward(tmp_path, capsys) -> None:
    import dataclasses
    import json

    from kiln.cli.main import main
    from kiln.models.tiny import train_tokenizer
    from kiln.trajectory import Trajectory, VersionSpan

    tok = train_tokenizer([f"<task>{i}</task><call>step {i}</call><obs>{i}</obs>" for i in range(50)],
                          tmp_path / "model", vocab_size=300,
                          special_tokens=["<task>", "</task>", "<call>", "</call>", "<obs>", "</obs>"])
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tok))
    prompt, action, obs = (t.encode(x, add_special_tokens=False)
                           for x in ("<task>7</task>", "<call>step 7</call>", "<obs>54</obs>"))
    traj = Trajectory(id="abc123", task_id="chain-7", group_id="g1", tokens=prompt + action + obs,
                      loss_mask=[0] * len(prompt) + [1] * len(action) + [0] * len(obs),
                      logp_infer=[0.0] * (len(prompt) + len(action) + len(obs)),
                      version_spans=[VersionSpan(len(prompt), len(prompt) + len(action), 3)],
                      prompt_len=len(prompt), reward=1.0, reward_parts={"correct": 1.0},
                      verifier_output="correct")
    run = tmp_path / "run"
    (run / "rollout").mkdir(parents=True)
    (run / "job.yaml").write_text(f"spec:\n  model:\n    path: {tok}\n")
    (run / "rollout" / "trajectories.jsonl").write_text(
        json.dumps({"stage": "rl", **dataclasses.asdict(traj)}) + "\n")
    assert main(["trajectories", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stage rl  task chain-7" in out and "reward 1 (correct=1)" in out
    assert f"versions [{len(prompt)},{len(prompt) + len(action)})@v3" in out
    assert "prompt: <task>7</task>" in out and "action: <call>step 7</call>" in out
    assert "observation: <obs>54</obs>" in out

    # Evaluation episodes, as rollout keeps them: every one, greedy ones at temperature 0.
    from kiln.services.rollout.samples import Samples

    kept = Samples(run / "rollout" / "trajectories.jsonl")
    kept.keep_evaluation("chain-heldout", 0.0, 5, dataclasses.replace(traj, id="greedy1", reward=0.0))
    kept.keep_evaluation("chain-heldout", 1.0, 5, dataclasses.replace(traj, id="sampled1"))
    assert main(["trajectories", str(run), "--evaluations", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert "=== greedy1  stage eval/chain-heldout" in out and "temperature 0 at v5" in out
    assert "sampled1" not in out and "abc123" not in out
    assert main(["trajectories", str(run), "--greedy"]) == 1
    assert "add --evaluations" in capsys.readouterr().err
    assert main(["trajectories", str(run), "--evaluations", "-n", "0"]) == 0
    assert "=== sampled1" in capsys.readouterr().out


def test_kiln_run_refuses_a_run_directory_a_stopped_run_left(tmp_path) -> None:
    # Stopped during its first stage: a job.yaml and checkpoints, no state.json yet. A new run
    # there would pick up that run's checkpoints as its own.
    run = tmp_path / "run"
    (run / "trainer" / "checkpoints" / "step_00000100").mkdir(parents=True)
    (run / "job.yaml").write_text("kind: RLJob\n")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "run",
                          str(repo / "deploy" / "examples" / "swarm.yaml"), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1 and "holds a previous run; use --resume" in out.stderr
    assert (run / "job.yaml").read_text() == "kind: RLJob\n"


def test_a_reader_that_went_away_ends_the_command_quietly() -> None:
    # `kiln trajectories RUN | head -1`: here the reader is gone before the first write, so
    # every write fails as the later ones do once `head` has its line.
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "kiln.cli", "crd"], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    err = proc.stderr.decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
