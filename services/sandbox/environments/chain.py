"""The quickstart's task environment, `chain`: several dependent calculator calls, then an answer.

A task is a start value, a step (multiply, modulo, add: `*7%97+5`) and a count. The agent must
apply the step that many times with a sandboxed tool, copying each observation into the next
call, and finally answer the last result. The answer is verifiable (reward 0/1).

Two tools, both run in the sandbox by coreutils `expr`:
- `step V` applies the task's step to V (`step 37` runs `expr 37 * 7 % 97 + 5`);
- `calc EXPR` is a general integer calculator (`calc 37*7%97+5`).
The scripted solver uses `step`. (Earlier designs were too slow for a sub-million-parameter
model to imitate on two cores: with a different step per call, picking the k-th step was the
hard part; with `calc`, copying the step's digits from the prompt into every call took SFT
several times longer to learn than copying the values, and whether it was learned within the
quickstart's budget depended on the random initialisation.)

The text protocol (every tag is one special token of the quickstart tokenizer):

    <task>37 *7%97+5 x4</task>          prompt (not trained on)
    <call>step 37</call>                action (trained on)
    <obs>70</obs>                       observation appended by the environment
    <call>step 70</call>
    <obs>10</obs>
    <call>step 10</call>
    <obs>75</obs>
    <call>step 75</call>
    <obs>45</obs>
    <answer>45</answer>                 final action; the episode ends

An action may start with `<think>...</think>` (free text, ignored by the parser). Generation of
an action stops at `</call>` or `</answer>` (`STOP_TAGS`). Anything that is neither one well-formed
call nor one well-formed answer is `Invalid` and ends the episode with reward 0.

`scripted_solver` writes expert trajectories for SFT. It is deliberately imperfect in ONE
systematic way: whenever it copies an observation that ends in the digit 0 (into the next call
or into the answer) it drops that final 0 (`70` is copied as `7`), with probability
`mistake_rate` (default 1.0: always). It never errs otherwise, except for optional random digit
slips (`slip_rate`, default 0). Imitation learns the mistake as a rule; a 0/1 reward lets RL
unlearn it. About 30% of 4-step tasks hit the mistake at least once (the solver solves ~70%).

`ChainEnvironment` is the same task in the sandbox service's `Environment` interface.

Not covered: running the tool in a sandbox (the sandbox service runs `tool_command`'s argv),
the agent loop (rollout service), tokenizers and models (benchmarks/quickstart/trial.py).
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Literal

from pydantic import Field, model_validator

from ..interface import Sandbox
from .base import Environment, TaskBase, VerifyResult

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
#: The step every task repeats: multiply, reduce modulo, add (`*7%97+5`); Python's precedence
#: evaluates it left to right, so the call needs no parentheses and values stay below m + b.
STEP_RE = re.compile(r"\*([2-9])%([1-9][0-9]{1,2})\+([1-9][0-9]?)")

Split = Literal["train", "heldout"]
#: One task in this many is held out; membership is a hash of the task's content, so no seed
#: can produce a training task that is also a held-out task.
HELDOUT_EVERY = 5


# ----------------------------------------------------------------------------- tasks


class ChainTask(TaskBase):
    """One task record (a JSONL line of a chain TaskSet): apply `step` to `start`, `repeats`
    times, each time to the previous result."""

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


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Call:
    expr: str


@dataclass(frozen=True)
class Step:
    """`step V`: apply the task's step to V."""

    value: str


@dataclass(frozen=True)
class Answer:
    value: str


@dataclass(frozen=True)
class Invalid:
    reason: str


_THINK = r"(?:<think>[^<]*</think>)?"
_CALL_RE = re.compile(_THINK + r"<call>calc ([0-9+\-*/%% ()]{1,%d})</call>" % MAX_EXPR_CHARS)
_STEP_RE = re.compile(_THINK + r"<call>step (-?[0-9]{1,12})</call>")
_ANSWER_RE = re.compile(_THINK + r"<answer>([^<]{0,32})</answer>")


def parse_action(text: str) -> Call | Step | Answer | Invalid:
    """One generated action (up to and including its stop tag) -> what the agent asked for."""
    text = text.strip()
    if m := _STEP_RE.fullmatch(text):
        return Step(m.group(1))
    if m := _CALL_RE.fullmatch(text):
        return Call(m.group(1).strip())
    if m := _ANSWER_RE.fullmatch(text):
        return Answer(m.group(1).strip())
    return Invalid(f"not one <call>step N</call>, <call>calc EXPR</call> or <answer>N</answer>: "
                   f"{text[:80]!r}")


def tool_call(task: "ChainTask", action: Call | Step) -> Call:
    """The calculator call a tool action amounts to in `task`: `step V` is `calc V` + the
    task's step."""
    return Call(f"{action.value}{task.step}") if isinstance(action, Step) else action


