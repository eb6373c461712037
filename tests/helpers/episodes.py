"""Scripted policies that solve each example task set, as episodes of tool calls: the sandbox
service tests play them, and so does the environments benchmark."""
from __future__ import annotations

from pathlib import Path
from kiln.env import ToolCall
from kiln.episode import Action


REPO = Path(__file__).resolve().parents[2]


TASKS = REPO / "deploy" / "examples" / "tasks"


SOLUTIONS = TASKS / "solutions"


def call(name: str, **arguments) -> Action:
    return Action([ToolCall(name, arguments, f"c-{name}")])


def answer(text: str) -> Action:
    return Action(content=text)


SCRIPTED: dict[str, list[Action]] = {
    "count-words": [call("bash", command="wc -w < data/words.txt > count.txt"), call("submit")],
    "sort-unique": [call("read_file", path="names.txt"),
                    call("write_file", path="sorted.txt", content="alice\nbob\ncarol\n"),
                    call("submit")],
    "calc-divide-by-zero": [
        call("view", path="calc/ops.py"),
        call("str_replace", path="calc/ops.py", old="    return a / b",
             new="    if b == 0:\n        return None\n    return a / b"),
        call("submit")],
    "observatory-river": [call("search", query="observatory Ilse Marrow"),
                          call("open", doc_id="marrow.txt"), answer("Seln")],
    "seln-lake": [call("search", query="Seln river lake", k=3), answer("Lake Amber")],
    "sum-squares": [call("python", code="print(sum(i * i for i in range(1, 101)))"),
                    answer("338350")],
    "collatz-27": [call("python", code=(
        "n, s = 27, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    s += 1\nprint(s)")),
                   answer("111")],
    "fizz": [call("write_file", path="solution.py", content=(SOLUTIONS / "fizz.py").read_text()),
             call("python", code="from solution import fizz; print(fizz(3), fizz(4))"),
             call("submit")],
    "echo-hello": [call("bash", command="echo hello > out.txt"), call("submit")],
    "echo-kiln": [call("bash", command="echo kiln > name.txt"), call("submit")],
    "echo-agent": [call("bash", command="echo agent > who.txt"), call("submit")],
}
