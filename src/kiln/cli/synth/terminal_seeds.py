"""Seeds for `kiln synth terminal`: scenarios from a file, or technical pages from a folder.

`--seeds FILE`: one seed per line, plain text or a JSON object with `scenario` (or `seed`,
`text`) and optionally `id`. `--pages DIR`: every .md / .markdown / .html / .htm / .txt file
under DIR becomes one seed, its title and the first `PAGE_CHARS` characters of its text (HTML
reduced to its visible text). A seed's id is stable across runs (a slug of its title and a hash
of its text), which is what lets a re-run skip the seeds already decided.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .imports import safe_id

PAGE_CHARS = 4000
PAGE_SUFFIXES = (".md", ".markdown", ".html", ".htm", ".txt")


@dataclass(frozen=True)
class Seed:
    id: str
    title: str
    text: str
    source: str


def _seed_id(title: str, text: str) -> str:
    slug = safe_id(title.lower())[:40].strip("-.") or "task"
    return f"{slug}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def load_seeds(path: Path) -> list[Seed]:
    if not path.is_file():
        raise ValueError(f"--seeds {path}: no such file")
    seeds = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sid = None
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg}); write a JSON object with "
                                 f"`scenario`, or plain text") from None
            text = rec.get("scenario") or rec.get("seed") or rec.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{n}: expected a non-empty string in `scenario`")
            sid = rec.get("id")
        else:
            text = line
        title = text.split(".")[0][:60]
        seeds.append(Seed(safe_id(str(sid)) if sid else _seed_id(title, text), title, text,
                          f"{path}:{n}"))
    if not seeds:
        raise ValueError(f"--seeds {path}: no seed in the file")
    return seeds


def read_page(path: Path) -> tuple[str, str]:
    """(title, visible text) of a page, read as the search environment reads its corpus."""
    from kiln.services.sandbox.environments.bm25 import load_document
    if path.suffix in (".html", ".htm"):
        doc = load_document(path, path.name)
        return (doc.title if doc.title != path.name else path.stem), doc.text
    raw = path.read_text(errors="replace")
    heading = re.search(r"^#\s+(.+)$", raw, re.M)
    title = heading.group(1).strip() if heading else ""
    return title or path.stem.replace("-", " ").replace("_", " "), raw.strip()


def load_pages(folder: Path) -> list[Seed]:
    if not folder.is_dir():
        raise ValueError(f"--pages {folder}: not a folder")
    seeds = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in PAGE_SUFFIXES):
        title, text = read_page(path)
        if not text:
            continue
        excerpt = text[:PAGE_CHARS]
        seeds.append(Seed(_seed_id(title, excerpt), title, excerpt, str(path)))
    if not seeds:
        raise ValueError(f"--pages {folder}: no page ({', '.join(PAGE_SUFFIXES)}) with text")
    return seeds
