"""Chain tasks: the record, procedural generation with a fixed train/held-out partition, and
JSONL files of them.

A task is a start value, a step (multiply, modulo, add: `*7%97+5`) and a count; its answer is
the value after applying the step that many times. Held-out membership is a hash of the task's
content, so no seed can make a training task that is also a held-out task.
"""
from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Callable, Iterable, Literal

from pydantic import Field, model_validator

from ..base import Task
from .calculator import evaluate_expression

#: The step every task repeats: multiply, reduce modulo, add (`*7%97+5`); Python's precedence
#: evaluates it left to right, so the call needs no parentheses and values stay below m + b.
STEP_RE = re.compile(r"\*([2-9])%([1-9][0-9]{1,2})\+([1-9][0-9]?)")

Split = Literal["train", "heldout"]
#: One task in this many is held out; membership is a hash of the task's content, so no seed
#: can produce a training task that is also a held-out task.
HELDOUT_EVERY = 5


class ChainTask(Task):
    """One task record (a JSONL line of a chain TaskSet): apply `step` to `start`, `repeats`
    times, each time to the previous result."""

    type: Literal["chain"] = "chain"
    prompt: str
    """The prompt text, `<task>START STEP xREPEATS</task>`, e.g. `<task>37 *7%97+5 x4</task>`."""
    start: int = Field(ge=0, le=9_999)
    step: str
    """Multiply, modulo, add, e.g. `*7%97+5` (see `STEP_RE`)."""
    repeats: int = Field(ge=1, le=9)
    """How many dependent calculator calls the task takes."""
    answer: int
    """The value after applying `step` `repeats` times."""

    @model_validator(mode="after")
    def _consistent(self) -> "ChainTask":
        if not STEP_RE.fullmatch(self.step):
            raise ValueError(f"step: {self.step!r} is not of the form *A%M+B")
        if self.prompt != render_prompt(self.start, self.step, self.repeats):
            raise ValueError(f"prompt: {self.prompt!r} does not match start, step and repeats")
        if self.answer != chain_values(self.start, self.step, self.repeats)[-1]:
            raise ValueError(f"answer: {self.answer} is not the result of the steps")
        return self


def render_prompt(start: int, step: str, repeats: int) -> str:
    return f"<task>{start} {step} x{repeats}</task>"


def apply_step(value: int, step: str) -> int:
    return evaluate_expression(f"{value}{step}")


def chain_values(start: int, step: str, repeats: int) -> list[int]:
    """Every intermediate result, last one the answer."""
    values = [apply_step(start, step)]
    for _ in range(repeats - 1):
        values.append(apply_step(values[-1], step))
    return values


def _content_hash(start: int, step: str, repeats: int) -> int:
    digest = hashlib.sha256(f"{start} {step} x{repeats}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def task_split(start: int, step: str, repeats: int) -> Split:
    return "heldout" if _content_hash(start, step, repeats) % HELDOUT_EVERY == 0 else "train"


#: Most calls one chain task holds (`ChainTask.repeats`' upper bound).
MAX_REPEATS = next(m.le for m in ChainTask.model_fields["repeats"].metadata if hasattr(m, "le"))


class ZipfRepeats:
    """Long-tailed call counts: k in [1, K], K = 4 * `num_steps`, with P(k) proportional to
    k^-`tail` (a Zipf law truncated to [1, K]; `tail` 0 is uniform). Called with a
    `random.Random`, it draws one count by inverting the cumulative distribution with a single
    `rng.random()`, so a seeded stream gives the same counts every time."""

    def __init__(self, num_steps: int, tail: float) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
        if not 0 <= tail <= 10:
            raise ValueError(f"length_tail: must be in [0, 10], got {tail}")
        self.high = 4 * num_steps
        if self.high > MAX_REPEATS:
            raise ValueError(
                f"num_steps: long-tailed lengths draw up to 4 * num_steps = {self.high} calls, "
                f"more than a chain task holds ({MAX_REPEATS}); use num_steps <= {MAX_REPEATS // 4}")
        weights = [k ** -tail for k in range(1, self.high + 1)]
        total = sum(weights)
        self.probabilities = [w / total for w in weights]
        """P(k) for k = 1..high."""

    def __call__(self, rng: random.Random) -> int:
        u = rng.random()
        for k, p in enumerate(self.probabilities, 1):
            u -= p
            if u < 0:
                return k
        return self.high  # the probabilities' sum rounded to just under 1.0


def generate_tasks(count: int, seed: int, *, split: Split = "train", num_steps: int = 4,
                   sample_repeats: Callable[[random.Random], int] | None = None
                   ) -> list[ChainTask]:
    """`count` distinct tasks of `split` with `num_steps` calls each, the same for the same
    arguments. Train and held-out tasks never coincide (whatever the seeds); different seeds
    give different streams. `sample_repeats` (e.g. a `ZipfRepeats`) draws each task's call
    count from the same seeded stream instead, so the counts are reproducible too."""
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    if not 1 <= num_steps <= MAX_REPEATS:
        raise ValueError(f"num_steps: must be in 1..{MAX_REPEATS}, got {num_steps}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split: must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"chain/{seed}/{num_steps}")
    seen: set[tuple[int, str]] = set()
    tasks: list[ChainTask] = []
    while len(tasks) < count:
        start = rng.randint(10, 99)
        step = f"*{rng.randint(2, 9)}%{rng.randint(11, 199)}+{rng.randint(1, 99)}"
        repeats = num_steps if sample_repeats is None else sample_repeats(rng)
        if not 1 <= repeats <= MAX_REPEATS:
            raise ValueError(f"sample_repeats: drew {repeats} calls; a chain task holds 1..{MAX_REPEATS}")
        if (start, step) in seen or task_split(start, step, repeats) != split:
            continue
        seen.add((start, step))
        tasks.append(ChainTask(
            id=f"chain-{split}-{seed}-{len(tasks)}",
            prompt=render_prompt(start, step, repeats), start=start, step=step,
            repeats=repeats, answer=chain_values(start, step, repeats)[-1],
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
