"""The chain task's reward, and the task as a `kiln.env.Environment`: its tools (`step`,
`calc`), what they run in the sandbox, the scripted solver's demonstrations, the grade.

The tools' arguments carry JSON-schema patterns, so a reply whose call does not fit (`step abc`)
is unparseable, and a chain episode ends there with reward 0 (`end_on_invalid_action`), as the
environment's text protocol has always done.
"""
from __future__ import annotations

import random
import re
from typing import ClassVar

from kiln.env import AssistantTurn, Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec
from ..base import Environment, Task, unknown_tool
from .calculator import tool_command, tool_output
from .protocol import MAX_EXPR_CHARS, Call, Step, tool_call
from .solver import corpus_for_tokenizer, final_answer, scripted_solver
from .tasks import ChainTask, ZipfRepeats, generate_tasks

#: The expert's blind spot fires on 3 of 4 trailing-zero copies: imitation still learns the
#: mistake (greedy decoding makes it), but sampling sometimes copies right, which is what RL
#: needs to discover the fix. At 1.0 the SFT model never samples a correct copy.
DEMONSTRATION_MISTAKE_RATE = 0.75

STEP_TOOL = ToolSpec("step", "Apply the task's step to a value.", {
    "type": "object", "properties": {"value": {"type": "string", "pattern": r"^-?[0-9]{1,12}$"}},
    "required": ["value"]})
CALC_TOOL = ToolSpec("calc", "Evaluate an integer expression.", {
    "type": "object", "properties": {"expression": {
        "type": "string", "pattern": rf"^[0-9+\-*/% ()]{{1,{MAX_EXPR_CHARS}}}$"}},
    "required": ["expression"]})
TOOLS = [STEP_TOOL, CALC_TOOL]


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


class ChainEnvironment(Environment):
    """`chain` as an environment. The calculator is stateless, so the sandbox holds nothing
    between calls, setup does nothing and the reward depends on the final answer alone. A
    reference solution is a file holding the answer."""

    type: ClassVar[str] = "chain"
    task_model: ClassVar[type[Task]] = ChainTask
    solution_name: ClassVar[str] = "{id}.txt"
    end_on_invalid_action: ClassVar[bool] = True

    def generate_tasks(self, gen) -> list[ChainTask]:
        """The tasks a job's `generate` block (kiln.api.spec.TaskGenerator) asks for."""
        sampler = None if gen.length_tail is None else ZipfRepeats(gen.num_steps, gen.length_tail)
        return generate_tasks(gen.count, gen.seed, split=gen.split, num_steps=gen.num_steps,
                              sample_repeats=sampler)

    def user_prompt(self, task: ChainTask) -> str:
        return task.prompt

    def tools(self, task: ChainTask) -> list[ToolSpec]:
        return TOOLS

    async def call_tool(self, sandbox: SandboxHandle, task: ChainTask, call: ToolCall) -> ToolResult:
        if call.name == "step":
            action = Step(str(call.arguments.get("value", "")))
        elif call.name == "calc":
            action = Call(str(call.arguments.get("expression", "")).strip())
        else:
            return unknown_tool(call, TOOLS)
        res = await sandbox.exec(tool_command(tool_call(task, action)))
        return ToolResult(tool_output(res.stdout, res.exit_code))

    async def grade(self, sandbox: SandboxHandle | None, task: ChainTask,
                    answer: str | None = None) -> Grade:
        reward, parts, output = verify(task, answer)
        return Grade(reward=reward, parts=parts, output=output)

    def demonstrate(self, task: ChainTask, rng: random.Random) -> list[AssistantTurn]:
        """The scripted solver's episode. Its observations are the calculator's, computed
        in-process (the tool is deterministic): demonstrations for a 6,000-task SFT pool then
        cost no sandbox starts."""
        turns = scripted_solver(task, rng, mistake_rate=DEMONSTRATION_MISTAKE_RATE)
        out = []
        for action, observation in zip(turns[0::2], turns[1::2]):
            value = re.fullmatch(r"<call>step (.*)</call>", action.text).group(1)
            out.append(AssistantTurn(tool_calls=[ToolCall("step", {"value": value})],
                                     outputs=[observation.text[len("<obs>"):-len("</obs>")]]))
        out.append(AssistantTurn(content=final_answer(turns) or ""))
        return out

    def tokenizer_corpus(self, tasks) -> list[str]:
        """The text between the protocol's tags in expert episodes (see corpus_for_tokenizer)."""
        return corpus_for_tokenizer()

    async def apply_solution(self, sandbox: SandboxHandle, task: ChainTask, solution: bytes
                             ) -> str | None:
        return solution.decode("ascii").strip()
