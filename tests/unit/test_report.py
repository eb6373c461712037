"""The run report: which steps it plots and the staleness histogram it draws."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.cli.local.report import steps_seen, write_report
from kiln.plots import staleness_histogram
from kiln.control import TrainerStatus
from kiln.control.driver import trainer_record
from kiln.metrics import StepMetrics


def _progress(stage: str, step: int, global_step: int, **metrics) -> dict:
    """A progress record as the driver writes it, read back from JSON as the report does."""
    status = TrainerStatus(step=global_step, stage=stage, stage_step=step, last_step=(
        StepMetrics(step=global_step, **metrics) if global_step else None))
    return json.loads(json.dumps({"event": "progress", "stage": stage, "step": step,
                                  "trainer": trainer_record(status),
                                  "rollout": {"mean_reward": 0.5}, "buffer": {"dropped_stale": 3}}))


def test_steps_and_staleness_histogram(tmp_path: Path) -> None:
    recs = [
        _progress("sft", 0, 0),                                   # nothing trained yet
        _progress("sft", 5, 5, loss=1.0),
        _progress("sft", 5, 5, loss=1.0),                          # the same step polled twice
        _progress("rl", 0, 5, loss=1.0),                           # trainer still shows SFT
        _progress("rl", 1, 6, reward_mean=0.2, staleness={0: 100, 1: 28}),
        _progress("rl", 1, 6, reward_mean=0.2, staleness={0: 100, 1: 28}),
        _progress("rl", 2, 7, reward_mean=0.4, staleness={1: 120, 2: 8}),
    ]
    seen = steps_seen(recs)
    assert [g for g, _ in seen] == [5, 6, 7]
    assert [r["stage"] for _, r in seen] == ["sft", "rl", "rl"]
    assert staleness_histogram(seen) == {0: 100.0, 1: 148.0, 2: 8.0}

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = write_report(tmp_path)
    assert {p.name for p in written} == {"loss.png", "reward.png", "masks.png", "mismatch.png",
                                         "staleness.png"}
    assert all(p.stat().st_size > 1000 for p in written)
    assert len(write_report(tmp_path, rl_stages={"rl"})) == 5


def test_summary_nests_evaluations_by_stage_and_averages_routing_flips(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kiln.api.spec import RLJob
    from kiln.cli.local.report import write_summary

    held = {"tasks": ["a-heldout", "b-heldout"], "before": False}
    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "chain"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": n, "env": "chain", "generate": {"count": 4}}
                           for n in ("a", "a-heldout", "b-heldout")],
                 "stages": [{"name": "skill-a", "type": "sft", "tasks": ["a"], "eval": held},
                            {"name": "skill-b", "type": "rl", "tasks": ["a"], "eval": held}]}})

    def ev(greedy: float) -> dict:
        return {"policy_version": 1, "tasks": 4, "greedy_success": greedy, "sampled_success": 0.1,
                "seconds": 1.0}

    state = SimpleNamespace(evaluations={
        "skill-a/after/a-heldout": ev(0.8), "skill-a/after/b-heldout": ev(0.1),
        "skill-b/after/a-heldout": ev(0.5), "skill-b/after/b-heldout": ev(0.7)})
    recs = [_progress("skill-b", 1, 11, routing_flip_frac=0.02), _progress("skill-b", 2, 12, routing_flip_frac=0.04)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = write_summary(job, tmp_path, state, wall_seconds=12.34)
    assert summary["evaluations"] == {"skill-a": {"a-heldout": 0.8, "b-heldout": 0.1},
                                      "skill-b": {"a-heldout": 0.5, "b-heldout": 0.7}}
    assert summary["evaluation_details"] == state.evaluations
    assert summary["routing_flip_frac_mean"] == 0.03 and summary["routing_flip_frac_max"] == 0.04
    assert json.loads((tmp_path / "summary.json").read_text())["wall_seconds"] == 12.3
    written = write_report(tmp_path, rl_stages={"skill-b"}, evaluations=summary["evaluations"])
    plot = tmp_path / "report" / "evaluations.png"
    assert plot in written and plot.stat().st_size > 1000


def test_teacher_scoring_cost_per_distillation_stage() -> None:
    from kiln.api.spec import RLJob
    from kiln.cli.local.report import teacher_scoring

    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "chain"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "a", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["a"]},
                            {"name": "opd", "type": "rl", "tasks": ["a"],
                             "rl": {"advantage": "opd", "teacher": "rl"}}]}})

    def rec(stage: str, t: float, seconds: float, scored: int, generated: int) -> dict:
        return {"event": "progress", "stage": stage, "time": t, "trainer": {},
                "rollout": {"teacher_seconds": seconds, "teacher_tokens": scored,
                            "tokens_generated": generated}}

    recs = [rec("rl", 0, 0, 0, 100), rec("rl", 5, 0, 0, 500),
            rec("opd", 10, 0, 0, 600), rec("opd", 30, 4.5, 9000, 2600), rec("opd", 40, 6.25, 12000, 3600)]
    assert teacher_scoring(job, recs) == {"opd": {"wait_seconds": 6.25, "tokens_scored": 12000,
                                                   "tokens_generated": 3000,
                                                   "stage_wall_seconds": 30.0}}


def test_summary_of_a_guarded_swarm_stage(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kiln.api.spec import RLJob
    from kiln.cli.local.report import write_summary

    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "swarm"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "w", "env": "wide", "generate": {"count": 4}},
                           {"name": "h", "env": "wide", "generate": {"count": 4, "split": "heldout"}}],
                 "stages": [{"name": "sft", "type": "sft", "tasks": ["w"]},
                            {"name": "swarm", "type": "rl", "tasks": ["w"], "swarm": {"subagents": "sft"},
                             "eval": {"tasks": ["h"], "every": 5, "select": {}}}]}})

    def ev(greedy: float, path: float, answered: float) -> dict:
        return {"policy_version": 1, "tasks": 4, "greedy_success": greedy, "sampled_success": 0.1,
                "seconds": 1.0, "critical_path_steps": path, "critical_path_steps_answered": answered}

    state = SimpleNamespace(
        evaluations={"swarm/before/h": ev(1.0, 17.0, 17.0), "swarm/after/h": ev(0.0, 9.0, 0.0)},
        selections={"swarm": {"step": 5, "reason": "highest greedy_success", "stopped": False}})
    summary = write_summary(job, tmp_path, state, wall_seconds=1.0)
    # Every episode ran out of turns: the all-episodes path "halved", the answered-only one says none answered.
    assert summary["critical_path_steps_after_rl"] == 9.0
    assert summary["critical_path_steps_after_rl_answered"] == 0.0
    assert summary["critical_path_steps_before_rl_answered"] == 17.0
    assert summary["selections"] == state.selections


def test_kiln_report_remakes_the_plots_of_a_recorded_run(tmp_path: Path, capsys) -> None:
    import yaml

    from kiln.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "r"},
           "spec": {"model": {"path": "m"},
                    "tasks": [{"name": n, "env": "chain", "generate": {"count": 4}} for n in ("a", "h")],
                    "stages": [{"name": "sft", "type": "sft", "tasks": ["a"]},
                               {"name": "rl", "type": "rl", "tasks": ["a"], "eval": {"tasks": ["h"]}}]}}
    (run / "job.yaml").write_text(yaml.safe_dump(job))
    recs = [_progress("sft", 1, 1, loss=2.0), _progress("sft", 2, 2, loss=1.5),
            _progress("rl", 1, 3, loss=0.1, reward_mean=0.25, staleness={0: 8}),
            _progress("rl", 2, 4, loss=0.05, reward_mean=0.5, staleness={1: 8})]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "state.json").write_text(json.dumps({"finished_stages": ["sft"], "evaluations": {
        "rl/after/h": {"greedy_success": 0.5, "sampled_success": 0.25}}}))
    (run / "report").mkdir()
    (run / "report" / "loss.png").write_text("stale")  # replaced, not kept
    assert main(["report", str(run)]) == 0
    names = {Path(line).name for line in capsys.readouterr().out.split()}
    assert {"loss.png", "reward.png", "masks.png", "mismatch.png", "staleness.png",
            "evaluations.png"} <= names
    assert all((run / "report" / n).stat().st_size > 1000 for n in names)

    (run / "metrics.jsonl").unlink()
    assert main(["report", str(run)]) == 1
    assert "metrics.jsonl: not there" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 1
    assert "job.yaml: not there" in capsys.readouterr().err


def test_the_trainers_own_report_from_its_step_log(tmp_path: Path) -> None:
    """On a cluster the trainer draws report/*.png for spec.output from its step log: each
    step once (a step taken again after a restart is the later record's), RL plots of the RL
    stages' steps only."""
    from kiln.api.spec import RLJob
    from kiln.plots import LINES
    from kiln.services.trainer.output import draw_report, logged_steps, record_step

    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "t"},
        "spec": {"model": {"path": "m"}, "tasks": [{"name": "a", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "sft", "type": "sft", "tasks": ["a"]},
                            {"name": "rl", "type": "rl", "tasks": ["a"]}]}})
    for step in (1, 2):
        record_step(tmp_path, "sft", StepMetrics(step=step, loss=2.0 / step))
    for step, loss in ((3, 0.5), (4, 0.4), (4, 0.3)):  # step 4 again after a restart
        record_step(tmp_path, "rl", StepMetrics(step=step, loss=loss, reward_mean=0.5, staleness={0: 4}))
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"stage": "rl", "trainer": {"st')  # cut short by a kill
    steps = logged_steps(tmp_path)
    assert [(x, r["stage"], r["trainer"]["loss"]) for x, r in steps] == [
        (1, "sft", 2.0), (2, "sft", 1.0), (3, "rl", 0.5), (4, "rl", 0.3)]
    assert staleness_histogram([s for s in steps if s[1]["stage"] == "rl"]) == {0: 8.0}
    out = draw_report(tmp_path, job)
    assert {p.name for p in out.iterdir()} == set(LINES) | {"staleness.png"}
    assert all(p.stat().st_size > 1000 for p in out.iterdir())
