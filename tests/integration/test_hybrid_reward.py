"""The general-RL example cut down: an SFT stage, then two RL steps whose reward adds the
verifier, three rules, an outcome model and a judge, with a KL penalty to the SFT weights. `kiln run` serves the SFT stage's final
weights as one frozen deployment (a rollout pinned to that checkpoint, loaded once the stage is
done) that scores (the outcome model, the KL reference) and generates (the judge).

Checked on the kept RL trajectories: every component is on the trajectory and the reward is
their weighted sum; the outcome model's score is what the SFT checkpoint itself gives (P(yes)
recomputed with transformers from the trajectory's own answer); and the summary and report
carry the components."""
from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from helpers.kiln_run import REPO, kiln_run, read_records

pytestmark = pytest.mark.slow


def test_general_rl_asks_a_served_outcome_model_and_judge(tmp_path):
    doc = yaml.safe_load((REPO / "deploy" / "examples" / "general-rl.yaml").read_text())
    doc["metadata"]["name"] = "hybrid-e2e"
    spec = doc["spec"]
    spec["model"]["path"] = str(tmp_path / "model")
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    spec["tasks"][0]["generate"]["count"] = 300
    spec["tasks"][1]["generate"]["count"] = 8
    sft, rl = spec["stages"]
    # Long enough for the tiny model to end episodes with answers the outcome model is asked about.
    sft.update(maxSteps=60, batchSize=16, microBatchSize=16, warmupSteps=0)
    rl.update(maxSteps=2, batchSize=16, microBatchSize=16)
    rl["rl"].update(groupSize=4, klCoef=0.05, reference="sft")  # a KL penalty to the same frozen weights
    spec["rollout"].update(maxConcurrentEpisodes=32, sampleEvery=1)
    spec["sandbox"]["maxConcurrent"] = 32
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    out = kiln_run(job, run)
    assert "starting services: buffer, sandbox, weight_sync, trainer, teacher, rollout" in out
    assert "waiting for" in (run / "logs" / "teacher.log").read_text()

    rules = spec["tasks"][0]["rewardRules"]
    samples = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    trained = [t for t in samples if t["stage"] == "rl"]
    assert trained, "no trajectory of the RL stage was kept"
    ended = [t for t in trained if "verifier" in t["reward_parts"]]
    assert ended, "no kept RL episode ended"
    # An episode cut off before it ended (turns or tokens ran out) is graded 0 and asks no model.
    assert all(t["reward"] == 0.0 and "orm" not in t["reward_parts"] for t in trained if t not in ended)
    for t in ended:
        p = t["reward_parts"]
        assert {"verifier", "rule/digits", "rule/short", "rule/form", "orm", "judge", "judge/parsed"} <= set(p)
        assert 0.0 < p["orm"] < 1.0 and 0.0 <= p["judge"] <= 1.0
        expected = (rules["verifierWeight"] * p["verifier"]
                    + sum(r["weight"] * p[f"rule/{r['name']}"] for r in rules["rules"])
                    + rules["outcomeModel"]["weight"] * p["orm"] + rules["judge"]["weight"] * p["judge"])
        assert t["reward"] == pytest.approx(expected)
    # Evaluations ask no reward model: their success is the verifier's.
    assert all("orm" not in t["reward_parts"] for t in samples if t["stage"] == "sft")

    # The outcome model's score, recomputed from the SFT checkpoint with transformers, for an
    # episode that ended with an answer (its prompt rebuilt from the trajectory's task).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.episode import EpisodeInfo, Message
    from kiln.services.rollout.formats import make_format
    from kiln.services.rollout.reward_models import orm_prompt, yes_probability

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    fmt = make_format("tags", tok)
    teacher = AutoModelForCausalLM.from_pretrained(str(run / "trainer" / "stages" / "sft"),
                                                   dtype=torch.float32).eval()
    checked = 0
    for t in [t for t in ended if t["reward_parts"].get("answered") == 1.0][:6]:
        text = tok.decode(t["tokens"], skip_special_tokens=False)
        task = re.search(r"<task>.*?</task>", text).group(0)
        # The format strips the answer before it is graded (" 4" is asked about as "4").
        answer = re.search(r"<answer>([^<]*)</answer>$", text).group(1).strip()
        prompt = fmt.conversation(EpisodeInfo("", "", "", [Message(
            "user", orm_prompt("Is the answer correct? Reply yes or no.", task, answer))], []))
        ids = prompt.prompt() + prompt.action_prefix()

        def logp(reply: str) -> float:
            seq = ids + tok.encode(reply, add_special_tokens=False)
            with torch.no_grad():
                logits = teacher(torch.tensor([seq])).logits[0, :-1].float()
            lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            return float(lps[len(ids) - 1:].sum())
        expected = yes_probability(logp("yes"), logp("no"))
        assert t["reward_parts"]["orm"] == pytest.approx(expected, rel=1e-3, abs=1e-9), answer
        checked += 1
    assert checked, "no kept RL episode ended with an answer (the SFT stage is too short)"

    # The KL penalty's reference is the same deployment: it scored every RL trajectory (its
    # log-probs of the trained tokens, vLLM vs transformers ~1e-5), and the trainer reports
    # the penalty's estimate.
    for t in trained[:4]:
        seq = t["tokens"]
        with torch.no_grad():
            logits = teacher(torch.tensor([seq])).logits[0, :-1].float()
        ref = [0.0, *torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()]
        assert len(t["teacher_logp"]) == len(seq)
        assert max(abs(a - b) for a, b, m in zip(t["teacher_logp"], ref, t["loss_mask"]) if m) < 1e-3
    kl = [r["trainer"].get("kl_ref") for r in read_records(run)
          if r.get("event") == "progress" and r.get("stage") == "rl"]
    assert any(v is not None for v in kl) and all(v is None or 0.0 <= v < 1.0 for v in kl)

    summary = json.loads((run / "summary.json").read_text())
    parts = summary["reward_parts"]["rl"]
    assert {"orm", "judge", "judge/parsed", "verifier", "rule/form"} <= set(parts)
    assert not math.isnan(parts["orm"])
    assert {"name": "rl", "type": "rl", "kind": "general"} in summary["stages"]
    assert (run / "report" / "reward_parts.png").stat().st_size > 0
