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

Modules: `tasks` (records, generation, splits), `protocol` (tags and the action grammar),
`calculator` (the tool), `solver` (the scripted expert and the tokenizer corpus),
`environment` (the reward and `ChainEnvironment`). The names below are the package's interface.

Not covered: running the tool in a sandbox (the sandbox service runs `tool_command`'s argv),
the agent loop (rollout service), tokenizers and models (benchmarks/quickstart/trial.py).
"""
from __future__ import annotations

from .calculator import (evaluate_expression, format_observation, run_tool_locally, tokenize,
                         tool_command)
from .environment import ChainEnvironment, verify
from .protocol import (MAX_ACTIONS, MAX_EXPR_CHARS, SPECIAL_TOKENS, STOP_TAGS, Answer, Call, Invalid,
                       Step, parse_action, tool_call)
from .solver import Turn, corpus_for_tokenizer, final_answer, render, scripted_solver, triggers_mistake
from .tasks import (HELDOUT_EVERY, MAX_REPEATS, STEP_RE, ChainTask, ZipfRepeats, apply_step,
                    chain_values, generate_tasks, read_tasks, render_prompt, task_split, write_tasks)

__all__ = [
    "HELDOUT_EVERY", "MAX_ACTIONS", "MAX_EXPR_CHARS", "MAX_REPEATS", "SPECIAL_TOKENS", "STEP_RE",
    "STOP_TAGS", "Answer", "Call", "ChainEnvironment", "ChainTask", "Invalid", "Step", "Turn",
    "ZipfRepeats", "apply_step", "chain_values", "corpus_for_tokenizer", "evaluate_expression",
    "final_answer", "format_observation", "generate_tasks", "parse_action", "read_tasks", "render",
    "render_prompt", "run_tool_locally", "scripted_solver", "task_split", "tokenize", "tool_call",
    "tool_command", "triggers_mistake", "verify", "write_tasks",
]
