"""Multi-hop questions over the knowledge graph: walks, the uniqueness check and the
query-evolution operators of `kiln synth search`.

A question is a set of clues over variables [A], [B], ... and the variable asked for:

- `name`: [A] is the entity E (a direct mention: [A] is written as E's name);
- `attr`: [A]'s KEY is VALUE, seen `exact` or, obfuscated, as the `decade` of a year;
- `initial`: [A]'s name begins with a letter;
- `rel`: [A] PHRASE [B], seen `exact`, with years as decades (`decade`), or only as "is
  connected with" (`generic`).

A walk of `hops` relations from a long-tail answer entity back to an anchor gives the first
question: the anchor named, one `rel` clue per hop, each hop's sentence the evidence. The
answer is unique when exactly one entity fits the asked variable over all assignments of
distinct entities that satisfy every clue (a small constraint search over the graph); each
operator's result is kept only if it still is, so every question has a closed evidence chain.

Operators (each returns candidate rewrites, the evolution keeps the first that stays unique):
- `indirect`: a named entity becomes a variable described by its attributes;
- `obfuscate`: a year becomes its decade, a relation phrase becomes "is connected with", a
  name becomes its initial;
- `remove`: one attribute clue is dropped (long to short).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace

from kiln.services.sandbox.environments.base import normalize_answer
from .search_graph import KnowledgeGraph

_YEAR = re.compile(r"\b(1\d{3}|20\d{2})\b")
LETTERS = "ABCDEFGH"


def decade(text: str) -> str:
    return _YEAR.sub(lambda m: f"the {int(m.group(1)) // 10 * 10}s", text)


@dataclass(frozen=True)
class Clue:
    kind: str                  # name | attr | initial | rel
    var: str                   # the subject variable
    value: str = ""            # entity id (name), value (attr), letter (initial), phrase (rel)
    key: str = ""              # attribute key (attr)
    object: str = ""           # object variable (rel)
    view: str = "exact"        # exact | decade | generic


@dataclass
class Question:
    clues: list[Clue]
    ask: str
    answer: str                # entity id
    evidence: list[dict]
    history: list[str] = field(default_factory=list)

    def variables(self) -> list[str]:
        seen = []
        for c in self.clues:
            for v in (c.var, c.object):
                if v and v not in seen:
                    seen.append(v)
        return seen


# -- walks ------------------------------------------------------------------------------
def long_tail(kg: KnowledgeGraph) -> list[str]:
    """Entities with at least one relation, without the most mentioned quarter (head
    entities a model knows by heart)."""
    linked = sorted({e for r in kg.relations for e in (r.subject, r.object)},
                    key=lambda e: (kg.entities[e].frequency, e))
    return linked[:max(1, (len(linked) * 3 + 3) // 4)] if linked else []


def walk(kg: KnowledgeGraph, answer: str, hops: int, rng: random.Random) -> Question | None:
    """A random simple path of `hops` relations ending at `answer` (depth first, so a dead
    end tries the next branch), as the first question; None when there is no such path."""
    def extend(path: list[str], relations: list) -> list | None:
        if len(relations) == hops:
            return relations
        options = [r for r in kg.edges(path[-1])
                   if (r.object if r.subject == path[-1] else r.subject) not in path]
        rng.shuffle(options)
        for r in options:
            nxt = r.object if r.subject == path[-1] else r.subject
            found = extend(path + [nxt], relations + [r])
            if found:
                return found
        return None

    relations = extend([answer], [])
    if relations is None:
        return None
    path = [answer]
    for r in relations:
        path.append(r.object if r.subject == path[-1] else r.subject)
    names = {eid: LETTERS[i] for i, eid in enumerate(reversed(path))}  # anchor is [A]
    clues = [Clue("name", names[path[-1]], path[-1])]
    clues += [Clue("rel", names[r.subject], r.phrase, object=names[r.object])
              for r in reversed(relations)]
    evidence = [{"doc": r.doc, "sentence": r.sentence} for r in reversed(relations)]
    return Question(clues, names[answer], answer, evidence)


def well_posed(q: Question) -> bool:
    """Every variable is said something of beyond "is connected with": a variable with no
    other clue would make its sentences empty words."""
    said = {c.var for c in q.clues if not (c.kind == "rel" and c.view == "generic")}
    said |= {c.object for c in q.clues if c.kind == "rel" and c.view != "generic"}
    return all(v in said for v in q.variables())


# -- uniqueness -------------------------------------------------------------------------
def _attr_fits(kg: KnowledgeGraph, eid: str, clue: Clue) -> bool:
    entity = kg.entities[eid]
    if clue.kind == "name":
        return eid == clue.value
    if clue.kind == "initial":
        return entity.name[:1].upper() == clue.value
    have = entity.attributes.get(clue.key)
    if have is None:
        return False
    if clue.view == "decade":
        return decade(have) == decade(clue.value)
    return normalize_answer(have) == normalize_answer(clue.value)


def _rel_fits(kg: KnowledgeGraph, clue: Clue, s: str, o: str) -> bool:
    for r in kg.between(s, o):
        if clue.view == "generic":
            if {r.subject, r.object} == {s, o}:
                return True
        elif r.subject == s and r.object == o:
            mine, theirs = (decade(clue.value), decade(r.phrase)) if clue.view == "decade" \
                else (clue.value, r.phrase)
            if normalize_answer(mine) == normalize_answer(theirs):
                return True
    return False


def answers(kg: KnowledgeGraph, q: Question, limit: int = 2) -> set[str]:
    """Entities the asked variable can be, up to `limit` of them (2 is enough to say "not
    unique")."""
    variables = q.variables()
    domains = {v: [e for e in kg.entities
                   if all(_attr_fits(kg, e, c) for c in q.clues if c.var == v and c.kind != "rel")]
               for v in variables}
    rels = [c for c in q.clues if c.kind == "rel"]
    found: set[str] = set()

    def search(assigned: dict[str, str]) -> None:
        if len(found) >= limit:
            return
        if len(assigned) == len(variables):
            found.add(assigned[q.ask])
            return
        var = min((v for v in variables if v not in assigned), key=lambda v: len(domains[v]))
        candidates = domains[var]
        for c in rels:  # only neighbours of an assigned, related variable can fit
            other = c.object if c.var == var else c.var if c.object == var else None
            if other in assigned:
                near = kg.neighbours(assigned[other])
                candidates = [e for e in candidates if e in near]
        for e in candidates:
            if e in assigned.values():
                continue
            trial = {**assigned, var: e}
            if all(_rel_fits(kg, c, trial[c.var], trial[c.object]) for c in rels
                   if c.var in trial and c.object in trial):
                search(trial)

    search({})
    return found


def unique(kg: KnowledgeGraph, q: Question) -> bool:
    return answers(kg, q) == {q.answer}


# -- operators --------------------------------------------------------------------------
def indirect(kg: KnowledgeGraph, q: Question) -> list[tuple[str, Question]]:
    out = []
    for c in q.clues:
        if c.kind != "name":
            continue
        attrs = kg.entities[c.value].attributes
        described = [Clue("attr", c.var, v, key=k) for k, v in sorted(attrs.items())]
        if described:
            rest = [x for x in q.clues if x is not c]
            out.append((f"indirect: {kg.entities[c.value].name} described by "
                        f"{', '.join(sorted(attrs))}",
                        replace(q, clues=described + rest, history=q.history)))
    return out


def obfuscate(kg: KnowledgeGraph, q: Question) -> list[tuple[str, Question]]:
    out = []
    for i, c in enumerate(q.clues):
        options = []
        if c.view == "exact" and c.kind in ("attr", "rel") and _YEAR.search(c.value):
            options.append(("year as decade", replace(c, view="decade")))
        if c.kind == "rel" and c.view != "generic":
            options.append(("relation as 'is connected with'", replace(c, view="generic")))
        if c.kind == "name":
            options.append(("name as initial",
                            Clue("initial", c.var, kg.entities[c.value].name[:1].upper())))
        for what, new in options:
            clues = q.clues[:i] + [new] + q.clues[i + 1:]
            out.append((f"obfuscate: {what} ([{c.var}])", replace(q, clues=clues)))
    return out


def remove(kg: KnowledgeGraph, q: Question) -> list[tuple[str, Question]]:
    return [(f"remove: [{c.var}]'s {c.key or c.kind}",
             replace(q, clues=[x for x in q.clues if x is not c]))
            for c in q.clues if c.kind in ("attr", "initial")]


OPERATORS = {"indirect": indirect, "obfuscate": obfuscate, "remove": remove}


def evolve(kg: KnowledgeGraph, q: Question, steps: int, rng: random.Random,
           operators: tuple[str, ...] = ("indirect", "obfuscate", "remove")) -> Question:
    """Up to `steps` rewrites, each by the first operator (in a shuffled order) with a
    candidate that keeps the answer unique."""
    for _ in range(steps):
        order = list(operators)
        rng.shuffle(order)
        for name in order:
            done = False
            for what, cand in OPERATORS[name](kg, q):
                if well_posed(cand) and unique(kg, cand):
                    q = replace(cand, history=q.history + [what])
                    done = True
                    break
            if done:
                break
        else:
            break
    return q


# -- text -------------------------------------------------------------------------------
def render(kg: KnowledgeGraph, q: Question) -> str:
    named = {c.var: kg.entities[c.value].name for c in q.clues if c.kind == "name"}

    def term(var: str) -> str:
        return named.get(var, f"[{var}]")

    sentences = []
    for c in q.clues:
        if c.kind == "name":
            continue
        if c.kind == "initial":
            sentences.append(f"{term(c.var)}'s name begins with '{c.value}'.")
        elif c.kind == "attr":
            value = decade(c.value) if c.view == "decade" else c.value
            templates = {"type": "{x} is a {v}.", "born": "{x} was born in {v}.",
                         "died": "{x} died in {v}.", "founded": "{x} was founded in {v}."}
            sentences.append(templates.get(c.key, "{x}'s {k} is {v}.").format(
                x=term(c.var), v=value, k=c.key))
        elif c.view == "generic":
            sentences.append(f"{term(c.var)} is connected with {term(c.object)}.")
        else:
            phrase = decade(c.value) if c.view == "decade" else c.value
            sentences.append(f"{term(c.var)} {phrase} {term(c.object)}.")
    sentences.append(f"Who or what is {term(q.ask)}? Answer with the name.")
    return " ".join(s[0].upper() + s[1:] for s in sentences)
