"""The documentation site builds with `mkdocs build --strict` (every page in the nav, every link
and anchor resolving, the generated reference included), and the README stays the short front
door it is meant to be: at most 300 lines, its two commands intact, its links into the site
pointing at pages that exist."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def test_the_site_builds_strict(tmp_path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    for page in ("index.html", "getting-started/index.html", "reference/rljob/index.html",
                 "reference/cli/index.html", "reference/metrics/index.html", "reference/alerts/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_mkdocs_config_is_strict_and_material() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["site_name"] == "Kiln"
    assert config["theme"]["name"] == "material"
    assert config["strict"] is True


def test_the_site_is_where_the_alerts_link_their_runbooks() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    values = yaml.safe_load((REPO / "charts" / "kiln" / "values.yaml").read_text())
    assert config["site_url"].rstrip("/") == values["docsBaseUrl"].rstrip("/")


def test_results_index_links_every_results_page() -> None:
    index = REPO / "benchmarks" / "RESULTS.md"
    links = set(re.findall(r"\]\(\.\./docs/results/([^)#]+)\)", index.read_text()))
    pages = {p.name for p in (REPO / "docs" / "results").glob("*.md")}
    assert links == pages
    # the mutation-testing score and its command stay findable from the index
    assert "mutmut run" in index.read_text()


def test_readme_is_short_and_keeps_its_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "bash deploy/setup.sh && .venv/bin/kiln run deploy/examples/quickstart.yaml" in text
    assert "bash deploy/setup.sh && .venv/bin/python -m pytest -q" in text
    assert (REPO / "deploy" / "examples" / "quickstart.yaml").is_file()


def test_readme_links_reach_existing_files() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).exists()]
    assert missing == []
