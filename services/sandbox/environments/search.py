"""Search tasks: answer a question by searching a local document folder.

TaskSet record:

    {"id": "capital-q1", "type": "search",
     "question": "Which river flows through the city that hosts the Kiln observatory?",
     "answer": ["Danube", "the Danube river"],    # one string or a list of accepted aliases
     "corpus": "corpora/geo"}                      # folder of .txt/.md/.html, relative to the file

The agent has two tools, served by the sandbox service from a BM25 index of the corpus:
`search(query, k)` (ranked hits with title and snippet) and `open(doc_id)` (the document's
text). The reward is 1 when the final answer, normalised (case, punctuation, articles,
spacing, number format), equals a normalised alias. The answer is passed to `verify`, or read
from `answer.txt` in the workspace. Reference solution: `{id}.txt`, the answer.

Not covered: live web search; partial credit.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..interface import Sandbox
from .base import Environment, TaskBase, VerifyResult, normalize_answer
from .bm25 import BM25Index, Hit


class SearchTask(TaskBase):
    type: Literal["search"] = "search"
    question: str = Field(min_length=1)
    answer: str | list[str]
    corpus: str = Field(min_length=1)

    def aliases(self) -> list[str]:
        return [self.answer] if isinstance(self.answer, str) else list(self.answer)


@lru_cache(maxsize=32)
def _index(folder: str) -> BM25Index:
    return BM25Index.from_folder(Path(folder))


class SearchEnvironment(Environment):
    type = "search"
    task_model = SearchTask
    solution_name = "{id}.txt"

    def index(self, task: SearchTask) -> BM25Index:
        return _index(str(self.resolve(task.corpus)))

    def search(self, task: SearchTask, query: str, k: int = 5) -> list[Hit]:
        return self.index(task).search(query, k)

    def open(self, task: SearchTask, doc_id: str) -> str:
        return self.index(task).open(doc_id)

    async def setup(self, sandbox: Sandbox, task: SearchTask) -> None:
        self.index(task)  # fail early on a missing corpus, and warm the cache

    async def verify(self, sandbox: Sandbox, task: SearchTask, answer: str | None = None
                     ) -> VerifyResult:
        if answer is None:
            try:
                answer = (await sandbox.read_file("answer.txt", 64 << 10)).decode("utf-8",
                                                                                  "replace")
            except FileNotFoundError:
                return VerifyResult(0.0, parts={"exact": 0.0}, output="no answer given",
                                    flags=["no_answer"])
        got = normalize_answer(answer)
        ok = any(got == normalize_answer(a) for a in task.aliases())
        return VerifyResult(float(ok), parts={"exact": float(ok)},
                            output=f"answer {got!r}; accepted {[normalize_answer(a) for a in task.aliases()]}")

    async def apply_solution(self, sandbox: Sandbox, task: SearchTask, solution: bytes
                             ) -> str | None:
        return solution.decode("utf-8").strip()
