"""`kiln run` end to end: every service a real process, the real engines, a cut-down job with
two data-parallel trainer replicas.

Mid-way through the RL stage the buffer is killed with SIGKILL; the launcher restarts it on the
same port and run directory. Afterwards the run's records must show:
- every trained trajectory's staleness within tau (the buffer serves nothing staler);
- version spans of every kept trajectory monotonic and covering every generated token;
- loss masks that exclude the prompt and every observation;
- nothing the buffer acknowledged lost across the kill (its accepted count, recovered from its
  log, never falls behind what rollout saw acknowledged);
- a summary with held-out success before and after RL;
- `final-hf/`, the last stage's weights as a Hugging Face checkpoint transformers loads, and
  each stage's own under trainer/stages/;
- TensorBoard event files under the run directory, from the trainer (step metrics) and the
  driver (rollout, buffer, evaluations), read back with TensorBoard's own reader.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kiln.trajectory import Trajectory, VersionSpan

from helpers.kiln_run import REPO, TAU, cut_down_job, kiln_run, read_records


pytestmark = pytest.mark.slow


def test_kiln_run_end_to_end_with_a_buffer_kill(tmp_path):
    job, run = cut_down_job(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    killed = False
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            if not killed and any(r.get("stage") == "rl" and r.get("step", 0) >= 2 for r in read_records(run)):
                pid = json.loads((run / "buffer" / "ports.json").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed = True
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert killed, "the RL stage never reached step 2"
    assert proc.returncode == 0, out[-4000:]
    assert "buffer exited with code -9; restarting" in out

    # The buffer's files after a SIGKILL and a finished run: every record verifies.
    check = subprocess.run([sys.executable, "-m", "kiln.cli", "buffer", "check", str(run / "buffer")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    # mTLS: every service had its own certificate of the run's CA (frozen models: `teacher`).
    assert {p.name for p in (run / "tls").iterdir()} == {"trainer", "rollout", "sandbox", "weight-sync",
                                                          "buffer", "operator", "teacher"}
    assert (run / "trainer-replica-1" / "ports.json").exists()
    assert not (run / "trainer-replica-1" / "checkpoints").exists()  # replica 0 keeps them
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 + 6
    assert summary["final_policy_version"] >= 7  # one after SFT, one per RL step (syncInterval 1)
    assert 0 <= summary["heldout_success_before_rl"] <= 1
    assert 0 <= summary["heldout_success_after_rl"] <= 1
    assert summary["max_staleness"] <= TAU
    # Every evaluation episode is kept, and its greedy ones are the reported greedy success.
    evals = [json.loads(line) for line in (run / "rollout" / "evaluations.jsonl").read_text().splitlines()]
    for when in ("before", "after"):
        detail = summary["evaluation_details"][f"rl/{when}/chain-heldout"]
        greedy = [e for e in evals if e["temperature"] == 0 and e["version"] == detail["policy_version"]]
        assert len(greedy) == detail["tasks"] and {e["stage"] for e in greedy} == {"eval/chain-heldout"}
        assert sum(e["reward"] >= 1 for e in greedy) / len(greedy) == detail["greedy_success"]

    records = read_records(run)
    assert any(r.get("event") == "restart" and r["services"] == ["buffer"] for r in records)
    progress = [r for r in records if r.get("event") == "progress"]
    # Rollout's status is read before the buffer's in each poll: the buffer must always have
    # accepted at least what rollout saw acknowledged, before and after the kill.
    assert progress
    for r in progress:
        assert r["buffer"]["accepted"] >= r["rollout"]["shipped"], r
        assert r["buffer"]["max_staleness"] <= TAU

    rows = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == {"sft", "rl"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    stops = {tok.convert_tokens_to_ids(s) for s in ("</call>", "</answer>")}
    for row in rows:
        row.pop("stage")
        row["version_spans"] = [VersionSpan(**s) for s in row["version_spans"]]
        t = Trajectory(**row)
        t.check()  # spans in order, non-decreasing, covering every generated token
        assert not any(t.loss_mask[: t.prompt_len])
        # After the prompt, the sequence alternates: an action (trained on, generated by the
        # policy, ending at a stop tag unless it is the last) and the environment's observation
        # (never trained on, exactly one <obs>...</obs>).
        runs: list[tuple[int, list[int]]] = []
        for token, mask in zip(t.tokens[t.prompt_len:], t.loss_mask[t.prompt_len:]):
            if runs and runs[-1][0] == mask:
                runs[-1][1].append(token)
            else:
                runs.append((mask, [token]))
        for i, (mask, tokens) in enumerate(runs):
            if mask == 0:
                text = tok.decode(tokens, skip_special_tokens=False)
                assert text.startswith("<obs>") and text.endswith("</obs>") and text.count("<obs>") == 1, text
                assert runs[i - 1][0] == 1 and runs[i - 1][1][-1] in stops
        versions = [v for v in t.versions_per_token() if v >= 0]
        assert versions == sorted(versions)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, list] = {}
    for events in sorted(run.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.setdefault(tag, []).extend(acc.Scalars(tag))
    for tag in ("train/loss", "train/grad_norm", "train/lr", "train/reward_mean",
                "train/ratio_mask_frac", "train/icepop_mask_frac", "train/mismatch_abs",
                "train/mismatch_kl", "train/staleness_max", "train/tokens_per_second",
                "rollout/mean_reward", "rollout/tokens_per_second", "buffer/depth",
                "eval/chain-heldout/greedy_success", "eval/chain-heldout/sampled_success"):
        assert tags.get(tag), f"no {tag} in the run's TensorBoard events ({sorted(tags)})"
    # Every optimizer step of both stages, once (the trainer restarts nothing here).
    assert sorted(e.step for e in tags["train/loss"]) == list(range(1, 8 + 6 + 1))
    assert max(e.value for e in tags["train/staleness_max"]) <= TAU

    from transformers import AutoModelForCausalLM

    assert {p.name for p in (run / "trainer" / "stages").iterdir()} == {"sft", "rl"}
    final = AutoModelForCausalLM.from_pretrained(str(run / "final-hf"))
    assert final.config.vocab_size == len(tok)


def test_kiln_run_distils_from_two_served_teachers(tmp_path):
    """An RL stage with `advantage: opd` and a teacher per task set: the SFT stage before it for
    one (its final weights, loaded once they exist) and the initial checkpoint for the other.
    kiln run starts a teacher process for each (the rollout service, Score only); rollout ships
    every trajectory of the distillation stage with its own task set's teacher's per-token
    log-probs on its trained tokens, and the trainer trains on them."""
    job = cut_down_job(tmp_path)
    doc = yaml.safe_load(job.read_text())
    spec = doc["spec"]
    spec["trainer"]["dataParallel"] = 1
    spec["rollout"]["sampleEvery"] = 1  # keep every trajectory: both task sets are checked
    spec["tasks"].append({"name": "chain-b", "env": "chain", "generate": {"count": 300, "seed": 5}})
    sft, rl = spec["stages"]
    sft["maxSteps"] = 4
    rl.update(maxSteps=3, name="distil", tasks=["chain-train", "chain-b"])
    rl["rl"].update(advantage="opd", teachers=[{"teacher": sft["name"], "tasks": ["chain-train"]},
                                                {"teacher": spec["model"]["path"], "tasks": ["chain-b"]}],
                    teacherTopK=4)  # dense distillation too
    rl.pop("eval", None)
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    out = kiln_run(job, run)
    assert "starting services: buffer, sandbox, weight_sync, trainer, teacher, teacher_1, rollout" in out
    samples = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    distilled = [t for t in samples if t["stage"] == "distil"]
    assert distilled, "no trajectory of the distillation stage was kept"
    import torch
    from transformers import AutoModelForCausalLM

    teachers = {"chain-train": run / "trainer" / "stages" / "sft", "chain-b": Path(spec["model"]["path"])}
    models = {k: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
              for k, d in teachers.items()}

    def logprobs(model, tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].float()
        return [0.0, *torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()]

    def check_topk(model, t):
        """The teacher's top 4 in each trained place, as transformers ranks them (up to
        vLLM-vs-transformers noise: a near tie may come in either order)."""
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([t["tokens"]])).logits[0, :-1].float(), -1)
        k = t["teacher_top_k"]
        assert k == 4 and len(t["teacher_topk_ids"]) == len(t["tokens"]) * k
        for pos, m in enumerate(t["loss_mask"]):
            ids = t["teacher_topk_ids"][pos * k:(pos + 1) * k]
            lps = t["teacher_topk_logp"][pos * k:(pos + 1) * k]
            if not m:
                assert ids == [0] * k and lps == [0.0] * k
                continue
            row = full[pos - 1]
            assert max(abs(row[i].item() - lp) for i, lp in zip(ids, lps)) < 1e-3
            assert lps == sorted(lps, reverse=True) and min(lps) > row.topk(k).values[-1].item() - 1e-3

    seen = set()
    for t in distilled:
        # The chain environment's task ids are chain-<split>-<seed>-<index>; chain-b's seed is 5.
        task_set = "chain-b" if t["task_id"].split("-")[2] == "5" else "chain-train"
        seen.add(task_set)
        lp, mask = t["teacher_logp"], t["loss_mask"]
        assert len(lp) == len(t["tokens"])
        assert all(v == 0.0 for v, m in zip(lp, mask) if not m)
        # Its own task set's teacher scored it (vLLM vs transformers: ~1e-5), not the other.
        for name, model in models.items():
            ref = logprobs(model, t["tokens"])
            gap = max(abs(a - b) for a, b, m in zip(lp, ref, mask) if m)
            assert (gap < 1e-3) == (name == task_set), (task_set, name, gap)
        check_topk(models[task_set], t)
    assert seen == {"chain-train", "chain-b"}
    assert all(not t["teacher_logp"] for t in samples if t["stage"] != "distil")
    assert "waiting for" in (run / "logs" / "teacher.log").read_text()
    assert "waiting for" not in (run / "logs" / "teacher_1.log").read_text()
    steps = [r for r in read_records(run) if r.get("stage") == "distil"]
    assert steps and max(r.get("step", 0) for r in steps) >= 3
    assert any((r["trainer"].get("dense_kl") or 0) > 0 for r in steps)


def test_kiln_run_trains_a_swarm_orchestrator_with_frozen_subagents(tmp_path):
    """The swarm example cut down: an SFT stage on both roles, two RL steps with PARL. kiln run
    serves the SFT stage's final weights as the subagents' teacher process (pinned to them);
    the orchestrator's trajectories carry PARL's parts and the swarm measurements, their loss
    masks cover no subagent output, and the summary holds critical-path steps and success
    before and after RL."""
    doc = yaml.safe_load((REPO / "deploy" / "examples" / "swarm.yaml").read_text())
    spec = doc["spec"]
    doc["metadata"]["name"] = "swarm-e2e"
    spec["model"]["path"] = str(tmp_path / "model")
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    for t in spec["tasks"]:
        t["generate"]["count"] = 8 if "heldout" in t["name"] else 200
    sft, rl = spec["stages"]
    sft.update(maxSteps=4, batchSize=8, microBatchSize=8, warmupSteps=0)
    rl.update(maxSteps=2, batchSize=8, microBatchSize=8)
    rl["rl"]["groupSize"] = 4
    rl["swarm"]["maxCriticalSteps"] = 9  # binds training episodes, not evaluations
    rl["swarm"].pop("maxCriticalStepsStart", None)  # from the first step
    spec["rollout"]["sampleEvery"] = 1
    spec["sandbox"]["maxConcurrent"] = 32
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    out = kiln_run(job, run)
    assert "starting services: buffer, sandbox, weight_sync, trainer, teacher, rollout" in out
    assert "waiting for" in (run / "logs" / "teacher.log").read_text()
    samples = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    swarm = [t for t in samples if t["stage"] == "swarm"]
    assert swarm, "no trajectory of the swarm stage was kept"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    tool_choices = 0
    for t in swarm:
        parts = t["reward_parts"]
        assert {"parl/parallel", "parl/finish", "parl/perf", "parl/total", "swarm/subagents",
                "swarm/refused", "swarm/critical_path_steps", "swarm/total_steps"} <= set(parts)
        assert t["reward"] == pytest.approx(parts["parl/total"])
        assert parts["swarm/critical_path_steps"] <= parts["swarm/total_steps"]
        # No orchestrator call past the budget: an episode whose next one would pass it ended
        # there, unanswered; any other stayed within it.
        if parts["swarm/over_budget"]:
            assert "critical_path_budget" in t["flags"] and parts["parl/perf"] == 0.0
        else:
            assert parts["swarm/critical_path_steps"] <= 9
        # Subagent answers come back in `wait`'s observation: the orchestrator trains on its own
        # replies only (at most maxTurns x maxTokensPerTurn tokens), and every untrained stretch
        # after the prompt is one whole observation.
        traj = Trajectory.from_dict(t)
        traj.check()  # a recorded tool choice is a generated token among its choices
        assert sum(traj.loss_mask) <= 10 * spec["rollout"]["sampling"]["maxTokensPerTurn"]
        # Tool choices (toolChoiceTemperature): every generated token right after a generated
        # `<call>` (the tool's name) was sampled among the tools' names at the job's tool-choice
        # temperature; a reply's first token (call or answer) among its own, at the job's
        # temperature.
        call = tok.convert_tokens_to_ids("<call>")
        after_call = [i for i in range(1, len(traj.tokens)) if traj.loss_mask[i]
                      and traj.loss_mask[i - 1] and traj.tokens[i - 1] == call]
        starts = [i for i in range(1, len(traj.tokens)) if traj.loss_mask[i]
                  and not traj.loss_mask[i - 1]]
        choice = traj.tool_choice
        chosen = dict(zip(choice.positions, choice.temperatures)) if choice else {}
        assert all(chosen.get(i) == spec["rollout"]["sampling"]["toolChoiceTemperature"]
                   for i in after_call)
        assert all(chosen.get(i) == spec["rollout"]["sampling"]["temperature"] for i in starts)
        tool_choices += len(after_call)
        masked, stretch = [], []
        for token, mask in zip(traj.tokens[traj.prompt_len:], traj.loss_mask[traj.prompt_len:]):
            if mask:
                if stretch:
                    masked.append(stretch)
                stretch = []
            else:
                stretch.append(token)
        for stretch in masked:
            # With thinking off, every reply follows an empty thought it did not write.
            # (the first reply's alone, after the prompt).
            text = tok.decode(stretch, skip_special_tokens=False).removesuffix("<think></think>")
            assert text == "" and stretch is masked[0] or (
                text.startswith("<obs>") and text.endswith("</obs>")), text
    assert tool_choices > 0  # 7 over the 84 kept trajectories when this was written
    # The before-evaluation starts as soon as the subagents' checkpoint exists, while their
    # process may still be loading it: its episodes wait for it, and no subagent call fails.
    evals = [json.loads(line) for line in (run / "rollout" / "evaluations.jsonl").read_text().splitlines()]
    assert len({e["version"] for e in evals}) == 2  # before and after RL
    failed = [e for e in evals
              if re.search(r"s\d+: error", tok.decode(e["tokens"], skip_special_tokens=False))]
    assert not failed, tok.decode(failed[0]["tokens"], skip_special_tokens=False)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("heldout_success_before_rl", "heldout_success_after_rl",
                "critical_path_steps_before_rl", "critical_path_steps_after_rl",
                "critical_path_steps_after_rl_answered"):
        assert isinstance(summary[key], (int, float)), key
    assert summary["critical_path_steps_before_rl"] >= 1
