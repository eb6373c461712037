"""Freshness control's one rule, which every place that applies it calls.

A group of trajectories is as old as its oldest token: sampled at policy version `oldest`, it
is `V - oldest` versions behind a trainer at version V (its staleness), and stale once that is
more than the stage's bound tau. `tau=None` is no bound (SFT stages). The buffer drops stale
groups and serves none (`kiln.services.buffer`), rollout stops a group's episodes once their
group is stale (`kiln.services.rollout.producer`), and `kiln simulate` models both.
"""
from __future__ import annotations


def staleness(policy_version: int, oldest_version: int) -> int:
    """Versions between the trainer's `policy_version` and the group's oldest token."""
    return policy_version - oldest_version


def is_stale(policy_version: int, oldest_version: int, tau: int | None) -> bool:
    """True once the group can no longer be trained: more than `tau` versions behind."""
    return tau is not None and staleness(policy_version, oldest_version) > tau
