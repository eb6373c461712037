"""The scripted solver that writes the chain environment's SFT demonstrations (deliberately
imperfect in one systematic way), and the text corpus a tokenizer for the task is trained on."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from .calculator import run_tool_locally
from .protocol import SPECIAL_TOKENS, Answer, Step, parse_action, tool_call
from .tasks import ChainTask, generate_tasks


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
    for _ in range(task.repeats):
        turns.append(Turn("action", f"<call>step {current}</call>"))
        obs = run_tool_locally(tool_call(task, Step(current)))
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


_TAG_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def corpus_for_tokenizer(count: int = 2000, seed: int = 0) -> list[str]:
    """The text between protocol tags in `count` expert episodes (prompts, calls,
    observations, answers), plus the error word and the other calculator operators. The tags
    themselves are left out: a tokenizer adds them as special tokens, not learned merges."""
    rng = random.Random(seed)
    texts = []
    for task in generate_tasks(count, seed=seed):
        episode = "".join(t for t, _ in render(task, scripted_solver(task, rng)))
        texts += [piece for piece in _TAG_RE.split(episode) if piece]
    texts += ["error", "calc (1+2)//3%4", "calc 37*7%97+5"]
    return texts
