"""One name per metric: `kiln.metrics` is the only definition, and everything that exports,
sends, records or reads a metric uses it.

Walks the sources, the chart and the docs rather than trusting a list: a Prometheus collector
built anywhere else, a series name spelled in another module, a dashboard or alert on a series
nothing defines, a step metric the wire or the report names differently, all fail here.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from kiln import metrics as M
from kiln.control import BufferStatus, Evaluation, RolloutStatus, TrainerStatus
from kiln.control import wire
from kiln.control.driver import trainer_record
from kiln.protos.kiln.v1 import trainer_pb2

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "kiln"
REGISTRY = SRC / "metrics.py"
SERIES_NAME = re.compile(r"\bkiln_[a-z][a-z0-9_]*")
# Samples a histogram or counter adds to its series' name.
SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def _sources() -> list[Path]:
    return [p for p in SRC.rglob("*.py") if "_pb2" not in p.name]


def _all_series() -> set[str]:
    return {m.series for m in M.ALL.values() if m.series}


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in _all_series():
            return name.removesuffix(suffix)
    return name


def test_names_and_series_are_unique() -> None:
    step_and_derived = [*M.STEP, *M.DERIVED]
    assert len(step_and_derived) == len(set(step_and_derived))
    assert not set(M.STEP) & set(M.DERIVED)
    assert not (set(M.STEP) | set(M.DERIVED)) & set(M.SERIES)
    series = [m.series for m in M.ALL.values() if m.series]
    assert len(series) == len(set(series)), sorted(s for s in series if series.count(s) > 1)
    for m in M.ALL.values():
        assert m.unit and m.help, m.name
        assert not m.series or SERIES_NAME.fullmatch(m.series), m.series
        assert bool(m.buckets) == (m.kind == "histogram"), m.name
        assert m.kind != "counter" or m.series.endswith("_total"), m.series


def test_no_collector_is_built_outside_the_registry() -> None:
    collectors = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
    for path in _sources():
        if path == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client":
                built = {a.name for a in node.names} & collectors
                assert not built, f"{path.relative_to(REPO)} imports {built} from prometheus_client"
            if isinstance(node, ast.Attribute) and node.attr in collectors:
                assert not (isinstance(node.value, ast.Name) and node.value.id == "prometheus_client"), \
                    f"{path.relative_to(REPO)} builds a prometheus_client.{node.attr}"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_series_names_are_spelled_only_in_the_registry() -> None:
    series = _all_series()
    for path in _sources():
        if path == REGISTRY:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                named = {_base(n) for n in SERIES_NAME.findall(node.value)} & series
                assert not named, f"{path.relative_to(REPO)} spells {named}: use kiln.metrics"
        # Docstrings and comments may name a series for the reader; it must be one that exists.
        for name in SERIES_NAME.findall(text):
            if name.endswith(("_total", "_seconds", "_fraction", "_bucket")):
                assert _base(name) in series, f"{path.relative_to(REPO)} mentions {name}"


def test_the_chart_and_docs_use_defined_series() -> None:
    files = [*(REPO / "charts").rglob("*.json"), *(REPO / "charts").rglob("*.yaml"),
             *(REPO / "docs").rglob("*.md"), REPO / "README.md"]
    used = {}
    for path in files:
        for name in SERIES_NAME.findall(path.read_text()):
            used.setdefault(_base(name), path)
    # Names of other kinds that share the prefix: a checkpoint key, a test module and the
    # PodMonitor's target label.
    unknown = {n: str(p.relative_to(REPO)) for n, p in used.items()
               if n not in _all_series() and n not in {"kiln_dsa", "kiln_run", "kiln_service"}}
    assert not unknown, f"series used but not defined in kiln.metrics: {unknown}"
    dashboards = " ".join(p.read_text() for p in (REPO / "charts").rglob("*.json"))
    assert "kiln_train_step_seconds" in dashboards  # the walk above does see the dashboards


def test_step_metrics_on_the_wire_have_the_same_names() -> None:
    msg = trainer_pb2.StepMetrics.DESCRIPTOR
    fields = {f.name: f for f in dataclasses.fields(M.StepMetrics)}
    assert set(msg.fields_by_name) == set(fields)
    for name, f in fields.items():
        # A metric a step may not measure (None) is one whose absence the wire can tell.
        optional = "None" in str(f.type)
        assert msg.fields_by_name[name].has_presence == optional or name == "staleness", name
        assert optional == (f.default is None), name
    # Every field set to a value of its own survives the round trip.
    values = {name: i + 1 for i, name in enumerate(fields) if name != "staleness"}
    m = M.StepMetrics(**values, staleness={0: 3, 4: 1})
    assert wire.step_metrics_from_proto(wire.step_metrics_to_proto(m)) == m
    sft = M.StepMetrics(step=2, loss=1.5)
    assert wire.step_metrics_from_proto(wire.step_metrics_to_proto(sft)).reward_mean is None


def test_every_exported_step_field_reaches_its_series() -> None:
    from kiln.services.trainer import metrics as trainer_metrics

    exported = {name for name, m in M.STEP.items() if m.series}
    assert set(trainer_metrics._COLLECTORS) == exported
    for name, collector in trainer_metrics._COLLECTORS.items():
        assert collector._name == M.STEP[name].series.removesuffix("_total"), name


def test_tracked_status_fields_are_the_records_fields() -> None:
    records = {"rollout": RolloutStatus, "buffer": BufferStatus, "eval": Evaluation}
    for prefix, names in M.STATUS.items():
        have = {f.name for f in dataclasses.fields(records[prefix])}
        assert set(names) <= have, (prefix, set(names) - have)


def test_the_progress_record_and_the_report_use_the_step_names() -> None:
    status = TrainerStatus(step=5, stage="rl", stage_step=2,
                           last_step=M.StepMetrics(step=5, reward_mean=0.5, staleness={1: 2}))
    rec = trainer_record(status)
    stage_keys = {"stage", "stage_step", "stage_done", "failed", "message"}
    assert set(rec) - stage_keys <= set(M.STEP)
    assert rec["reward_mean"] == 0.5 and rec["staleness"] == {"1": 2}
    # What the report reads of a record's trainer part are names it has.
    report = (SRC / "cli" / "local" / "report.py").read_text() + (SRC / "plots.py").read_text()
    read = set(re.findall(r'\["trainer"\](?:\.get\(|\[)"([a-z_]+)"', report))
    read |= set(re.findall(r'\bt(?:\.get\(|\[)"([a-z_]+)"', report))
    assert read and read <= set(M.STEP) | stage_keys, read - set(M.STEP) - stage_keys


@pytest.mark.parametrize("rl", [True, False])
def test_tracker_tags_are_defined_names(rl: bool) -> None:
    values = {name: 0.5 for name in M.STEP if name != "staleness"}
    scalars = M.StepMetrics(**values, staleness={0: 1, 2: 1}).scalars(rl=rl)
    assert set(scalars) <= set(M.STEP) | set(M.DERIVED)
    assert all(not M.ALL[k].rl_only for k in scalars) or rl
