"""Every alert of the chart links its runbook: a section of the docs' troubleshooting page, under
the one documentation URL the chart's values set. And the series the staleness alert compares
with, the running stage's tau, is what the trainer exports.

The PrometheusRule is rendered by the real helm binary; promtool shows the alerts firing in
tests/integration/test_chart_prometheus.py.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kiln import metrics as M
from kiln.services.trainer import metrics as trainer_metrics

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kiln"
HELM = REPO / ".tools" / "bin" / "helm"
PAGE = REPO / "docs" / "guides" / "troubleshooting.md"


def _rules(*extra: str) -> list[dict]:
    if not HELM.exists():
        pytest.skip(f"helm not installed at {HELM} (deploy/setup.sh)")
    out = subprocess.run([str(HELM), "template", "kiln", str(CHART), "--set", "prometheusRule.enabled=true",
                          "--show-only", "templates/prometheusrule.yaml", *extra],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [r for g in yaml.safe_load(out)["spec"]["groups"] for r in g["rules"]]


def _anchors() -> dict[str, str]:
    """Heading anchors of the troubleshooting page, as MkDocs makes them for a heading that is
    one word (its text in lower case), to the section under it."""
    text = PAGE.read_text()
    heads = list(re.finditer(r"^#{2,4} +(\S+) *$", text, re.M))
    out = {}
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        out[h.group(1).lower()] = text[h.end():end]
    return out


def test_every_alert_links_its_section_of_the_troubleshooting_page() -> None:
    base = yaml.safe_load((CHART / "values.yaml").read_text())["docsBaseUrl"].rstrip("/")
    anchors = _anchors()
    rules = _rules()
    assert len(rules) >= 13
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        page, _, anchor = url.partition("#")
        assert page == f"{base}/guides/troubleshooting/", f"{rule['alert']}: {url}"
        assert anchor == rule["alert"].lower(), f"{rule['alert']}: {url}"
        section = anchors.get(anchor)
        assert section is not None, f"{PAGE.relative_to(REPO)} has no section {rule['alert']}"
        for part in ("**Symptom**", "**What it means**", "**What to do**"):
            assert part in section, f"section {rule['alert']} lacks {part}"


def test_runbooks_follow_the_one_docs_url() -> None:
    rules = _rules("--set", "docsBaseUrl=https://docs.example.org/kiln/")
    assert {r["annotations"]["runbook_url"].partition("#")[0] for r in rules} == {
        "https://docs.example.org/kiln/guides/troubleshooting/"}


def _tau_samples() -> dict[str, float]:
    (family,) = list(trainer_metrics.FRESHNESS_TAU.collect())
    return {s.labels["stage"]: s.value for s in family.samples}


def test_the_running_stage_tau_is_exported_and_only_it() -> None:
    assert trainer_metrics.FRESHNESS_TAU._name == M.SERIES["freshness_tau"].series
    try:
        trainer_metrics.observe_stage_tau("explore", 8)
        assert _tau_samples() == {"explore": 8}
        trainer_metrics.observe_stage_tau("exploit", 2)
        assert _tau_samples() == {"exploit": 2}
        # A supervised stage has no bound: no series, so the staleness alert has nothing to
        # compare with (rather than a tau of 0 that every trajectory would be "near").
        trainer_metrics.observe_stage_tau("warmup", None)
        assert _tau_samples() == {}
        # The stage runner calls it as it configures the buffer for a stage
        # (tests/unit/test_trainer_servicer.py runs one).
    finally:
        trainer_metrics.FRESHNESS_TAU.clear()

