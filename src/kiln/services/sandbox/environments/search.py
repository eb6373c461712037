"""Search tasks: answer a question by searching a local document folder.

Task record:

    {"id": "capital-q1", "type": "search",
     "question": "Which river flows through the city that hosts the Kiln observatory?",
     "answer": ["Danube", "the Danube river"],    # one string or a list of accepted aliases
     "corpus": "corpora/geo"}                      # folder of .txt/.md/.html, relative to the file

Tools, served by the sandbox service from a BM25 index of the corpus (rollout reaches them over
gRPC like any tool): `search` (ranked hits with id, title and snippet) and `open` (a document's
text). The episode ends with the reply that calls no tool: its text is the answer (or with
`answer.txt` in the workspace, for `kiln sandbox verify`). Reward: token F1 of the normalised
answer (case, punctuation, articles, spacing, number format) against the best alias, so an exact
match scores 1; parts `exact` (0/1) and `f1`. Reference solution: `{id}.txt`, the answer.

Not covered: live web search.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field

from kiln.env import Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec, string_tool
from .base import Environment, Task, normalize_answer, token_f1, unknown_tool
from .bm25 import BM25Index, Hit

SEARCH = ToolSpec("search", "Search the documents; returns the best hits (id, title, snippet).", {
    "type": "object", "properties": {
        "query": {"type": "string", "description": "words to look for"},
        "k": {"type": "integer", "description": "how many hits (default 5, at most 20)"}},
    "required": ["query"]})
OPEN = string_tool("open", "Read one document by the id a search returned.", doc_id="document id")
TOOLS = [SEARCH, OPEN]


class SearchTask(Task):
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
    needs_sandbox = False

    def index(self, task: SearchTask) -> BM25Index:
        return _index(str(self.resolve(task.corpus)))

    def search(self, task: SearchTask, query: str, k: int = 5) -> list[Hit]:
        return self.index(task).search(query, k)

    def open(self, task: SearchTask, doc_id: str) -> str:
        return self.index(task).open(doc_id)

    def system_prompt(self, task: SearchTask) -> str:
        return ("Answer the question using the search and open tools over the documents. When "
                "you know the answer, reply with the answer alone.")

    def user_prompt(self, task: SearchTask) -> str:
        return task.question

    def tools(self, task: SearchTask) -> list[ToolSpec]:
        return TOOLS

    async def setup(self, sandbox: SandboxHandle | None, task: SearchTask) -> None:
        self.index(task)  # fail early on a missing corpus, and warm the cache

    async def call_tool(self, sandbox: SandboxHandle | None, task: SearchTask,
                        call: ToolCall) -> ToolResult:
        if call.name == "search":
            query, k = call.arguments.get("query"), call.arguments.get("k", 5)
            if not isinstance(query, str) or not isinstance(k, int) or isinstance(k, bool):
                return ToolResult("error: search needs a string `query` and an integer `k`")
            hits = self.search(task, query, max(1, min(k, 20)))
            if not hits:
                return ToolResult("no documents match")
            return ToolResult("\n".join(f"[{h.id}] {h.title}: {h.snippet}" for h in hits))
        if call.name == "open":
            doc_id = call.arguments.get("doc_id")
            if not isinstance(doc_id, str):
                return ToolResult("error: open needs a string argument `doc_id`")
            try:
                return ToolResult(self.open(task, doc_id))
            except KeyError:
                return ToolResult(f"error: no document {doc_id!r}")
        return unknown_tool(call, TOOLS)

    async def grade(self, sandbox: SandboxHandle | None, task: SearchTask,
                    answer: str | None = None) -> Grade:
        if answer is None and sandbox is not None:
            try:
                answer = (await sandbox.read_file("answer.txt", 64 << 10)).decode("utf-8", "replace")
            except FileNotFoundError:
                pass
        if answer is None or not answer.strip():
            return Grade(0.0, parts={"exact": 0.0, "f1": 0.0}, output="no answer given",
                         flags=["no_answer"])
        got = normalize_answer(answer)
        exact = any(got == normalize_answer(a) for a in task.aliases())
        f1 = 1.0 if exact else max(token_f1(answer, a) for a in task.aliases())
        return Grade(f1, parts={"exact": float(exact), "f1": f1},
                     output=f"answer {got!r}; accepted {[normalize_answer(a) for a in task.aliases()]}")

    async def apply_solution(self, sandbox: SandboxHandle, task: SearchTask, solution: bytes
                             ) -> str | None:
        return solution.decode("utf-8").strip()
