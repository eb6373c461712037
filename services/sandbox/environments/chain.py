"""The quickstart's task environment, `chain`: several dependent calculator calls, then an answer.

A task is a start value and a list of steps (`*17`, `-408`, `+95`, ...). The agent must apply
the steps in order by calling a sandboxed calculator, copying each observation into the next
call, and finally answer the last result. The answer is verifiable (reward 0/1).

The text protocol (every tag is one special token of the quickstart tokenizer):

    <task>37 *48 -15 +203 *3</task>                 prompt (not trained on)
    <call>calc 37*48</call>                         action (trained on)
    <obs>1776</obs>                                 observation appended by the environment
    <call>calc 1776-15</call>
    <obs>1761</obs>
    ...
    <answer>5892</answer>                           final action; the episode ends

An action may start with `<think>...</think>` (free text, ignored by the parser). Generation of
an action stops at `</call>` or `</answer>` (`STOP_TAGS`). Anything that is neither one well-formed
call nor one well-formed answer is `Invalid` and ends the episode with reward 0.

`scripted_solver` writes expert trajectories for SFT. It is deliberately imperfect in ONE
systematic way: whenever it copies an observation that ends in the digit 0 (into the next call
or into the answer) it drops that final 0 (`1760` is copied as `176`), with probability
`mistake_rate` (default 1.0: always). It never errs otherwise, except for optional random digit
slips (`slip_rate`, default 0). Imitation learns the mistake as a rule; a 0/1 reward lets RL
unlearn it. About a third of tasks (4 steps) hit the mistake at least once.

Not covered: running the tool in a sandbox (the sandbox service runs `tool_command`'s argv),
the agent loop (rollout service), tokenizers and models (benchmarks/quickstart/trial.py).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field, model_validator

from .base import TaskBase

#: Special tokens of the protocol; a tokenizer must keep each one a single token.
SPECIAL_TOKENS = (
    "<pad>", "<task>", "</task>", "<think>", "</think>",
    "<call>", "</call>", "<obs>", "</obs>", "<answer>", "</answer>",
)
#: Generation of one action stops after either of these.
STOP_TAGS = ("</call>", "</answer>")
#: Episodes end (reward 0) after this many actions without an answer.
MAX_ACTIONS = 8
#: Longest expression the calculator accepts (keeps results small and evaluation instant).
MAX_EXPR_CHARS = 64
#: Values every intermediate result stays within (so observations are at most 5 digits).
VALUE_RANGE = (1, 99_999)
OPS = ("+", "-", "*")

Split = Literal["train", "heldout"]
#: One task in this many is held out; membership is a hash of the task's content, so no seed
#: can produce a training task that is also a held-out task.
HELDOUT_EVERY = 5


# ----------------------------------------------------------------------------- tasks


class ChainTask(TaskBase):
    """One task record (a JSONL line of a chain TaskSet)."""

    prompt: str
    """The prompt text, `<task>START STEP STEP ...</task>`."""
    start: int = Field(ge=VALUE_RANGE[0], le=VALUE_RANGE[1])
    steps: list[str] = Field(min_length=1)
    """Each an operator and a positive operand, e.g. `*17`, `-408`."""
    answer: int
    """The value after applying every step to `start`."""

    @model_validator(mode="after")
    def _consistent(self) -> "ChainTask":
        for step in self.steps:
            if not re.fullmatch(r"[+\-*][1-9][0-9]{0,3}", step):
                raise ValueError(f"steps: {step!r} is not an operator and a positive operand")
        if self.prompt != render_prompt(self.start, self.steps):
            raise ValueError(f"prompt: {self.prompt!r} does not match start and steps")
        if self.answer != chain_values(self.start, self.steps)[-1]:
            raise ValueError(f"answer: {self.answer} is not the result of the steps")
        return self


def render_prompt(start: int, steps: list[str]) -> str:
    return "<task>" + " ".join([str(start), *steps]) + "</task>"


def apply_step(value: int, step: str) -> int:
    op, operand = step[0], int(step[1:])
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    return value * operand


def chain_values(start: int, steps: list[str]) -> list[int]:
    """Every intermediate result, last one the answer."""
    values = []
    value = start
    for step in steps:
        value = apply_step(value, step)
        values.append(value)
    return values


def _random_step(rng: random.Random, value: int) -> str:
    lo, hi = VALUE_RANGE
    while True:
        op = rng.choice(OPS)
        operand = rng.randint(2, 19) if op == "*" else rng.randint(1, 999)
        if lo <= apply_step(value, f"{op}{operand}") <= hi:
            return f"{op}{operand}"


def _content_hash(start: int, steps: list[str]) -> int:
    digest = hashlib.sha256(" ".join([str(start), *steps]).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def task_split(start: int, steps: list[str]) -> Split:
    return "heldout" if _content_hash(start, steps) % HELDOUT_EVERY == 0 else "train"


def generate_tasks(count: int, seed: int, *, split: Split = "train", num_steps: int = 4
                   ) -> list[ChainTask]:
    """`count` distinct tasks of `split`, the same for the same arguments. Train and held-out
    tasks never coincide (whatever the seeds); different seeds give different streams."""
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split: must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"chain/{seed}/{num_steps}")
    seen: set[tuple[int, tuple[str, ...]]] = set()
    tasks: list[ChainTask] = []
    while len(tasks) < count:
        start = rng.randint(10, 999)
        steps: list[str] = []
        value = start
        for _ in range(num_steps):
            steps.append(_random_step(rng, value))
            value = apply_step(value, steps[-1])
        key = (start, tuple(steps))
        if key in seen or task_split(start, steps) != split:
            continue
        seen.add(key)
        tasks.append(ChainTask(
            id=f"chain-{split}-{seed}-{len(tasks)}", prompt=render_prompt(start, steps),
            start=start, steps=steps, answer=value,
        ))
    return tasks


def write_tasks(path: str | Path, tasks: Iterable[ChainTask]) -> None:
    with open(path, "w", encoding="ascii") as f:
        for task in tasks:
            f.write(task.model_dump_json() + "\n")


def read_tasks(path: str | Path) -> list[ChainTask]:
    tasks = []
    with open(path, encoding="ascii") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tasks.append(ChainTask.model_validate_json(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a chain task: {exc}") from exc
    return tasks


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Call:
    expr: str


@dataclass(frozen=True)
class Answer:
    value: str


@dataclass(frozen=True)
class Invalid:
    reason: str


_THINK = r"(?:<think>[^<]*</think>)?"
_CALL_RE = re.compile(_THINK + r"<call>calc ([0-9+\-*/%% ()]{1,%d})</call>" % MAX_EXPR_CHARS)
_ANSWER_RE = re.compile(_THINK + r"<answer>([^<]{0,32})</answer>")


def parse_action(text: str) -> Call | Answer | Invalid:
    """One generated action (up to and including its stop tag) -> what the agent asked for."""
    text = text.strip()
    if m := _CALL_RE.fullmatch(text):
        return Call(m.group(1).strip())
    if m := _ANSWER_RE.fullmatch(text):
        return Answer(m.group(1).strip())
    return Invalid(f"not one <call>calc EXPR</call> or <answer>N</answer>: {text[:80]!r}")


# ----------------------------------------------------------------------------- the tool

#: The calculator, run as `python3 -c CALC_PROGRAM EXPR`. Integers, + - * // %, unary minus and
#: parentheses only; anything else (names, calls, powers) exits 1. The expression is an argv
#: element, never spliced into code or a shell line.
CALC_PROGRAM = r'''
import ast, sys

def calc(expr):
    if len(expr) > %d:
        raise ValueError("expression too long")
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add): return a + b
            if isinstance(node.op, ast.Sub): return a - b
            if isinstance(node.op, ast.Mult): return a * b
            if isinstance(node.op, ast.FloorDiv): return a // b
            if isinstance(node.op, ast.Mod): return a %% b
        raise ValueError("unsupported expression")
    return ev(ast.parse(expr, mode="eval").body)

if __name__ == "__main__":
    try:
        print(calc(sys.argv[1]))
    except Exception as exc:
        print("error: %%s" %% exc, file=sys.stderr)
        sys.exit(1)
''' % MAX_EXPR_CHARS

_calc_namespace: dict = {"__name__": "chain_calc"}
exec(compile(CALC_PROGRAM, "<chain calc>", "exec"), _calc_namespace)


def evaluate_expression(expr: str) -> int:
    """The calculator in-process (same code as `tool_command` runs); raises ValueError,
    ZeroDivisionError or SyntaxError where the tool would exit 1."""
    return _calc_namespace["calc"](expr)


def tool_command(call: Call) -> list[str]:
    """The argv the sandbox runs to evaluate `call` (needs python3 in the image)."""
    return ["python3", "-c", CALC_PROGRAM, call.expr]


def format_observation(stdout: str, exit_code: int) -> str:
    """The tool's result as the text appended to the context. Errors are one word, so a model
    cannot be fed arbitrary text through the observation."""
    value = stdout.strip()
    if exit_code == 0 and re.fullmatch(r"-?[0-9]{1,40}", value):
        return f"<obs>{value}</obs>"
    return "<obs>error</obs>"


def run_tool_locally(call: Call) -> str:
    """`format_observation` of the calculator run in-process (tests and the CPU trial)."""
    try:
        return format_observation(str(evaluate_expression(call.expr)), 0)
    except (ValueError, ZeroDivisionError, SyntaxError, RecursionError):
        return format_observation("", 1)


# ----------------------------------------------------------------------------- reward


def verify(task: ChainTask, final_answer: str | None) -> tuple[float, dict[str, float], str]:
    """(reward 0/1, parts, verifier output) for the text inside `<answer>` (None: the episode
    ended without an answer). The answer must be a decimal integer equal to `task.answer`."""
    if final_answer is None:
        return 0.0, {"answered": 0.0, "correct": 0.0}, "no answer"
    text = final_answer.strip()
    if not re.fullmatch(r"-?[0-9]{1,32}", text):
        return 0.0, {"answered": 1.0, "correct": 0.0}, f"not an integer: {text[:40]!r}"
    if int(text) != task.answer:
        return 0.0, {"answered": 1.0, "correct": 0.0}, f"answered {int(text)}, expected {task.answer}"
    return 1.0, {"answered": 1.0, "correct": 1.0}, "correct"


# ----------------------------------------------------------------------------- expert data


@dataclass(frozen=True)
class Turn:
    kind: Literal["action", "observation"]
    text: str


def triggers_mistake(observed: str) -> bool:
    """The solver's documented blind spot: a copied value whose last digit is 0."""
    return len(observed) > 1 and observed.endswith("0")


