"""A knowledge graph read from a document corpus by rules, for `kiln synth search`.

- Entities: one per document, named by its title. Aliases: the title, the title without a
  parenthesised qualifier ("Seln (river)" -> "Seln", with type "river"), without a leading
  "The". Normalisation is the graders' (`normalize_answer`: case, punctuation, articles), and
  alignment merges documents whose normalised names agree (two pages about one thing become
  one entity, their facts pooled).
- Attributes: `Key: value` lines (infobox style); the first sentence's "X is a/an TYPE ..."
  (type); "(1870-1944)" after a person's name (born, died); "founded/established/built in
  YEAR" (founded).
- Relations: a sentence that mentions two entities, subject first, with a short phrase between
  them ("The river Seln flows through Keldor" -> Seln, "flows through", Keldor). A sentence
  that opens with a pronoun (It, She, ...) has the document's entity as its subject. Every
  relation keeps its sentence and document: the evidence a question's chain is built from.
- Frequency: in how many documents an entity is mentioned; questions prefer the long tail.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kiln.services.sandbox.environments.base import normalize_answer
from kiln.services.sandbox.environments.bm25 import BM25Index

MAX_PHRASE_WORDS = 12
_PRONOUN = re.compile(r"^(It|He|She|They|This|Its|His|Her|Their)\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_INFOBOX = re.compile(r"^\s*([A-Z][A-Za-z ]{1,30}):\s+(\S.{0,80})$", re.M)
_TYPE = re.compile(r"\b(?:is|was)\s+(?:a|an|the)\s+((?:[a-z-]+\s+){0,3}?[a-z-]+)"
                   r"(?=\s+(?:in|of|on|at|near|from|that|which|who|with|for|by|above|below)\b|[,.;])")
_LIFESPAN = re.compile(r"\((\d{3,4})\s*[-–]\s*(\d{3,4})\)")
_FOUNDED = re.compile(r"\b(?:founded|established|built|opened)\s+in\s+(\d{3,4})\b")


@dataclass
class Entity:
    id: str
    name: str
    aliases: set[str] = field(default_factory=set)
    docs: list[str] = field(default_factory=list)
    attributes: dict[str, str] = field(default_factory=dict)
    frequency: int = 0


@dataclass(frozen=True)
class Relation:
    subject: str
    phrase: str
    object: str
    sentence: str
    doc: str


class KnowledgeGraph:
    def __init__(self, index: BM25Index):
        self.index = index
        self.entities: dict[str, Entity] = {}
        self.relations: list[Relation] = []
        self._by_alias: dict[str, str] = {}
        self._build()

    @classmethod
    def from_folder(cls, folder: Path) -> "KnowledgeGraph":
        return cls(BM25Index.from_folder(folder))

    # -- lookup ---------------------------------------------------------------------------
    def edges(self, entity: str) -> list[Relation]:
        return self._edges.get(entity, [])

    def between(self, a: str, b: str) -> list[Relation]:
        """Relations between two entities, either way round."""
        return self._pairs.get(frozenset((a, b)), [])

    def neighbours(self, entity: str) -> set[str]:
        return {r.object if r.subject == entity else r.subject for r in self.edges(entity)}

    def entity_of(self, alias: str) -> str | None:
        return self._by_alias.get(normalize_answer(alias))

    # -- building -------------------------------------------------------------------------
    def _build(self) -> None:
        for doc in self.index.docs.values():
            name, qualifier = _split_title(doc.title)
            eid = normalize_answer(name)
            if not eid:
                continue
            entity = self.entities.setdefault(eid, Entity(eid, name))  # alignment: same key
            entity.docs.append(doc.id)
            entity.aliases |= {name, doc.title.strip()}
            if name.lower().startswith("the "):
                entity.aliases.add(name[4:])
            if qualifier:
                entity.attributes.setdefault("type", qualifier.lower())
        for eid, entity in self.entities.items():
            for alias in entity.aliases:
                self._by_alias.setdefault(normalize_answer(alias), eid)
        patterns = self._alias_patterns()
        mentioned_in: dict[str, set[str]] = defaultdict(set)
        for doc in self.index.docs.values():
            owner = self.entity_of(_split_title(doc.title)[0])
            if owner is None:
                continue
            self._attributes(self.entities[owner], doc.text)
            for sentence in _sentences(doc.text, doc.title):
                mentions = _mentions(sentence, patterns)
                for _, _, eid in mentions:
                    if eid != owner:
                        mentioned_in[eid].add(doc.id)
                self._relations(owner, sentence, mentions, doc.id)
        for eid, entity in self.entities.items():
            entity.frequency = len(mentioned_in[eid])
        self._edges: dict[str, list[Relation]] = defaultdict(list)
        self._pairs: dict[frozenset, list[Relation]] = defaultdict(list)
        for r in self.relations:
            self._edges[r.subject].append(r)
            self._edges[r.object].append(r)
            self._pairs[frozenset((r.subject, r.object))].append(r)

    def _alias_patterns(self) -> list[tuple[re.Pattern, str]]:
        pairs = [(alias, eid) for eid, e in self.entities.items() for alias in e.aliases
                 if len(alias) >= 3]
        pairs.sort(key=lambda p: -len(p[0]))  # longest first: "Lake Amber" before "Amber"
        return [(re.compile(r"(?<!\w)" + re.escape(a) + r"(?!\w)"), eid) for a, eid in pairs]

    def _attributes(self, entity: Entity, text: str) -> None:
        for key, value in _INFOBOX.findall(text):
            entity.attributes.setdefault(key.strip().lower(), value.strip())
        first = next(iter(_sentences(text, "")), "")
        m = _TYPE.search(first)
        if m:
            entity.attributes.setdefault("type", m.group(1))
        m = _LIFESPAN.search(text[:400])
        if m:
            entity.attributes.setdefault("born", m.group(1))
            entity.attributes.setdefault("died", m.group(2))
        m = _FOUNDED.search(text)
        if m:
            entity.attributes.setdefault("founded", m.group(1))

    def _relations(self, owner: str, sentence: str, mentions, doc: str) -> None:
        spans = list(mentions)
        if _PRONOUN.match(sentence) and not any(eid == owner for *_, eid in spans):
            spans.insert(0, (0, len(_PRONOUN.match(sentence).group(0)), owner))
        for (s1, e1, a), (s2, e2, b) in zip(spans, spans[1:]):
            if a == b:
                continue
            phrase = sentence[e1:s2].strip(" ,")
            words = phrase.split()
            if not words or len(words) > MAX_PHRASE_WORDS or re.search(r"[;:()]", phrase):
                continue
            relation = Relation(a, phrase, b, sentence, doc)
            if relation not in self.relations:
                self.relations.append(relation)


def _split_title(title: str) -> tuple[str, str | None]:
    m = re.match(r"^(.*?)\s*\(([^)]+)\)\s*$", title.strip())
    return (m.group(1).strip(), m.group(2).strip()) if m else (title.strip(), None)


def _sentences(text: str, title: str) -> list[str]:
    body = text.strip()
    if title and body.startswith(title.strip()):  # the title line is not a sentence
        body = body[len(title.strip()):]
    body = re.sub(r"^#+\s.*$", " ", body, flags=re.M)
    body = _INFOBOX.sub(" ", body)
    return [s.strip() for s in _SENTENCE.split(" ".join(body.split())) if s.strip()]


def _mentions(sentence: str, patterns) -> list[tuple[int, int, str]]:
    """Non-overlapping (start, end, entity) mentions, in order."""
    taken: list[tuple[int, int, str]] = []
    for pattern, eid in patterns:
        for m in pattern.finditer(sentence):
            if all(m.end() <= s or m.start() >= e for s, e, _ in taken):
                taken.append((m.start(), m.end(), eid))
    return sorted(taken)