# ----------------------------------------------------------------------------- the tool

#: The calculator is coreutils `expr`: integers, `+ - * / %` (C semantics: `/` truncates toward
#: zero, `%` takes the dividend's sign), parentheses. Each token is its own argv element, never
#: spliced into a shell line; a binary start (~1 ms) keeps a sandboxed call cheap.
_TOKEN_RE = re.compile(r"\d+|[-+*/%()]|[^\s\d()+\-*/%]+")


def tokenize(expr: str) -> list[str]:
    """`37*7%97+5` -> `['37', '*', '7', '%', '97', '+', '5']`; a `-` that starts an operand is
    folded into its number (`-3+1` -> `['-3', '+', '1']`), as `expr` reads negative integers."""
    raw = _TOKEN_RE.findall(expr)
    out: list[str] = []
    for tok in raw:
        if tok.isdigit() and out and out[-1] == "-" and (len(out) == 1 or out[-2] in "(+-*/%"):
            out[-1] = "-" + tok
        else:
            out.append(tok)
    return out


def tool_command(call: Call) -> list[str]:
    """The argv the sandbox runs to evaluate `call` (needs coreutils in the image)."""
    return ["expr", *tokenize(call.expr)]


def evaluate_expression(expr: str) -> int:
    """The calculator in-process, with `expr`'s semantics; raises ValueError (syntax, too long)
    or ZeroDivisionError where the tool would fail."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    toks = tokenize(expr)
    pos = 0

    def atom() -> int:
        nonlocal pos
        if pos < len(toks) and toks[pos] == "(":
            pos += 1
            v = sum_()
            if pos >= len(toks) or toks[pos] != ")":
                raise ValueError("unbalanced parenthesis")
            pos += 1
            return v
        if pos < len(toks) and re.fullmatch(r"-?\d+", toks[pos]):
            pos += 1
            return int(toks[pos - 1])
        raise ValueError(f"syntax error at {toks[pos] if pos < len(toks) else 'end'!r}")

    def product() -> int:
        nonlocal pos
        v = atom()
        while pos < len(toks) and toks[pos] in ("*", "/", "%"):
            op = toks[pos]
            pos += 1
            w = atom()
            if op == "*":
                v = v * w
            elif w == 0:
                raise ZeroDivisionError("division by zero")
            else:
                q = abs(v) // abs(w) * (1 if (v >= 0) == (w >= 0) else -1)
                v = q if op == "/" else v - q * w
        return v

    def sum_() -> int:
        nonlocal pos
        v = product()
        while pos < len(toks) and toks[pos] in ("+", "-"):
            op = toks[pos]
            pos += 1
            w = product()
            v = v + w if op == "+" else v - w
        return v

    value = sum_()
    if pos != len(toks):
        raise ValueError(f"syntax error at {toks[pos]!r}")
    return value


def format_observation(stdout: str, exit_code: int) -> str:
    """The tool's result as the text appended to the context. Errors are one word, so a model
    cannot be fed arbitrary text through the observation. (`expr` exits 1 when the result is 0.)"""
    value = stdout.strip()
    if exit_code in (0, 1) and re.fullmatch(r"-?[0-9]{1,40}", value):
        return f"<obs>{value}</obs>"
    return "<obs>error</obs>"


def run_tool_locally(call: Call) -> str:
    """`format_observation` of the calculator run in-process (tests and the CPU trial)."""
    try:
        return format_observation(str(evaluate_expression(call.expr)), 0)
    except (ValueError, ZeroDivisionError, RecursionError):
        return format_observation("", 2)


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


# ----------------------------------------------------------------------------- environment


class ChainEnvironment(Environment):
    """`chain` in the sandbox service's environment interface. The task needs no state in the
    sandbox (the calculator is stateless), so setup does nothing and the reward depends on the
    final answer alone. A reference solution is a file holding the answer."""

    type: ClassVar[str] = "chain"
    task_model: ClassVar[type[TaskBase]] = ChainTask
    solution_name: ClassVar[str] = "{id}.txt"

    async def setup(self, sandbox: Sandbox, task: TaskBase) -> None:
        return None

    async def verify(self, sandbox: Sandbox, task: TaskBase, answer: str | None = None
                     ) -> VerifyResult:
        if not isinstance(task, ChainTask):
            raise TypeError(f"chain environment got a {type(task).__name__} task")
        reward, parts, output = verify(task, answer)
        return VerifyResult(reward=reward, parts=parts, output=output)

    async def apply_solution(self, sandbox: Sandbox, task: TaskBase, solution: bytes
                             ) -> str | None:
        return solution.decode("ascii").strip()
