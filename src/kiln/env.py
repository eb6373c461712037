"""The environment interface: what a task environment implements, built in or a user's plugin.

An environment turns a task record into an episode an agent plays with tools: the prompt, the
tools it offers (JSON-schema arguments, as chat templates and the OpenAI API describe them),
what each tool call does in the episode's sandbox, and the grade of the final state. The sandbox
service runs environments (it owns the sandboxes); rollout talks to it in messages and tool
calls and never sees an environment's code.

A plugin is a class named in the RLJob (`env: {plugin: "my_pkg.my_env:MyEnv"}`, or an entry point
of the group `kiln.environments`):

    class Greeter(kiln.env.Environment):
        task_model = GreetTask                      # a pydantic model: one JSONL line

        def user_prompt(self, task):
            return f"Write {task.word!r} to hello.txt, then submit."

        def tools(self, task):
            return [BASH, SUBMIT]

        async def call_tool(self, sandbox, task, call):
            if call.name == "submit":
                return ToolResult("submitted", done=True)
            res = await sandbox.exec(call.arguments["command"], timeout=10)
            return ToolResult(f"exit {res.exit_code}\\n{res.stdout}{res.stderr}")

        async def grade(self, sandbox, task, answer):
            data = await sandbox.read_file("hello.txt")
            return Grade(float(data.strip() == task.word.encode()))

`setup`, `system_prompt` and `demonstrate` (a scripted solution for SFT) have defaults. A custom
reward (`reward: {plugin: "pkg.mod:fn"}`) is a function `fn(task, grade, transcript) -> float |
Grade` that composes with the environment's own grade (`Grade.parts` keeps both).

Not covered: the episode loop itself (the sandbox service's `episodes.py`), tokenization and
chat templates (rollout).
"""
from __future__ import annotations

import abc
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field


class Task(BaseModel):
    """Fields every task record has; an environment's `task_model` extends it."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    """Unique within its task set; names the task in errors and in reference solutions."""
    image: str | None = None
    """Container image for the docker backend; None means the service's default image."""
    timeout_seconds: float = Field(default=60.0, gt=0)
    """Limit for each verifier command."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool, as a chat template's `tools=` and the OpenAI API describe it."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments object."""

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def string_tool(name: str, description: str, **args: str) -> ToolSpec:
    """A tool whose arguments are all required strings (`args`: name -> description)."""
    return ToolSpec(name, description, {
        "type": "object",
        "properties": {k: {"type": "string", "description": d} for k, d in args.items()},
        "required": list(args)})


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolResult:
    """What a tool call returned: text for the model (never trained on), and whether it ended
    the episode (a `submit` tool) with an answer for grading."""

    output: str
    done: bool = False
    answer: str | None = None


@dataclass
class Grade:
    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    output: str = ""
    """The verifier's log (tail)."""
    flags: list[str] = field(default_factory=list)
    """Things a trajectory filter must know, e.g. `tests_modified` (an exploit attempt)."""


@dataclass
class AssistantTurn:
    """One turn of a scripted solution: optional text, then tool calls (none: a final answer)."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    outputs: list[str] | None = None
    """What the calls return, when the solver knows (a deterministic tool computed in-process);
    None: the calls are run in the episode's sandbox."""


class SandboxHandle(Protocol):
    """The part of a sandbox an environment uses (the sandbox service's `Sandbox` is one)."""

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None,
                   workdir: str | None = None, env: dict[str, str] | None = None,
                   stdin: bytes | None = None) -> Any: ...

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...


