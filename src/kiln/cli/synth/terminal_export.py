"""What `kiln synth terminal` checks in a draft before running it, and the Terminal-Bench-style
folder it writes for each kept task.

Folder layout (the one `kiln synth import terminal-bench` reads back):

    tasks/<id>/task.yaml       instruction, author, difficulty, timeouts
    tasks/<id>/Dockerfile      python:3.11-slim, WORKDIR /app, the task's files and set-up
    tasks/<id>/files/...       the task's initial files (when it has any)
    tasks/<id>/setup.sh        the set-up (when it has one)
    tasks/<id>/run-tests.sh    runs tests/test.sh from $TEST_DIR
    tasks/<id>/tests/test.sh   the test script
    tasks/<id>/solution.sh     the reference solution
"""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import yaml

REQUIRED = {"description": str, "test_script": str, "solution": str}
OPTIONAL = {"setup": str, "files": dict}

# A reference that touches the grader is an exploit a policy would learn to imitate: the test
# script is written into this folder only at grading, and a task must be solvable without it.
_GRADER = re.compile(r"\.kiln-verifier|\bkiln-verifier\b|\btest_script\b|run-tests\.sh")


def check_draft(draft: dict) -> str | None:
    """What is wrong with a draft's shape, in words the model can act on; None when it is
    well-formed."""
    for key, kind in REQUIRED.items():
        value = draft.get(key)
        if not isinstance(value, kind) or not value.strip():
            return f"`{key}` must be a non-empty string"
    for key, kind in OPTIONAL.items():
        if key in draft and draft[key] is not None and not isinstance(draft[key], kind):
            return f"`{key}` must be a {'string' if kind is str else 'JSON object'}"
    for path, text in (draft.get("files") or {}).items():
        pure = PurePosixPath(path)
        if not isinstance(text, str):
            return f"`files[{path!r}]` must be the file's text"
        if pure.is_absolute() or ".." in pure.parts or not path.strip():
            return f"`files[{path!r}]`: paths are relative to the working folder, without `..`"
    return None


def exploit(draft: dict) -> str | None:
    """Why the reference solution games the grader, or None."""
    solution = draft["solution"]
    if _GRADER.search(solution):
        return "the reference solution reads or edits the verifier's files"
    test = draft["test_script"].strip()
    if len(test) > 40 and test in solution:
        return "the reference solution contains the test script"
    return None


def write_folder(root: Path, record: dict, solution: str, difficulty: str = "medium") -> Path:
    folder = root / record["id"]
    (folder / "tests").mkdir(parents=True, exist_ok=True)
    meta = {"instruction": record["description"], "author_name": "kiln synth terminal",
            "difficulty": difficulty, "category": "synthesized",
            "max_agent_timeout_sec": int(record["timeout_seconds"]) * 10,
            "max_test_timeout_sec": int(record["timeout_seconds"])}
    (folder / "task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, width=100))
    docker = ["FROM python:3.11-slim", "WORKDIR /app"]
    for path, text in record["files"].items():
        target = folder / "files" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    if record["files"]:
        docker.append("COPY files/ /app/")
    if record["setup"].strip():
        (folder / "setup.sh").write_text(record["setup"].rstrip("\n") + "\n")
        docker += ["COPY setup.sh /app/setup.sh", "RUN sh setup.sh && rm setup.sh"]
    (folder / "Dockerfile").write_text("\n".join(docker) + "\n")
    (folder / "run-tests.sh").write_text('#!/bin/sh\nsh "$TEST_DIR/test.sh"\n')
    (folder / "tests" / "test.sh").write_text(record["test_script"].rstrip("\n") + "\n")
    (folder / "solution.sh").write_text(solution.rstrip("\n") + "\n")
    return folder
