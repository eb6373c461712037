"""pass@k (`kiln.evaluation`), eval.json from per-task counts, and the per-task counts rollout's
Evaluate returns and carries over the wire."""
from __future__ import annotations

import asyncio
import itertools
import math
from types import SimpleNamespace

import pytest

from kiln.control import wire
from kiln.control.records import Evaluation
from kiln.evaluation import TaskCount, eval_report, ks_for, mean_at_n, pass_at_k, pass_at_ks


def _by_enumeration(n: int, c: int, k: int) -> float:
    """The definition itself: the share of the k-subsets of the n attempts holding a success."""
    attempts = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(attempts, k))
    return sum(any(d) for d in draws) / len(draws)


@pytest.mark.parametrize("n,c,k,expected", [
    (2, 1, 1, 0.5), (2, 1, 2, 1.0), (4, 1, 2, 0.5), (10, 3, 5, 1 - 21 / 252),
    (8, 2, 4, 1 - 15 / 70), (5, 0, 3, 0.0), (5, 5, 1, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_known_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_the_definition_and_the_binomial_form():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = _by_enumeration(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
                assert want == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_1_is_the_success_rate_and_pass_at_k_rises_with_k():
    for n, c in [(8, 0), (8, 1), (8, 5), (8, 8), (200, 7), (1000, 999)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
        assert all(0.0 <= v <= 1.0 for v in values)


def test_edge_cases_and_refusals():
    assert pass_at_k(16, 0, 16) == 0.0  # never solved: no k helps
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 9, 8) == 1.0  # fewer failures than k: every draw holds a success
    # Large n stays finite and exact where binomials would overflow a float.
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="k: 4 must be between 1 and the 2 samples"):
        pass_at_k(2, 1, 4)
    with pytest.raises(ValueError, match="k: 0"):
        pass_at_k(2, 1, 0)
    with pytest.raises(ValueError, match="successes: 3"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="samples: 0"):
        ks_for(0)
    assert ks_for(1) == [1] and ks_for(8) == [1, 2, 4, 8] and ks_for(12) == [1, 2, 4, 8]


def test_eval_json_follows_from_its_counts():
    tasks = [TaskCount("a", 8, 0, False), TaskCount("b", 8, 3, True), TaskCount("c", 8, 8, True),
             TaskCount("d", 8, 1, False)]
    report = eval_report(tasks, model="m", job="j.yaml", task_set="held", samples=8)
    assert list(report)[:4] == ["model", "job", "task_set", "samples"]
    assert set(report["pass_at_k"]) == {"1", "2", "4", "8"}
    for k, value in report["pass_at_k"].items():
        assert value == pytest.approx(sum(pass_at_k(8, t.successes, int(k)) for t in tasks) / 4)
    assert report["pass_at_k"]["1"] == pytest.approx(report["mean_at_n"]) == pytest.approx(12 / 32)
    assert report["pass_at_k"]["8"] == pytest.approx(3 / 4)  # b, c and d were ever solved
    values = list(report["pass_at_k"].values())
    assert values == sorted(values)
    assert report["greedy"] == 0.5
    assert report["tasks"][1] == {"id": "b", "samples": 8, "successes": 3, "greedy": True}
    assert eval_report([], samples=4)["greedy"] is None and pass_at_ks([]) == {}
    assert pass_at_ks([TaskCount("a", 0, 0, True)]) == {}  # greedy only: no pass@k
    assert mean_at_n([]) == 0.0
    with pytest.raises(ValueError, match="samples: tasks were attempted"):
        pass_at_ks([TaskCount("a", 2, 1), TaskCount("b", 4, 1)])


def test_evaluate_counts_each_tasks_own_attempts():
    """Rollout's Evaluate (the real producer method; the episodes are scripted) counts task i's
    sampled attempts as task i's, whatever order they finish in."""
    from kiln.services.rollout.engine import SamplingOptions
    from kiln.services.rollout.producer import Producer
    from kiln.trajectory import Trajectory

    calls: dict[int, int] = {}
    solved = [4, 0, 3, 1, 2]
    seen: list[tuple[int, int]] = []  # the status's (tasks done, tasks) as each episode starts

    async def episode(stage, *, task_set, index, sampling, limits):
        # Task i solves its first solved[i] sampled attempts and its greedy one when i is
        # even; later tasks answer first, so completion order differs from task order.
        seen.append(producer.eval_progress)
        await asyncio.sleep(0.001 * (5 - index))
        if sampling.temperature == 0.0:
            reward = float(index % 2 == 0)
        else:
            calls[index] = calls.get(index, 0) + 1
            reward = float(calls[index] <= solved[index])
        return [Trajectory(id="", task_id=f"t{index}", group_id="", tokens=[1], loss_mask=[1],
                           logp_infer=[0.0], version_spans=[], reward=reward)]

    producer = SimpleNamespace(
        config=SimpleNamespace(max_concurrent=8, sampling=SamplingOptions(temperature=1.0),
                               limits=None),
        extensions={}, engine=SimpleNamespace(policy_version=2), _episode=episode,
        samples=SimpleNamespace(keep_evaluation=lambda *args: None))
    n, greedy, sampled, _, _, counts = asyncio.run(
        Producer.evaluate(producer, "held", 5, max_tasks=0, samples=4, greedy=True))
    assert (n, greedy, sampled) == (5, 0.6, sum(solved) / 20)
    assert counts == [TaskCount(f"t{i}", 4, solved[i], i % 2 == 0) for i in range(5)]
    # Tasks finish one after another while the evaluation runs (played task by task, 8 at a
    # time: the last task starts after the first ones are done); none is shown once it ended.
    assert seen[0] == (0, 5) and all(total == 5 for _, total in seen)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1][0] >= 1
    assert producer.eval_progress == (0, 0)


def test_task_counts_cross_the_wire():
    ev = Evaluation(3, 2, 0.5, 0.25, 1.0, task_counts=[TaskCount("a", 4, 1, True),
                                                        TaskCount("b", 4, 0, False),
                                                        TaskCount("c", 4, 2, None)])
    assert wire.evaluation_from_proto(wire.evaluation_to_proto(ev)) == ev


def test_eval_job_swaps_in_the_checkpoint(tmp_path):
    from pathlib import Path

    from kiln.cli.local.evaluation import eval_job, load, refusals

    quickstart = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "quickstart.yaml"
    job = load(quickstart, err=None)
    (tmp_path / "config.json").write_text("{}")
    assert refusals(job, tmp_path, "chain-heldout", 8) == []
    ev = eval_job(job, tmp_path)
    assert ev.spec.model.path == str(tmp_path.resolve()) and ev.spec.model.init is None
    assert ev.spec.rollout.sampling == job.spec.rollout.sampling
    problems = refusals(job, tmp_path / "none", "chain-nope", 0)
    assert [p.split(":")[0] for p in problems] == ["MODEL_DIR", "--task-set", "--samples"]


def test_summary_carries_pass_at_k_before_and_after_rl(tmp_path):
    from pathlib import Path

    from kiln.cli.local.evaluation import load
    from kiln.cli.local.report import write_summary

    quickstart = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "quickstart.yaml"
    job = load(quickstart, err=None)

    def recorded(successes: list[int]) -> dict:
        counts = [TaskCount(str(i), 4, c, c > 0) for i, c in enumerate(successes)]
        return Evaluation(1, len(counts), 0.5, mean_at_n(counts), 1.0, task_counts=counts).recorded()

    state = SimpleNamespace(evaluations={"rl/before/chain-heldout": recorded([0, 1, 4]),
                                         "rl/after/chain-heldout": recorded([2, 4, 4])})
    summary = write_summary(job, tmp_path, state, wall_seconds=1.0)
    before = state.evaluations["rl/before/chain-heldout"]["pass_at_k"]
    assert summary["heldout_pass_at_k_before_rl"] == before
    assert summary["heldout_pass_at_k_after_rl"]["1"] == pytest.approx(10 / 12)
    assert summary["heldout_pass_at_k_after_rl"]["4"] == 1.0
