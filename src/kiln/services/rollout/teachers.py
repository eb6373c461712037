"""A frozen model's scores on a finished group: on-policy distillation's teacher, or a
KL-penalised stage's reference (`ProducerConfig.opd_stages`).

The producer hands each group of such a stage to `add_teacher_logprobs` before shipping it: the
teacher's per-token log-probs of the sampled tokens go on each trajectory (`teacher_logp`), kept
on the trained tokens, and with dense distillation (`rl.teacherTopK`) its top k in each trained
place too. The trainer turns them into advantages (`kiln.services.trainer.advantages`) or a
penalty.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable

from kiln.services.common import metrics
from kiln.trajectory import Trajectory

#: Per-token log-probs of token sequences (a teacher's Score: `client.TeacherScorer`, whose
#: `topk` also gives the teacher's top k in each place).
Scorer = Callable[[list[list[int]]], Awaitable[list[list[float]]]]


async def add_teacher_logprobs(trajs: list[Trajectory], teacher: Scorer | None,
                               top_k: int = 0) -> tuple[float, int]:
    """Each trajectory's tokens scored by its task set's teacher; kept on the trained tokens
    (with `top_k`, also the teacher's top k in each trained place). Returns the seconds waited
    and the tokens scored: the cost of distillation."""
    if teacher is None:
        raise RuntimeError("an on-policy distillation stage needs a teacher (a KL-penalised "
                           "stage its reference) for each task set, and this rollout was "
                           "started without one for it")
    t0 = time.perf_counter()
    scored = (await teacher.topk([t.tokens for t in trajs], top_k) if top_k else
              [(row, [], []) for row in await teacher([t.tokens for t in trajs])])
    for t, (row, ids, lps) in zip(trajs, scored):
        t.teacher_logp = [lp if m else 0.0 for lp, m in zip(row, t.loss_mask)]
        if top_k:
            keep = [m for m in t.loss_mask for _ in range(top_k)]
            t.teacher_top_k = top_k
            t.teacher_topk_ids = [i if m else 0 for i, m in zip(ids, keep)]
            t.teacher_topk_logp = [lp if m else 0.0 for lp, m in zip(lps, keep)]
    seconds, tokens = time.perf_counter() - t0, sum(len(t.tokens) for t in trajs)
    metrics.TEACHER_SCORE_SECONDS.observe(seconds)
    metrics.TEACHER_SCORED_TOKENS.inc(tokens)
    return seconds, tokens
