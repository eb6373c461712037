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
from html.parser import HTMLParser
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


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.title = ""
        self._skip = 0
        self._in_title = False
        self._h1 = ""
        self._in_h1 = False

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "nav", "footer"):
            self._skip += 1
        self._in_title |= tag == "title"
        self._in_h1 |= tag == "h1"
        if tag in ("p", "div", "br", "li", "pre", "h1", "h2", "h3", "tr"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav", "footer") and self._skip:
            self._skip -= 1
        if tag == "title":
            self._in_title = False
        if tag == "h1":
            self._in_h1 = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif not self._skip:
            if self._in_h1:
                self._h1 += data
            self.parts.append(data)


def read_page(path: Path) -> tuple[str, str]:
    """(title, visible text) of a page."""
    raw = path.read_text(errors="replace")
    if path.suffix in (".html", ".htm"):
        parser = _Text()
        parser.feed(raw)
        text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()
        title = (parser.title or parser._h1).strip()
    else:
        text = raw.strip()
        heading = re.search(r"^#\s+(.+)$", raw, re.M)
        title = heading.group(1).strip() if heading else ""
    return title or path.stem.replace("-", " ").replace("_", " "), text


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
