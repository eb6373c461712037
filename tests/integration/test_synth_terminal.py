"""`kiln synth terminal` end to end: a scripted drafting model behind the OpenAI-compatible
interface (real HTTP), real sandboxes, the real CLI. The script exercises the refine loop (a
reply without JSON, then a test that passes when nothing is done, then a good draft), a
reference that never passes, an exploiting reference, a near-duplicate, resuming, and the
Terminal-Bench folders read back by `kiln synth import terminal-bench`."""
from __future__ import annotations

import json

import pytest

from kiln.services.sandbox.environments.tasks import load_taskset

from helpers.fake_openai import ScriptedModel, json_message
from helpers.synth import kiln

COUNT = {"description": "Count the lines of data/words.txt and write the number to count.txt.",
         "files": {"data/words.txt": "alpha\nbeta\ngamma\n"},
         "setup": "mkdir -p out",
         "test_script": 'test "$(tr -d " \\n" < count.txt)" = 3',
         "solution": "wc -l < data/words.txt > count.txt"}
SEEDS = {
    "count": "Count the lines of a text file and save the number.",
    "broken": "Reverse a file whose reference solution is wrong.",
    "cheat": "Sort numbers, with a solution that reads the grader.",
    "dup": "Count lines again, the same task in other words.",
}


def answer(body: dict) -> dict:
    seed = next(k for k, v in SEEDS.items() if v in body["messages"][1]["content"])
    round_ = sum(m["role"] == "assistant" for m in body["messages"]) + 1
    if seed == "count":
        if round_ == 1:
            return {"content": "I think the task could be about counting lines."}
        if round_ == 2:  # passes with nothing done
            return json_message({**COUNT, "test_script": "test -d out"})
        return json_message(COUNT)
    if seed == "broken":
        return json_message({"description": "Write the lines of a.txt reversed to b.txt.",
                             "files": {"a.txt": "1\n2\n"}, "test_script": 'grep -qx 2 b.txt',
                             "solution": "cp a.txt c.txt"})
    if seed == "cheat":
        return json_message({"description": "Sort nums.txt numerically into sorted.txt.",
                             "files": {"nums.txt": "3\n1\n2\n"},
                             "test_script": 'test "$(cat sorted.txt)" = "$(printf "1\\n2\\n3")"',
                             "solution": "sh .kiln-verifier/test.sh; sort -n nums.txt > sorted.txt"})
    return json_message(COUNT)


def test_terminal_pipeline(tmp_path):
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"id": k, "scenario": v}) + "\n"
                             for k, v in SEEDS.items()))
    out = tmp_path / "out"
    with ScriptedModel(answer) as model:
        res = kiln("synth", "terminal", "--seeds", str(seeds), "--model-url", model.url,
                   "--runs", "2", "--out", str(out))
        assert res.returncode == 0, res.stderr
        asked = list(model.requests)
        # The refine loop sent each failure back: first the missing JSON, then the null check.
        count_rounds = [r for r in asked if SEEDS["count"] in r["messages"][1]["content"]]
        assert len(count_rounds) == 3
        assert "no JSON object" in count_rounds[1]["messages"][-1]["content"]
        assert "`null fails`" in count_rounds[2]["messages"][-1]["content"]
        assert len([r for r in asked if SEEDS["broken"] in r["messages"][1]["content"]]) == 3

        report = json.loads((out / "report.json").read_text())
        assert report["funnel"] == {"seeds": 4, "drafted": 4, "exploit-free": 3, "built": 3,
                                    "reference passes": 2, "null fails": 2, "stable": 2,
                                    "distinct": 1, "kept": 1}
        assert report["rounds_to_keep"] == {"3": 1}
        reasons = {r["item"]: (r["step"], r["reason"])
                   for r in map(json.loads, (out / "rejections.jsonl").read_text().splitlines())}
        assert reasons["broken"][0] == "reference passes" and "after 3 drafts" in reasons["broken"][1]
        assert reasons["cheat"] == ("exploit-free", "after 3 drafts: the reference solution reads "
                                                    "or edits the verifier's files")
        assert reasons["dup"][0] == "distinct"

        tasks = load_taskset(out / "tasks.jsonl")
        assert [t.id for t in tasks] == ["count"]
        assert (out / "solutions" / "count.sh").read_text().startswith("wc -l")
        folder = out / "tasks" / "count"
        assert {p.name for p in folder.iterdir()} == {"task.yaml", "Dockerfile", "files",
                                                      "setup.sh", "run-tests.sh", "tests",
                                                      "solution.sh"}

        # A re-run asks the model nothing and reports the same funnel.
        again = kiln("synth", "terminal", "--seeds", str(seeds), "--model-url", model.url,
                     "--runs", "2", "--out", str(out))
        assert again.returncode == 0, again.stderr
        assert len(model.requests) == len(asked)
        assert json.loads((out / "report.json").read_text())["funnel"] == report["funnel"]

    verify = kiln("sandbox", "verify", str(out / "tasks.jsonl"), "--solutions",
                  str(out / "solutions"), "--null-fails")
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # The Terminal-Bench folders read back through the importer and re-verify there.
    back = tmp_path / "back"
    res = kiln("synth", "import", "terminal-bench", str(out / "tasks"), "--out", str(back))
    assert res.returncode == 0, res.stderr
    assert json.loads((back / "report.json").read_text())["funnel"]["kept"] == 1


@pytest.mark.slow  # about 17 s on the 2-core machine
def test_terminal_pages_and_model_down(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "sed.html").write_text("<html><head><title>Using sed</title><style>x{}</style>"
                                    "</head><body><h1>sed</h1><p>sed edits streams.</p></body>")
    (pages / "empty.md").write_text("")
    with ScriptedModel(lambda body: json_message(COUNT)) as model:
        res = kiln("synth", "terminal", "--pages", str(pages), "--model-url", model.url,
                   "--runs", "1", "--out", str(tmp_path / "out"))
        assert res.returncode == 0, res.stderr
        prompt = model.requests[0]["messages"][1]["content"]
        assert "'Using sed'" in prompt and "sed edits streams." in prompt and "x{}" not in prompt
    # Nothing listens any more: the seed is rejected with the reason, the run still exits 0.
    res = kiln("synth", "terminal", "--pages", str(pages), "--model-url", model.url,
               "--runs", "1", "--out", str(tmp_path / "down"))
    assert res.returncode == 0, res.stderr
    rejection = json.loads((tmp_path / "down" / "rejections.jsonl").read_text())
    assert rejection["step"] == "drafted" and "model error" in rejection["reason"]
    bad = kiln("synth", "terminal", "--seeds", str(tmp_path / "nope.txt"), "--model-url",
               model.url, "--out", str(tmp_path / "x"))
    assert bad.returncode == 1 and "nope.txt: no such file" in bad.stderr
