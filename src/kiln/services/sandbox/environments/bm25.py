"""A small in-memory BM25 index over a folder of text and HTML documents.

Okapi BM25 (k1 = 1.5, b = 0.75) with Lucene's non-negative idf, ln(1 + (N - df + 0.5) /
(df + 0.5)); tokens are lowercase runs of letters and digits. HTML is reduced to its text
(scripts and styles dropped) and its <title> becomes the document title.

Not covered: stemming, phrase queries, persistence (an index of a few thousand pages builds in
well under a second).
"""
from __future__ import annotations

import html
import html.parser
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

TOKEN_RE = re.compile(r"[a-z0-9]+")
DOC_SUFFIXES = (".txt", ".md", ".html", ".htm")


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text.lower())


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "title":
            self._in_title = True
        elif tag in ("p", "br", "div", "li", "h1", "h2", "h3", "tr"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif not self._skip:
            self.parts.append(data)


@dataclass
class Document:
    id: str
    title: str
    text: str


def load_document(path: Path, doc_id: str) -> Document:
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in (".html", ".htm"):
        parser = _TextExtractor()
        parser.feed(raw)
        text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()
        return Document(doc_id, parser.title.strip() or doc_id, html.unescape(text))
    first = raw.strip().splitlines()[0] if raw.strip() else doc_id
    return Document(doc_id, first.lstrip("# ").strip(), raw.strip())


@dataclass
class Hit:
    id: str
    title: str
    score: float
    snippet: str


class BM25Index:
    def __init__(self, docs: list[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs = {d.id: d for d in docs}
        self.k1, self.b = k1, b
        self._tf: dict[str, Counter] = {}
        self._len: dict[str, int] = {}
        df: Counter = Counter()
        for d in docs:
            tokens = tokenize(d.title + " " + d.text)
            self._tf[d.id] = Counter(tokens)
            self._len[d.id] = len(tokens)
            df.update(set(tokens))
        n = len(docs)
        self._avg = (sum(self._len.values()) / n) if n else 0.0
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    @classmethod
    def from_folder(cls, folder: Path) -> "BM25Index":
        if not folder.is_dir():
            raise FileNotFoundError(f"corpus: {folder} is not a folder")
        docs = [load_document(p, p.relative_to(folder).as_posix())
                for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix in DOC_SUFFIXES]
        return cls(docs)

    def score(self, query_tokens: list[str], doc_id: str) -> float:
        tf, length, total = self._tf[doc_id], self._len[doc_id], 0.0
        for t in query_tokens:
            f = tf.get(t, 0)
            if f:
                norm = self.k1 * (1 - self.b + self.b * length / (self._avg or 1.0))
                total += self._idf[t] * f * (self.k1 + 1) / (f + norm)
        return total

    def search(self, query: str, k: int = 5) -> list[Hit]:
        tokens = tokenize(query)
        scored = [(self.score(tokens, d), d) for d in self.docs]
        scored = [(s, d) for s, d in scored if s > 0]
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [Hit(d, self.docs[d].title, s, self._snippet(d, tokens)) for s, d in scored[:k]]

    def _snippet(self, doc_id: str, tokens: list[str], width: int = 200) -> str:
        text = self.docs[doc_id].text
        lower = text.lower()
        pos = min((lower.find(t) for t in tokens if lower.find(t) >= 0), default=0)
        start = max(0, pos - width // 4)
        return " ".join(text[start:start + width].split())

    def open(self, doc_id: str, max_chars: int = 20_000) -> str:
        if doc_id not in self.docs:
            raise KeyError(f"doc_id: no document {doc_id!r} in the corpus")
        d = self.docs[doc_id]
        return f"{d.title}\n\n{d.text[:max_chars]}"
