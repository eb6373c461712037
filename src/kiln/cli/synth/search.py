"""`kiln synth search`: multi-hop search questions from a document corpus.

    kiln synth search --corpus DIR [--questions N] [--hops 2,3] [--evolve-steps 3]
                      [--one-search-k 1] [--seed 0] [--max-tasks N] --out DIR

1. A knowledge graph is read from the corpus by rules (`search_graph.py`: entities with
   aliases, normalised and aligned; attributes; relations with their evidence sentences).
2. Each attempt samples a long-tail answer entity and walks `hops` relations back to an anchor
   (`search_questions.py`); the walk is the question's evidence chain.
3. unique answer: exactly one entity fits the question's clues in the graph;
4. evolution: up to `--evolve-steps` query-evolution rewrites (indirect description,
   obfuscation, clue removal), each kept only if the answer stays unique;
5. needs search: the answer (any alias) is not in the question itself;
6. needs more than one search: no document among the top `--one-search-k` BM25 hits for the
   question contains the answer (one search with the question would answer it);
7. distinct: not a near-duplicate (MinHash) of a kept question;
8. verified: Kiln's search environment grades the answer 1 and no answer 0.

Out: `OUT/tasks.jsonl` (search tasks over `OUT/corpus/`, a copy of the corpus),
`OUT/solutions/<id>.txt`, `OUT/evidence.jsonl` (each kept question's clues, evidence chain and
evolution history), the report. Attempts are seeded (`--seed`, then the attempt's number), so a
re-run into the same folder skips the attempts already decided and continues the same sequence.

Not built: the model-driven exploration (a model walking the corpus with the search and open
tools from seed entities, its chain turned into the first question); the graph here is read by
rules, which suits corpora whose pages name their subject in the title.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
from pathlib import Path

from kiln.cli.exits import Exit

from .filters import near_duplicates
from .ledger import Ledger
from .report import Report
from .swe import write_json_line

STEPS = ["attempts", "walked", "unique answer", "needs search", "needs more than one search",
         "distinct", "verified", "kept"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, type=Path,
                   help="folder of documents (.txt, .md, .html), one page per entity")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--questions", type=int, default=200, help="walks to attempt")
    p.add_argument("--hops", default="2,3", help="relations per walk, one picked per attempt")
    p.add_argument("--evolve-steps", type=int, default=3, help="query-evolution rewrites")
    p.add_argument("--one-search-k", type=int, default=1,
                   help="a question is answerable with one search when one of the top K hits "
                        "for it contains the answer")
    p.add_argument("--seed", type=int, default=0, help="seed of the walks")
    p.add_argument("--max-tasks", type=int, default=None, help="stop after this many kept")


def run(args: argparse.Namespace) -> int:
    try:
        hops = [int(h) for h in args.hops.split(",")]
        if not hops or min(hops) < 1 or args.questions < 1 or args.one_search_k < 1:
            raise ValueError
    except ValueError:
        print("kiln synth search: --hops takes positive integers (e.g. 2,3); --questions and "
              "--one-search-k must be at least 1", file=sys.stderr)
        return Exit.REFUSED
    if not args.corpus.is_dir():
        print(f"kiln synth search: --corpus {args.corpus}: not a folder", file=sys.stderr)
        return Exit.REFUSED
    summary = asyncio.run(SearchPipeline(args, hops).run())
    f = summary["funnel"]
    print(f"kiln synth search: {f['kept']} questions kept of {f['attempts']} attempts in "
          f"{summary['wall_seconds']:.0f} s -> {args.out}/tasks.jsonl")
    return 0


class SearchPipeline:
    def __init__(self, args, hops: list[int]):
        from .search_graph import KnowledgeGraph
        self.args, self.hops = args, hops
        self.out = Path(args.out)
        self.report = Report(self.out, "search", STEPS)
        self.ledger = Ledger(self.out, self.report)
        corpus = self.out / "corpus"
        if not corpus.exists():
            shutil.copytree(args.corpus, corpus)
        self.kg = KnowledgeGraph.from_folder(corpus)
        kg = self.kg
        self.report.extra.update({
            "documents": len(kg.index.docs), "entities": len(kg.entities),
            "aligned_documents": len(kg.index.docs) - len(kg.entities),
            "attributes": sum(len(e.attributes) for e in kg.entities.values()),
            "relations": len(kg.relations), "operators": {}})
        self.kept_texts: list[str] = []

    async def run(self) -> dict:
        from .search_questions import long_tail
        (self.out / "solutions").mkdir(parents=True, exist_ok=True)
        tail = long_tail(self.kg)
        self.report.extra["long_tail_entities"] = len(tail)
        kept = 0
        for i in range(self.args.questions):
            self.report.progress("walk+filter", i, self.args.questions)
            if self.args.max_tasks is not None and kept >= self.args.max_tasks:
                break
            item = f"q{self.args.seed}-{i:05d}"
            if item in self.ledger:
                rec = self.ledger.replay(item)
                if rec["verdict"] == "kept":
                    kept += 1
                    self.kept_texts.append(rec["text"])
                continue
            self.report.count("attempts")
            if tail:
                kept += await self._attempt(item, random.Random(f"{self.args.seed}:{i}"), tail)
            else:
                self.ledger.rejected(item, "walked", "the graph has no relation", ["attempts"])
        self.report.progress("walk+filter", self.args.questions, self.args.questions)
        return self.report.write()

    def _reject(self, item: str, step: str, reason: str) -> int:
        reached = STEPS[:STEPS.index(step)]
        for s in reached[1:]:
            self.report.count(s)
        self.ledger.rejected(item, step, reason, reached)
        return 0

    async def _attempt(self, item: str, rng: random.Random, tail: list[str]) -> int:
        from kiln.services.sandbox.environments.base import normalize_answer
        from .search_questions import evolve, render, unique, walk
        kg = self.kg
        answer, hops = rng.choice(tail), rng.choice(self.hops)
        q = walk(kg, answer, hops, rng)
        if q is None:
            return self._reject(item, "walked", f"no simple path of {hops} relations: none "
                                                f"ends at {kg.entities[answer].name}")
        if not unique(kg, q):
            return self._reject(item, "unique answer",
                                f"more than one entity fits: {render(kg, q)}"[:500])
        q = evolve(kg, q, self.args.evolve_steps, rng)
        text = render(kg, q)
        aliases = sorted(kg.entities[answer].aliases)
        norm_q = " " + normalize_answer(text) + " "
        if any(" " + normalize_answer(a) + " " in norm_q for a in aliases):
            return self._reject(item, "needs search", f"the question names its answer: {text}")
        for hit in kg.index.search(text, self.args.one_search_k):
            doc = " " + normalize_answer(kg.index.docs[hit.id].text) + " "
            if any(" " + normalize_answer(a) + " " in doc for a in aliases):
                return self._reject(item, "needs more than one search",
                                    f"one BM25 search answers it: the hit {hit.id} "
                                    f"holds the answer")
        if len(self.kept_texts) in near_duplicates(self.kept_texts + [text]):
            return self._reject(item, "distinct", "a near-duplicate of a kept question")
        record = {"id": item, "type": "search", "question": text,
                  "answer": aliases if len(aliases) > 1 else aliases[0], "corpus": "corpus"}
        name = kg.entities[answer].name
        why = await self._verify(record, name)
        if why:
            return self._reject(item, "verified", why)
        (self.out / "solutions" / f"{item}.txt").write_text(name + "\n")
        write_json_line(self.out / "evidence.jsonl", {
            "id": item, "answer": name, "anchor_hops": hops, "evidence": q.evidence,
            "clues": [c.__dict__ for c in q.clues], "evolution": q.history})
        write_json_line(self.out / "tasks.jsonl", record)
        for step in STEPS[1:]:
            self.report.count(step)
        ops = self.report.extra["operators"]
        for h in q.history:
            ops[h.split(":")[0]] = ops.get(h.split(":")[0], 0) + 1
        self.kept_texts.append(text)
        self.ledger.kept(item, STEPS, text=text)
        return 1

    async def _verify(self, record: dict, name: str) -> str | None:
        """Grade the answer and no answer with the search environment itself."""
        from kiln.services.sandbox.environments.tasks import make_environment, parse_task
        task = parse_task(record, f"question {record['id']}")
        env = make_environment("search", self.out.resolve())
        await env.setup(None, task)
        gold = await env.grade(None, task, await env.apply_solution(None, task, name.encode()))
        if gold.reward != 1.0:
            return f"the answer scores {gold.reward:g}: {gold.output}"
        null = await env.grade(None, task, None)
        if null.reward == 1.0:
            return "no answer scores 1"
        return None