class Environment(abc.ABC):
    """One kind of task. Stateless: the task record and the sandbox hold all state, so one
    instance serves every episode."""

    #: The task record type (one JSONL line of a task set).
    task_model: ClassVar[type[Task]] = Task
    #: Whether episodes need a sandbox (one is created before `setup` when they do).
    needs_sandbox: ClassVar[bool] = True

    def __init__(self, base_dir: Path | None = None) -> None:
        #: Folder relative paths in task records (repos, corpora) resolve against: the task
        #: set file's folder.
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    def load_tasks(self, records: Sequence[dict[str, Any]]) -> list[Task]:
        """Task records (parsed JSONL lines) as `task_model`s; ValueError naming the problem."""
        return [self.task_model.model_validate(r) for r in records]

    def system_prompt(self, task: Task) -> str:
        return ""

    @abc.abstractmethod
    def user_prompt(self, task: Task) -> str:
        """The task, as the user message the agent starts from."""

    @abc.abstractmethod
    def tools(self, task: Task) -> list[ToolSpec]:
        """Tools offered in this task's episodes."""

    async def setup(self, sandbox: SandboxHandle | None, task: Task) -> None:
        """Bring a fresh sandbox to the task's initial state (default: nothing to do)."""

    @abc.abstractmethod
    async def call_tool(self, sandbox: SandboxHandle | None, task: Task,
                        call: ToolCall) -> ToolResult:
        """Run one tool call. An unknown tool or bad arguments is the model's mistake: say so in
        the output (the episode goes on), do not raise."""

    @abc.abstractmethod
    async def grade(self, sandbox: SandboxHandle | None, task: Task, answer: str | None) -> Grade:
        """Score the episode's final state (and `answer`: the submitted or final text)."""

    def reference(self, task: Task) -> str | None:
        """A human-written reference answer to show a judge (`rewardRules.judge`) as an anchor,
        or None. The default: the task's `answer` field where it is a string (the first, where
        it is a list of accepted answers, the number where it is one)."""
        answer = getattr(task, "answer", None)
        if isinstance(answer, list):
            answer = answer[0] if answer else None
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            return str(answer)
        return answer if isinstance(answer, str) else None

    def subtask(self, task: Task, role: str, instructions: str, assigned: str, *,
                index: int = 0) -> Task:
        """Agent swarms: the sub-task a subagent plays when an orchestrator working on `task`
        assigns it `assigned` (with the `role` and `instructions` it created the subagent
        with); `index` counts the sub-tasks the episode opened before this one. ValueError,
        with a message for the orchestrator, when the text names no sub-task this environment
        can make."""
        raise NotImplementedError("this environment makes no sub-tasks for subagents")

    def demonstrate(self, task: Task, rng: random.Random) -> list[AssistantTurn] | None:
        """A scripted solution for SFT, or None if the environment has no solver."""
        return None

    def grade_demonstration(self, task: Task, turns: list[AssistantTurn]) -> Grade | None:
        """The grade of a scripted solution whose turns all carry their outputs, when the
        environment can tell it without a sandbox (None: the calls are replayed in one and
        graded as an episode would be)."""
        return None

    def tokenizer_words(self, tasks: Sequence[Task]) -> list[str]:
        """Strings a local tiny model's tokenizer keeps as one token each (default: none;
        everything is learned as merges from `tokenizer_corpus`)."""
        return []

    def tokenizer_corpus(self, tasks: Sequence[Task]) -> list[str]:
        """Texts a tokenizer for this environment's episodes is trained on (a local tiny
        model's): the prompts, the tools, and the scripted solutions' calls."""
        texts: list[str] = []
        rng = random.Random(0)
        for tool in self.tools(tasks[0]) if tasks else []:
            texts += [tool.name, tool.description, json.dumps(tool.parameters)]
        for task in tasks:
            texts += [self.system_prompt(task), self.user_prompt(task)]
            for turn in self.demonstrate(task, rng) or []:
                texts.append(turn.content)
                texts += [json.dumps({"name": c.name, "arguments": c.arguments})
                          for c in turn.tool_calls]
        return [t for t in texts if t]


# ------------------------------------------------------------------------------------ plugins

ENTRY_POINT_GROUPS = {"environment": "kiln.environments", "reward": "kiln.rewards"}


class PluginError(ValueError):
    """A plugin reference that cannot be used: fix the reference or the plugin (retrying does
    not help)."""


def load_plugin(ref: str, kind: str = "environment") -> Any:
    """The object a plugin reference names: `module.path:Name`, or the name of an entry point in
    the `kiln.environments` / `kiln.rewards` group. An environment must be a subclass of
    `Environment`; a reward a callable of (task, grade, transcript). PluginError says what is
    wrong (import error, missing attribute, wrong kind)."""
    import importlib
    import inspect
    from importlib import metadata

    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # any import-time failure of user code is reported as is
            raise PluginError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
        try:
            obj = getattr(module, attr)
        except AttributeError:
            raise PluginError(f"module {module_name!r} has no attribute {attr!r}") from None
    else:
        group = ENTRY_POINT_GROUPS[kind]
        found = [ep for ep in metadata.entry_points(group=group) if ep.name == ref]
        if not found:
            raise PluginError(f"{ref!r} is neither `module:Name` nor an entry point of group "
                              f"{group!r}")
        try:
            obj = found[0].load()
        except Exception as exc:
            raise PluginError(f"entry point {ref!r} failed to load: {type(exc).__name__}: {exc}") from None
    if kind == "environment":
        if not (inspect.isclass(obj) and issubclass(obj, Environment)):
            raise PluginError(f"{ref!r} is not a subclass of kiln.env.Environment")
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        if missing:
            raise PluginError(f"{ref!r} does not implement {', '.join(missing)}")
    elif kind == "reward":
        if not callable(obj):
            raise PluginError(f"{ref!r} is not callable")
        try:
            inspect.signature(obj).bind(None, None, None)
        except TypeError:
            raise PluginError(f"{ref!r} must take (task, grade, transcript)") from None
    return obj
