"""`kiln synth search`: the knowledge graph read from a corpus, the uniqueness check, each
filter and query-evolution operator, and the pipeline end to end through the CLI (its tasks
graded by the search environment and `kiln sandbox verify`)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kiln.cli.synth import search_questions as sq
from kiln.cli.synth.search_graph import KnowledgeGraph
from kiln.services.sandbox.environments.base import normalize_answer
from kiln.services.sandbox.environments.bm25 import BM25Index

from helpers.synth import kiln

RIVERS = ["Seln", "Wiss", "Orla", "Brem"]
TOWNS = ["Keldor", "Amsel", "Tirn", "Voss", "Harrow", "Ulm"]
PEOPLE = [("Ilse Marrow", 1870, 1944), ("Otto Brandt", 1852, 1921), ("Mira Holt", 1881, 1960),
          ("Jan Veld", 1866, 1930)]
OBSERVATORIES = ["Varna Observatory", "Kessel Observatory", "Lind Observatory",
                 "Rook Observatory"]


def write_corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, river in enumerate(RIVERS):
        (root / f"river-{i}.txt").write_text(
            f"{river} (river)\n\nThe {river} is a river of the northern plain. It rises in "
            f"hill country number {i} and ends in a lake.\nLength: {100 + 20 * i} km\n")
    for i, town in enumerate(TOWNS):
        river = RIVERS[i % len(RIVERS)]
        (root / f"town-{i}.md").write_text(
            f"# {town}\n\n{town} is a market town in valley {i}. The river {river} flows "
            f"through {town} on its way north. The town is known for craft number {i}.\n")
    for i, (obs, (person, _, _)) in enumerate(zip(OBSERVATORIES, PEOPLE)):
        (root / f"obs-{i}.html").write_text(
            f"<html><head><title>{obs}</title><script>var a = 1;</script></head><body>"
            f"<p>The {obs} is an observatory on the hill above {TOWNS[i]}.</p><p>It was founded "
            f"in {1900 + 7 * i} by the astronomer {person}.</p></body></html>")
    for person, born, died in PEOPLE:
        slug = person.split()[-1].lower()
        (root / f"person-{slug}.txt").write_text(
            f"{person}\n\n{person} ({born}-{died}) was an astronomer who catalogued variable "
            f"stars. She later taught at a university in the south.\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("search") / "corpus")


@pytest.fixture(scope="module")
def kg(corpus) -> KnowledgeGraph:
    return KnowledgeGraph.from_folder(corpus)


def test_graph_entities_attributes_relations(kg, tmp_path):
    assert len(kg.entities) == 4 + 6 + 4 + 4
    seln = kg.entities["seln"]
    assert {"Seln", "Seln (river)"} <= seln.aliases
    assert seln.attributes["type"] == "river" and seln.attributes["length"] == "100 km"
    assert kg.entities["ilse marrow"].attributes.items() >= {
        "born": "1870", "died": "1944", "type": "astronomer"}.items()
    assert kg.entities["varna observatory"].attributes["founded"] == "1900"
    rels = {(r.subject, r.phrase, r.object) for r in kg.relations}
    assert ("seln", "flows through", "keldor") in rels
    # "It was founded ..." opens with a pronoun: its subject is the page's entity.
    assert ("varna observatory", "was founded in 1900 by the astronomer", "ilse marrow") in rels
    assert kg.entities["keldor"].frequency == 1  # named on the observatory's page
    # Alignment: a second page about the same thing joins the first entity.
    extra = write_corpus(tmp_path / "c")
    (extra / "seln-again.txt").write_text("The Seln\n\nFounded: 1201\n")
    merged = KnowledgeGraph.from_folder(extra)
    assert len(merged.entities) == len(kg.entities)
    assert merged.entities["seln"].docs == ["river-0.txt", "seln-again.txt"]
    assert merged.entities["seln"].attributes["founded"] == "1201"


def test_uniqueness_counts_every_fitting_entity(kg):
    flows = sq.Clue("rel", "A", "flows through", object="B")
    open_q = sq.Question([flows], "B", "keldor", [])
    assert len(sq.answers(kg, open_q, limit=10)) == 6  # every town has a river
    anchored = sq.Question([sq.Clue("name", "A", "seln"), flows], "B", "keldor", [])
    assert sq.answers(kg, anchored, limit=10) == {"keldor", "harrow"}  # Seln flows through two
    assert not sq.unique(kg, anchored)
    tirn = sq.Question([sq.Clue("name", "A", "orla"), flows], "B", "tirn", [])
    assert sq.unique(kg, tirn)


def test_walks_are_unique_chains_and_evolution_keeps_them_unique(kg):
    made = 0
    for seed in range(40):
        rng = random.Random(seed)
        q = sq.walk(kg, rng.choice(sq.long_tail(kg)), 2, rng)
        if q is None or not sq.unique(kg, q):
            continue
        made += 1
        assert len(q.evidence) == 2 and q.clues[0].kind == "name"
        evolved = sq.evolve(kg, q, 3, rng)
        assert sq.unique(kg, evolved) and sq.well_posed(evolved)
        assert len(evolved.history) >= 1
    assert made >= 10


def test_operators(kg):
    q = sq.Question([sq.Clue("name", "A", "ilse marrow"),
                     sq.Clue("rel", "B", "was founded in 1900 by the astronomer", object="A")],
                    "B", "varna observatory", [])
    (what, ind), = sq.indirect(kg, q)
    assert what.startswith("indirect: Ilse Marrow")
    assert {c.key for c in ind.clues if c.kind == "attr"} == {"born", "died", "type"}
    assert "Ilse" not in sq.render(kg, ind)
    texts = {w: sq.render(kg, c) for w, c in sq.obfuscate(kg, q)}
    assert any("founded in the 1900s" in t for t in texts.values())
    assert any("[B] is connected with Ilse Marrow" in t for t in texts.values())
    assert any("name begins with 'I'" in t for t in texts.values())
    shorter = sq.remove(kg, ind)
    assert len(shorter) == 3 and all(len(c.clues) == len(ind.clues) - 1 for _, c in shorter)
    # Obfuscating the only relation of an unnamed variable leaves it said nothing of.
    vague = sq.Question([sq.Clue("rel", "B", "x", object="A", view="generic")], "B", "x", [])
    assert not sq.well_posed(vague)


def test_search_pipeline_end_to_end(corpus, tmp_path):
    out = tmp_path / "out"
    res = kiln("synth", "search", "--corpus", str(corpus), "--questions", "60", "--out", str(out))
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "report.json").read_text())
    f = report["funnel"]
    assert f["attempts"] == 60 and f["kept"] >= 3, report
    # Both search filters dropped something on this corpus, and said why.
    assert f["needs more than one search"] < f["needs search"]
    reasons = [json.loads(x) for x in (out / "rejections.jsonl").read_text().splitlines()]
    assert any(r["step"] == "needs more than one search" for r in reasons)
    assert report["entities"] == 18 and report["relations"] >= 14

    tasks = [json.loads(x) for x in (out / "tasks.jsonl").read_text().splitlines()]
    evidence = {e["id"]: e for e in map(json.loads,
                                        (out / "evidence.jsonl").read_text().splitlines())}
    index = BM25Index.from_folder(out / "corpus")
    for task in tasks:
        aliases = task["answer"] if isinstance(task["answer"], list) else [task["answer"]]
        norm = [normalize_answer(a) for a in aliases]
        assert not any(a in normalize_answer(task["question"]) for a in norm)
        top = index.search(task["question"], 1)
        assert not top or not any(a in normalize_answer(index.docs[top[0].id].text) for a in norm)
        chain = evidence[task["id"]]["evidence"]
        assert len(chain) >= 2 and all((out / "corpus" / e["doc"]).is_file() for e in chain)
    verify = kiln("sandbox", "verify", str(out / "tasks.jsonl"), "--solutions",
                  str(out / "solutions"), "--null-fails")
    assert verify.returncode == 0, verify.stdout + verify.stderr

    again = kiln("synth", "search", "--corpus", str(corpus), "--questions", "60", "--out",
                 str(out))
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "report.json").read_text())["funnel"] == f
    assert len((out / "tasks.jsonl").read_text().splitlines()) == len(tasks)


def test_search_bad_arguments(tmp_path):
    res = kiln("synth", "search", "--corpus", str(tmp_path / "none"), "--out", str(tmp_path))
    assert res.returncode == 1 and "--corpus" in res.stderr and "not a folder" in res.stderr
    res = kiln("synth", "search", "--corpus", str(tmp_path), "--hops", "two", "--out",
               str(tmp_path / "o"))
    assert res.returncode == 1 and "--hops" in res.stderr
