"""One RL step on each environment (terminal, swe, search, code, and the plugin example), end to
end with real processes: `kiln run` on a job with one RL stage per environment, a tiny local
model rendering its episodes with the chat template (hermes tool calls), every tool call in a
bubblewrap sandbox. The model is untrained, so its rewards are mostly 0; what must hold is that
each environment's episodes become trajectories that the buffer accepts and the trainer trains
on, with the prompt and every tool output masked out of the loss."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.trajectory import Trajectory, VersionSpan

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "deploy" / "examples" / "tasks"
ENVS = {"terminal": "terminal.jsonl", "swe": "swe.jsonl", "search": "search.jsonl",
        "code": "code.jsonl", "echo": "echo.jsonl"}

pytestmark = pytest.mark.slow


def _job(tmp: Path) -> Path:
    tasks = [{"name": n, "env": n if n != "echo" else {"plugin": "echo_env:EchoFileEnv"},
              "path": str(TASKS / f)} for n, f in ENVS.items()]
    tasks[-1]["reward"] = {"plugin": "echo_env:shorter_is_better"}
    stages = [{"name": f"{n}-rl", "type": "rl", "tasks": [n], "maxSteps": 1, "batchSize": 2,
               "microBatchSize": 2, "learningRate": 1e-4, "rl": {"groupSize": 2}} for n in ENVS]
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "envs-rl"},
        "spec": {
            "model": {"path": str(tmp / "model"), "dtype": "float32", "init": {
                "hiddenSize": 64, "numLayers": 1, "numHeads": 2, "numKvHeads": 1,
                "intermediateSize": 128, "vocabSize": 400, "maxPositionEmbeddings": 1024}},
            "tasks": tasks, "stages": stages,
            "rollout": {"toolCallFormat": "hermes", "maxTurns": 2, "sampleEvery": 1,
                        "maxConcurrentEpisodes": 8, "kvCacheBytes": 64 << 20,
                        "sampling": {"maxTokensPerTurn": 24, "maxTotalTokens": 900}},
            "sandbox": {"timeoutSeconds": 20, "maxConcurrent": 8}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def test_one_rl_step_on_every_environment(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "deploy" / "examples" / "plugins")}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(_job(tmp_path)),
                           "--run-dir", str(run)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_per_stage"] == {f"{n}-rl": 1 for n in ENVS}
    rows = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    by_stage: dict[str, list[Trajectory]] = {}
    for row in rows:
        stage = row.pop("stage")
        row["version_spans"] = [VersionSpan(**s) for s in row["version_spans"]]
        t = Trajectory(**row)
        t.check()
        by_stage.setdefault(stage, []).append(t)
    assert set(by_stage) == {f"{n}-rl" for n in ENVS}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    for stage, trajs in by_stage.items():
        name = stage.removesuffix("-rl")
        for t in trajs:
            assert t.env == ("echo_env:EchoFileEnv" if name == "echo" else name)
            prompt = tok.decode(t.tokens[:t.prompt_len], skip_special_tokens=False)
            assert prompt.startswith("<|im_start|>system\n") and "Tools:\n" in prompt
            assert prompt.endswith("<|im_start|>assistant\n")
            untrained = tok.decode([x for x, m in zip(t.tokens[t.prompt_len:], t.loss_mask[t.prompt_len:])
                                    if not m], skip_special_tokens=False)
            if "<|im_start|>tool\n" in untrained:  # an output (or an error) came back: masked
                assert untrained.count("<|im_start|>tool\n") <= untrained.count("<|im_end|>")
            assert 0.0 <= t.reward <= 1.0
    echo = by_stage["echo-rl"]
    assert all("verifier" in t.reward_parts and "length_penalty" in t.reward_parts for t in echo)
