"""Edits an agent undid are loss-masked in `kiln synth difficulty`'s SFT data: each way of
undoing one (the inverse str_replace, git checkout/restore/stash, rm of a created file), and
edits that stay, or commands that restore other files, are left trained on."""
from __future__ import annotations

import json

from kiln.cli.synth.reverts import mask_reverted, reverted_messages


def _episode(*calls: tuple[str, dict]) -> list[dict]:
    messages = [{"role": "user", "content": "fix the bug"}]
    for k, (name, args) in enumerate(calls):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{k}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": "ok"})
    messages.append({"role": "assistant", "content": "done"})
    return messages


def _assistant(k: int) -> int:
    """Index of the k-th call's assistant message in `_episode`'s list."""
    return 1 + 2 * k


def test_inverse_replace_masks_both_calls_and_keeps_the_rest():
    m = _episode(("str_replace", {"path": "a.py", "old": "x = 1", "new": "x = 2"}),
                 ("str_replace", {"path": "b.py", "old": "y", "new": "z"}),
                 ("str_replace", {"path": "./a.py", "old": "x = 2", "new": "x = 1"}),
                 ("bash", {"command": "python -m pytest -q"}))
    assert mask_reverted(m) == 2
    assert [i for i, msg in enumerate(m) if msg.get("weight") == 0] == [_assistant(0), _assistant(2)]


def test_git_restores_mask_the_edits_of_the_files_they_put_back():
    m = _episode(("str_replace", {"path": "a.py", "old": "1", "new": "2"}),
                 ("create", {"path": "notes.txt", "content": "n"}),
                 ("str_replace", {"path": "b.py", "old": "3", "new": "4"}),
                 ("bash", {"command": "cd /repo && git checkout -- a.py"}))
    assert reverted_messages(m) == {_assistant(0), _assistant(3)}
    everything = _episode(("str_replace", {"path": "a.py", "old": "1", "new": "2"}),
                          ("create", {"path": "c.py", "content": "c"}),
                          ("bash", {"command": "git stash"}),
                          ("str_replace", {"path": "a.py", "old": "1", "new": "5"}))
    assert reverted_messages(everything) == {_assistant(0), _assistant(1), _assistant(2)}
    dot = _episode(("str_replace", {"path": "a.py", "old": "1", "new": "2"}),
                   ("bash", {"command": "git restore ."}))
    assert reverted_messages(dot) == {_assistant(0), _assistant(1)}


def test_rm_undoes_a_created_file_only():
    m = _episode(("create", {"path": "scratch.py", "content": "print(1)"}),
                 ("str_replace", {"path": "a.py", "old": "1", "new": "2"}),
                 ("bash", {"command": "rm -f scratch.py a.py"}))
    assert reverted_messages(m) == {_assistant(0), _assistant(2)}


def test_nothing_undone_masks_nothing():
    m = _episode(("str_replace", {"path": "a.py", "old": "1", "new": "2"}),
                 ("str_replace", {"path": "a.py", "old": "2", "new": "3"}),  # a further edit
                 ("bash", {"command": "git checkout -- other.py; git status"}),
                 ("bash", {"command": "rm build.log"}))
    assert mask_reverted(m) == 0 and not any("weight" in msg for msg in m)
