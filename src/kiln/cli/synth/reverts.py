"""Edits an agent later undid, found in a finished episode's messages so SFT does not imitate
them (`kiln synth difficulty --sft`).

An edit is reverted when a later call of the episode puts the file back:
- `str_replace` of `old` by `new` in a file, then `str_replace` of that `new` by that `old` in
  the same file (both calls are the detour);
- `create` of a file, then `rm`/`git checkout`/`git restore` of that path through `bash`;
- any `str_replace` or `create` of a file, then `git checkout -- PATH`, `git restore PATH` (or
  `git checkout .` / `git restore .`, `git stash`: every file) through `bash`: the edits
  before it and the reverting command itself.
The assistant messages that made those calls get `"weight": 0`: kept as context, not trained on.
Edits by other bash commands (sed, shell redirection) are not followed.
"""
from __future__ import annotations

import json
import re
import shlex

_RESTORE = re.compile(r"^git\s+(checkout|restore)\b")


def _calls(messages: list[dict]):
    """(index of the assistant message, tool name, arguments) of every call, in order."""
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                continue
            if isinstance(args, dict):
                yield i, fn.get("name", ""), args


def _restored(command: str) -> tuple[set[str], set[str]]:
    """(paths the command restores with git, `"*"` for every file; paths it removes)."""
    git: set[str] = set()
    removed: set[str] = set()
    for part in re.split(r"&&|\|\||;", command):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        if words[:2] == ["git", "stash"] and (len(words) == 2 or words[2] in ("push", "save")):
            git.add("*")
        elif _RESTORE.match(" ".join(words)):
            paths = [w for w in words[2:] if not w.startswith("-")]
            git |= {"*" if p == "." else p.removeprefix("./") for p in paths}
        elif words[:1] == ["rm"]:
            removed |= {w.removeprefix("./") for w in words[1:] if not w.startswith("-")}
    return git, removed


def reverted_messages(messages: list[dict]) -> set[int]:
    """Indexes of the assistant messages whose calls were edits later undone, or the undoing."""
    out: set[int] = set()
    edits: list[tuple[int, str, str, dict]] = []  # (message, tool, path, arguments), in order
    for i, name, args in _calls(messages):
        path = str(args.get("path", "")).removeprefix("./")
        if name == "str_replace":
            undone = next((e for e in reversed(edits) if e[1] == "str_replace" and e[2] == path
                           and e[3].get("new") == args.get("old") and e[3].get("old") == args.get("new")), None)
            if undone is not None:
                out |= {undone[0], i}
                edits.remove(undone)
                continue
        if name in ("str_replace", "create"):
            edits.append((i, name, path, args))
        elif name == "bash":
            git, removed = _restored(str(args.get("command", "")))
            # git puts back edited and created files; `rm` only undoes a created one.
            hit = [e for e in edits if "*" in git or e[2] in git
                   or (e[1] == "create" and e[2] in removed)]
            if hit:
                out |= {e[0] for e in hit} | {i}
                edits = [e for e in edits if e not in hit]
    return out


def mask_reverted(messages: list[dict]) -> int:
    """Set `"weight": 0` on the messages `reverted_messages` finds; how many it found."""
    found = reverted_messages(messages)
    for i in found:
        messages[i]["weight"] = 0
    return len(found)
