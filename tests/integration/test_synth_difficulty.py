"""`kiln synth difficulty`: a scripted policy behind the OpenAI-compatible interface plays
terminal tasks in real sandboxes; tasks it always or never solves are dropped, and passing
episodes become SFT data with the failed steps loss-masked."""
from __future__ import annotations

import json
from collections import Counter

from helpers.fake_openai import ScriptedModel
from helpers.synth import kiln

TASKS = [{"id": name, "type": "terminal", "description": f"Create {name}.txt containing ok.",
          "test_script": f'test "$(cat {name}.txt)" = ok'} for name in ("easy", "hard", "mixed")]


def call(name: str, arguments: dict, n: int) -> dict:
    return {"id": f"call-{n}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def policy():
    episodes = Counter()

    def answer(body: dict) -> dict:
        task = next(t["id"] for t in TASKS if t["description"] == body["messages"][-1]["content"]
                    ) if body["messages"][-1]["role"] == "user" else None
        if task is not None:  # an episode's first call
            episodes[task] += 1
            n = episodes[task]
            if task == "hard" or (task == "mixed" and n % 2 == 0):
                return {"content": "I cannot do this."}
            # A failing first step, then the fix: the failure is kept but masked.
            return {"content": "", "tool_calls": [call("bash", {"command": "cat nothing.txt"}, 1)]}
        user = next(m for m in body["messages"] if m["role"] == "user")["content"]
        name = user.split()[1].removesuffix(".txt")
        if body["messages"][-1]["content"].startswith("exit code 1"):
            return {"content": "", "tool_calls": [call("bash", {
                "command": f"echo ok > {name}.txt"}, 2)]}
        return {"content": "", "tool_calls": [call("submit", {}, 3)]}
    return answer


def test_difficulty_keeps_sometimes_solved_and_exports_sft(tmp_path):
    taskset = tmp_path / "tasks.jsonl"
    taskset.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = tmp_path / "out"
    with ScriptedModel(policy()) as model:
        res = kiln("synth", "difficulty", str(taskset), "--model-url", model.url, "--samples",
                   "4", "--sft", "--out", str(out))
        assert res.returncode == 0, res.stderr
        asked = len(model.requests)
        rates = {r["id"]: r["pass_rate"]
                 for r in map(json.loads, (out / "difficulty.jsonl").read_text().splitlines())}
        assert rates == {"easy": 1.0, "hard": 0.0, "mixed": 0.5}
        kept = [json.loads(x)["id"] for x in (out / "tasks.jsonl").read_text().splitlines()]
        assert kept == ["mixed"]
        report = json.loads((out / "report.json").read_text())
        assert report["funnel"] == {"tasks": 3, "played": 3, "not never-solved": 2,
                                    "not always-solved": 1, "kept": 1}

        sft = [json.loads(x) for x in (out / "sft.jsonl").read_text().splitlines()]
        assert Counter(e["task_id"] for e in sft) == {"easy": 4, "mixed": 2}
        episode = sft[0]
        assistant = [m for m in episode["messages"] if m["role"] == "assistant"]
        assert [m.get("weight", 1) for m in assistant] == [0, 1, 1]  # the failed cat is masked
        assert {t["function"]["name"] for t in episode["tools"]} >= {"bash", "submit"}

        again = kiln("synth", "difficulty", str(taskset), "--model-url", model.url, "--samples",
                     "4", "--sft", "--out", str(out))
        assert again.returncode == 0, again.stderr
        assert len(model.requests) == asked  # every task's rate was already known
        assert len((out / "tasks.jsonl").read_text().splitlines()) == 1