def _copy(observed: str, rng: random.Random, mistake_rate: float, slip_rate: float) -> str:
    if triggers_mistake(observed) and rng.random() < mistake_rate:
        return observed[:-1]
    if slip_rate and rng.random() < slip_rate:
        i = rng.randrange(len(observed))
        digits = [d for d in "0123456789" if d != observed[i] and not (i == 0 and d == "0")]
        return observed[:i] + rng.choice(digits) + observed[i + 1:]
    return observed


def scripted_solver(task: ChainTask, rng: random.Random, *, mistake_rate: float = 1.0,
                    slip_rate: float = 0.0) -> list[Turn]:
    """An expert trajectory: one call per step, each on the copied previous observation, then
    the answer. Observations are the calculator's real results for the calls made, so after a
    mistake the trajectory carries on from the wrong value (and ends with a wrong answer)."""
    turns: list[Turn] = []
    current = str(task.start)  # the prompt's start value is read, not copied from a tool
    for step in task.steps:
        call = Call(f"{current}{step}")
        turns.append(Turn("action", f"<call>calc {call.expr}</call>"))
        obs = run_tool_locally(call)
        turns.append(Turn("observation", obs))
        observed = obs[len("<obs>"):-len("</obs>")]
        current = _copy(observed, rng, mistake_rate, slip_rate)
    turns.append(Turn("action", f"<answer>{current}</answer>"))
    return turns


def render(task: ChainTask, turns: list[Turn]) -> list[tuple[str, bool]]:
    """The whole episode as (text, trained-on) segments: prompt and observations are not."""
    return [(task.prompt, False)] + [(t.text, t.kind == "action") for t in turns]


def final_answer(turns: list[Turn]) -> str | None:
    last = parse_action(turns[-1].text) if turns and turns[-1].kind == "action" else None
    return last.value if isinstance(last, Answer) else None


def corpus_for_tokenizer(count: int = 2000, seed: int = 0) -> list[str]:
    """Texts covering everything the protocol says (prompts, calls, observations, answers,
    errors), for training the quickstart tokenizer."""
    rng = random.Random(seed)
    texts = []
    for task in generate_tasks(count, seed=seed):
        texts.append("".join(t for t, _ in render(task, scripted_solver(task, rng))))
    texts += ["<obs>error</obs>", "<think>step</think>", "<call>calc (1+2)//3%4</call>"]
    return texts


def dump_trajectory(task: ChainTask, turns: list[Turn]) -> str:
    """One JSON line: the task id and the turns (for inspecting SFT data)."""
    return json.dumps({"task_id": task.id, "turns": [[t.kind, t.text] for t in turns]})
