"""The chart's Grafana dashboard against the metric registry.

The dashboard is generated (`python -m kiln.dashboard`); these tests read the file Grafana gets
and hold it to the registry independently of the generator: every panel has a description that
carries the registry's help of what it plots, and every query's unit is the one the registry's
unit calls for, seen through what the query does with the series (a value, a rate, a quantile).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from kiln import dashboard
from kiln import metrics as M

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "charts" / "kiln" / "files").glob("*.json"))
GENERATED = REPO / "charts" / "kiln" / "files" / "kiln-off-policy-drift.json"

# Grafana units that show a value in each registry unit; any other unit is a plain number.
VALUE = {"fraction": {"percentunit"}, "seconds": {"s"}, "bytes": {"bytes", "decbytes"},
         "tokens/s": {"ops", "short"}}
PLAIN = {"short", "none"}
# A rate of a counter in seconds is the fraction of the time; of bytes a throughput; of
# anything else a count per second.
RATE = {"seconds": {"percentunit"}, "bytes": {"Bps", "binBps"}}
PER_SECOND = {"ops", "reqps", "cps"}
SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count")


def _panels(path: Path) -> list[dict]:
    return [p for p in json.loads(path.read_text())["panels"] if p["type"] != "row"]


def _by_series() -> dict[str, M.Metric]:
    return {m.series: m for m in M.ALL.values() if m.series}


def _plotted(expr: str) -> M.Metric:
    series = _by_series()
    names = set()
    for name in re.findall(r"\bkiln_[a-z0-9_]+", expr):
        for suffix in SAMPLE_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in series:
                name = name.removesuffix(suffix)
        assert name in series, f"{name} is not a series of kiln.metrics ({expr})"
        names.add(name)
    assert len(names) == 1, f"a query plots one series: {expr}"
    return series[names.pop()]


def _allowed_units(expr: str, m: M.Metric) -> set[str]:
    if "histogram_quantile(" in expr or "_sum{" in expr:
        return VALUE.get(m.unit, PLAIN)  # a quantile or a mean of observations
    if "rate(" in expr:
        return RATE.get(m.unit, PER_SECOND)
    return VALUE.get(m.unit, PLAIN)


def _unit_of(panel: dict, ref: str) -> str:
    field = panel.get("fieldConfig", {})
    for o in field.get("overrides", []):
        if o["matcher"] == {"id": "byFrameRefID", "options": ref}:
            return next(p["value"] for p in o["properties"] if p["id"] == "unit")
    return field.get("defaults", {}).get("unit", "")


def test_the_dashboard_file_is_generated_from_the_registry() -> None:
    assert GENERATED.read_text() == dashboard.render(), \
        "regenerate: python -m kiln.dashboard > charts/kiln/files/kiln-off-policy-drift.json"


def test_every_panel_has_a_description_carrying_the_registry_help() -> None:
    for path in DASHBOARDS:
        for panel in _panels(path):
            desc = panel.get("description", "").strip()
            assert desc, f"{path.name}: panel {panel['title']!r} has no description"
            for t in panel["targets"]:
                m = _plotted(t["expr"])
                assert m.help in desc, f"{path.name}: {panel['title']!r} lacks the help of {m.series}"


def test_every_query_has_the_unit_of_what_it_plots() -> None:
    wrong = []
    for path in DASHBOARDS:
        for panel in _panels(path):
            if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                wrong.append(f"{path.name}: {panel['title']!r} has no unit")
            for t in panel["targets"]:
                m = _plotted(t["expr"])
                if panel["type"] == "heatmap":
                    # Counts per bucket; the buckets' axis is in the series' unit.
                    got = panel.get("options", {}).get("yAxis", {}).get("unit", "")
                    allowed = VALUE.get(m.unit, PLAIN)
                else:
                    got, allowed = _unit_of(panel, t["refId"]), _allowed_units(t["expr"], m)
                if got not in allowed:
                    wrong.append(f"{path.name}: {panel['title']!r} {t['legendFormat']!r} "
                                 f"({m.series}, {m.unit}) in {got!r}, expected one of {sorted(allowed)}")
    assert not wrong, "\n".join(wrong)


def test_the_new_series_have_panels() -> None:
    exprs = " ".join(t["expr"] for p in _panels(GENERATED) for t in p["targets"])
    for name in ("ratio_only_frac", "icepop_only_frac", "both_masked_frac", "kl_ref", "dense_kl",
                 "routing_flip_frac", "teacher_score_seconds", "reward_model_seconds",
                 "freshness_tau"):
        assert M.ALL[name].series in exprs, name


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for p in json.loads(GENERATED.read_text())["panels"]:
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, p["title"]
        taken |= cells
    ids = [p["id"] for p in json.loads(GENERATED.read_text())["panels"]]
    assert len(ids) == len(set(ids))


def test_the_panels_the_troubleshooting_page_names_exist() -> None:
    page = (REPO / "docs" / "guides" / "troubleshooting.md").read_text()
    named = set()
    for group in re.findall(r'[Pp]anels?\s+((?:"[^"]+"(?:,?\s+(?:and\s+)?)?)+)', page):
        named |= {" ".join(n.split()) for n in re.findall(r'"([^"]+)"', group)}
    titles = {p["title"] for p in _panels(GENERATED)}
    assert len(named) >= 10 and named <= titles, named - titles
