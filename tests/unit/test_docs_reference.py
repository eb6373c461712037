"""The documentation's generated reference names everything it documents: every RLJob field,
every command and flag, every metric and its series, every alert with its runbook.

Each list of what must appear is read here independently of the generator (the pydantic models'
own fields, argparse's actions, the metric registry, the chart template's `alert:` lines), so a
generator that skips a kind of field or a flag fails here, not only a stale page.
"""
from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from kiln import metrics
from kiln.api.spec import RLJobSpec, RLJobStatus
from kiln.cli import reference_docs as ref
from kiln.cli.main import COMMANDS, command_parser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {name: make() for name, make in ref.PAGES.items()}


def _models_in(annotation: typing.Any) -> list[tuple[str, type[BaseModel]]]:
    """The models a field's annotation holds, with the path suffix that reaches them
    ("" for a direct or optional field, "[]" through a list, ".<name>" through a map)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset):
        return [("[]" + s, m) for a in args for s, m in _models_in(a)]
    if origin is dict:
        return [(".<name>" + s, m) for s, m in _models_in(args[1])]
    return [pair for a in args for pair in _models_in(a)]  # Optional, unions, Annotated


def field_paths(model: type[BaseModel], prefix: str) -> set[str]:
    out: set[str] = set()
    for name, f in model.model_fields.items():
        path = f"{prefix}.{f.alias or name}"
        out.add(path)
        for suffix, sub in _models_in(f.annotation):
            out |= field_paths(sub, path + suffix)
    return out


def test_every_rljob_field_is_in_the_reference(pages) -> None:
    paths = field_paths(RLJobSpec, "spec") | field_paths(RLJobStatus, "status")
    assert len(paths) > 200  # the walk reached the nested sections
    listed = set(re.findall(r"^\| `([^`]+)` \|", pages["rljob.md"], re.M))
    assert sorted(paths - listed) == []


def _parsers(name: str, parser: argparse.ArgumentParser):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(f"{name} {sub_name}", sub)


def test_every_command_and_flag_is_in_the_reference(pages) -> None:
    page = pages["cli.md"]
    sections = dict(re.findall(r"^#+ kiln ([^\n]+)\n(.*?)(?=^#+ kiln |\Z)", page, re.M | re.S))
    seen = 0
    for name in COMMANDS:
        (_, top), = [(n, p) for n, p in _parsers("", command_parser(name)) if n.strip() == name]
        for full, parser in _parsers(name, top):
            assert full in sections, f"kiln {full} has no section"
            for action in parser._actions:
                if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                for flag in action.option_strings or [action.metavar or action.dest]:
                    assert f"`{flag}" in sections[full], f"kiln {full}: {flag} is not documented"
                    seen += 1
    assert seen > 100


def test_every_metric_and_series_is_in_the_reference(pages) -> None:
    page = pages["metrics.md"]
    every = [*metrics.STEP.values(), *metrics.DERIVED.values(), *metrics.SERIES.values(), metrics.PASS_AT_K]
    for m in every:
        assert f"| `{m.name}` |" in page, m.name
        if m.series:
            assert f"`{m.series}`" in page, m.series
    for prefix, group in [("progress", metrics.PROGRESS), *metrics.STATUS.items()]:
        for name in group:
            assert f"/{name}` |" in page and f"`{prefix}/" in page, (prefix, name)


def test_every_alert_is_in_the_reference_with_its_runbook(pages) -> None:
    template = (REPO / "charts" / "kiln" / "templates" / "prometheusrule.yaml").read_text()
    alerts = re.findall(r"^\s*- alert: (\w+)", template, re.M)
    assert len(alerts) >= 10
    page = pages["alerts.md"]
    for alert in alerts:
        assert f"\n## {alert}\n" in page, alert
        assert f"(../guides/troubleshooting.md#{alert.lower()})" in page, f"{alert}: no runbook link"
