"""pass@k from per-task success counts, and the `eval.json` that `kiln eval` writes.

pass@k is the chance that at least one of k attempts at a task succeeds, estimated without bias
from n >= k attempts of which c succeeded (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code"): 1 - C(n-c, k) / C(n, k), averaged over the tasks. The ratio of binomials is
taken as the product prod_{i=n-c+1..n} (1 - k/i), which neither overflows nor loses precision
for large n. Over tasks, pass@1 is the mean success rate of the sampled attempts (`mean@n`).

Pure and torch-free: the stage driver and `kiln eval` both use it. What it does not cover: the
attempts themselves (the rollout service's `Evaluate`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task attempted `n` times with `c` successes."""
    if not 0 <= c <= n:
        raise ValueError(f"successes: {c} is not between 0 and the {n} samples")
    if not 1 <= k <= n:
        # With fewer attempts than k there is no unbiased estimate: refuse rather than guess.
        raise ValueError(f"k: {k} must be between 1 and the {n} samples per task")
    if n - c < k:
        return 1.0  # every draw of k attempts holds a success
    miss_all = 1.0
    for i in range(n - c + 1, n + 1):
        miss_all *= 1.0 - k / i
    return 1.0 - miss_all


def ks_for(samples: int) -> list[int]:
    """The k reported for `samples` attempts per task: 1, 2, 4, ... up to `samples`."""
    if samples < 1:
        raise ValueError(f"samples: {samples} must be 1 or more")
    out, k = [], 1
    while k <= samples:
        out.append(k)
        k *= 2
    return out


@dataclass(frozen=True)
class TaskCount:
    """One task's attempts: `samples` sampled ones of which `successes` succeeded, and
    `greedy` (None: not run) whether its greedy attempt succeeded."""

    id: str
    samples: int
    successes: int
    greedy: bool | None = None


def pass_at_ks(tasks: Sequence[TaskCount]) -> dict[str, float]:
    """{str(k): pass@k averaged over `tasks`} for k = 1, 2, 4, ... up to their samples (all
    tasks must have the same number); {} for no tasks or no sampled attempts (greedy only)."""
    sizes = {t.samples for t in tasks}
    if not tasks or sizes == {0}:
        return {}
    if len(sizes) != 1:
        raise ValueError(f"samples: tasks were attempted {sorted(sizes)} times; pass@k "
                         "averages tasks attempted equally often")
    return {str(k): sum(pass_at_k(t.samples, t.successes, k) for t in tasks) / len(tasks)
            for k in ks_for(sizes.pop())}


def mean_at_n(tasks: Sequence[TaskCount]) -> float:
    """The success rate of all sampled attempts (mean@n); 0 for no tasks."""
    attempts = sum(t.samples for t in tasks)
    return sum(t.successes for t in tasks) / attempts if attempts else 0.0


def eval_report(tasks: Iterable[TaskCount], **metadata: Any) -> dict[str, Any]:
    """`eval.json`: `metadata` (model, job, task set, samples, ...), then `pass_at_k`,
    `mean_at_n`, `greedy` (the greedy success rate; None when no greedy attempt was made) and
    `tasks` ([{id, samples, successes, greedy}]), all derived from the per-task counts."""
    tasks = list(tasks)
    greedy = [t.greedy for t in tasks if t.greedy is not None]
    return {**metadata, "pass_at_k": pass_at_ks(tasks), "mean_at_n": mean_at_n(tasks),
            "greedy": sum(greedy) / len(greedy) if greedy else None,
            "tasks": [{"id": t.id, "samples": t.samples, "successes": t.successes,
                       "greedy": t.greedy} for t in tasks]}
