"""The local tiny model's tokenizer: learned from the job's own episodes, with one token for
each tool call's opening and for the words an environment keeps whole."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import yaml
from transformers import AutoTokenizer

from kiln.api.validate import load_job
from kiln.cli.local.model import call_openers, prepare_model
from kiln.services.sandbox.environments.lookup import LookupEnvironment


def _job(tmp_path: Path, fmt: str) -> Path:
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "tok"},
           "spec": {"model": {"path": str(tmp_path / "model"), "init": {
               "hiddenSize": 64, "numLayers": 1, "numHeads": 2, "numKvHeads": 2,
               "intermediateSize": 128, "vocabSize": 400}},
               "tasks": [{"name": "t", "env": "lookup", "generate": {"count": 200, "numSteps": 3}}],
               "stages": [{"name": "sft", "type": "sft", "tasks": ["t"], "maxSteps": 1,
                           "batchSize": 2, "microBatchSize": 2}],
               "rollout": {"toolCallFormat": fmt}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_call_openings_and_numbers_are_single_tokens(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, "hermes"))
    env = LookupEnvironment()
    tasks = env.generate_tasks(SimpleNamespace(count=2, seed=1, split="train", num_steps=3))
    opener, closer = call_openers([(env, tasks)], "hermes")
    assert opener == '<tool_call>\n{"name": "bash", "arguments": {"command": "'
    assert closer == '"}}\n</tool_call>'
    prepare_model(job, out=open("/dev/null", "w"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    call = opener + "cat notes/37" + closer
    pieces = [tok.decode([i]) for i in tok.encode(call, add_special_tokens=False)]
    assert pieces[0] == opener and pieces[-1] == closer and "37" in pieces
    # The tokenizer decodes what it encodes, numbers and all.
    turns = env.demonstrate(tasks[0], random.Random(0))
    text = "".join(o for t in turns for o in t.outputs or [])
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
