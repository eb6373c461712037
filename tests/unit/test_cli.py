"""The `kiln` command's surface: a version, and a description on every subcommand and help text
on every option (what `kiln ... --help` shows), checked over the whole parser tree."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

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
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr
