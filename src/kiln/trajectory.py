"""The trajectory record: what one agent episode produced, as every service sees it.

A trajectory is `y = (r1, a1, o1, ..., rn, an, on)` flattened into one token sequence (prompt
first). Each generated token carries the log-prob the inference engine assigned it and the policy
version it was sampled under; versions are stored as spans because weights change rarely within
an episode. Observation tokens (tool output) and prompt tokens have `loss_mask == 0`: they are
conditioned on, never trained on.

This module is the torch-free domain type. The wire format is `kiln.v1.Trajectory` in
`src/kiln/protos/kiln/v1/trajectory.proto`; `kiln.services.common.codec` converts between the two.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kiln.routing import RoutedExperts


@dataclass(frozen=True)
class VersionSpan:
    """Tokens `[start, end)` of a trajectory were generated under policy `policy_version`."""

    start: int
    end: int
    policy_version: int


@dataclass(frozen=True)
class ToolChoice:
    """Tokens drawn as choices (`rollout.sampling.toolChoiceTemperature`): the token at
    `positions[i]` was sampled from softmax(logits / temperatures[i]) over the `counts[i]`
    tokens that are its part of `token_ids` (the first tokens of the episode's tool names, or
    of a tool argument's enumerated values), not from the whole vocabulary. Its `logp_infer` is
    of that distribution, and the trainer computes the same there."""

    positions: list[int]
    token_ids: list[int]
    counts: list[int]
    temperatures: list[float]

    def sets(self) -> list[list[int]]:
        """The tokens each position was chosen among."""
        out, start = [], 0
        for n in self.counts:
            out.append(self.token_ids[start:start + n])
            start += n
        return out


@dataclass
class Trajectory:
    id: str
    task_id: str
    group_id: str
    tokens: list[int]
    loss_mask: list[int]
    """1 for tokens the policy generated and is trained on; 0 for prompt and observations."""
    logp_infer: list[float]
    """Per-token log-prob under the inference policy; 0.0 where loss_mask is 0."""
    version_spans: list[VersionSpan]
    """Cover every generated token (loss_mask == 1), in order, versions non-decreasing."""
    prompt_len: int = 0
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    verifier_output: str = ""
    flags: list[str] = field(default_factory=list)
    """E.g. "exploit" when a verifier detected tampering; flagged trajectories get reward 0."""
    env: str = ""
    sandbox_image_digest: str = ""
    engine_fingerprint: str = ""
    index_hashes: list[int] = field(default_factory=list)
    """Optional per-layer hash of DSA-selected indices, to detect rollout/training mismatch."""
    routed_experts: RoutedExperts | None = None
    """MoE models: the experts the inference engine routed each token to, for routing replay
    in the trainer (see `kiln.routing`)."""
    teacher_logp: list[float] = field(default_factory=list)
    """Optional per-token log-probs of a frozen model: the teacher's (on-policy distillation)
    or the reference's (a stage with a KL penalty, `rl.klCoef`)."""
    teacher_top_k: int = 0
    teacher_topk_ids: list[int] = field(default_factory=list)
    teacher_topk_logp: list[float] = field(default_factory=list)
    """Optional dense distillation (`rl.teacherTopK`): the teacher's `teacher_top_k` most
    likely tokens in place of each token and their log-probs, k entries per token (entry
    t*k+j); 0 where loss_mask is 0."""
    tool_choice: ToolChoice | None = None
    """Where the policy chose among tools at a temperature of its own (see `ToolChoice`)."""
    shaping_reward: float = 0.0
    shaping_mask: list[int] = field(default_factory=list)
    """Optional credit by turn, a generic per-token channel any feature may fill:
    `shaping_reward`, a part of `reward`, was earned by the tokens where `shaping_mask` is 1
    (the replies that did what it pays for), and the trainer puts its group-relative advantage
    on those tokens alone; the rest of the reward's advantage goes to every token
    (`kiln.services.trainer.advantages`). Empty: the whole reward is the episode's, on every
    token."""
    created_at: float = 0.0

    @property
    def group_key(self) -> str:
        """The key of the group whose mean reward is this trajectory's baseline (`group_key`)."""
        return group_key(self.group_id, self.id)

    @property
    def oldest_version(self) -> int:
        return min((s.policy_version for s in self.version_spans), default=0)

    @property
    def newest_version(self) -> int:
        return max((s.policy_version for s in self.version_spans), default=0)

    def to_dict(self) -> dict:
        """A JSON-ready dict (the JSONL form `kiln trajectories` and `kiln serve` write)."""
        out = dataclasses.asdict(self)
        out["routed_experts"] = self.routed_experts.to_dict() if self.routed_experts else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in data.items() if k in fields}
        kept["version_spans"] = [VersionSpan(**s) for s in kept.get("version_spans", [])]
        routed = kept.get("routed_experts")
        kept["routed_experts"] = RoutedExperts.from_dict(routed) if isinstance(routed, dict) else None
        choice = kept.get("tool_choice")
        kept["tool_choice"] = ToolChoice(**choice) if isinstance(choice, dict) else None
        return cls(**kept)

    def reply_spans(self) -> list[tuple[int, int]]:
        """`[start, end)` of each stretch of generated tokens (loss_mask 1), in order: in an
        agent loop's trajectory, one per reply (prompt, framing and observations between them
        have loss mask 0)."""
        spans, start = [], None
        for i, m in enumerate(self.loss_mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        return spans

    def versions_per_token(self) -> list[int]:
        """The policy version of every token; -1 for tokens not generated (prompt/observation)."""
        out = [-1] * len(self.tokens)
        for span in self.version_spans:
            for i in range(span.start, span.end):
                out[i] = span.policy_version
        return out

    def check(self) -> None:
        """Raise ValueError if the record cannot be trained on (a bug upstream; retrying the
        same record does not help). The buffer calls this once, when a trajectory arrives;
        everything downstream of the buffer relies on it."""
        n = len(self.tokens)
        if not self.id:
            raise ValueError("trajectory id is empty")
        if n == 0:
            raise ValueError(f"trajectory {self.id}: tokens is empty")
        if len(self.loss_mask) != n or len(self.logp_infer) != n:
            raise ValueError(
                f"trajectory {self.id}: tokens ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"logp_infer ({len(self.logp_infer)}) must have the same length"
            )
        if self.shaping_mask and (len(self.shaping_mask) != n or any(
                s and not m for s, m in zip(self.shaping_mask, self.loss_mask))):
            raise ValueError(f"trajectory {self.id}: shaping_mask has {len(self.shaping_mask)} "
                             f"entries, tokens {n}; it must mark generated tokens only")
        # A non-finite reward (or part of one) makes the advantages of its group, and the
        # loss, NaN; `reward` itself is checked below.
        for name, value in (("shaping_reward", self.shaping_reward),
                            *((f"reward_parts[{k!r}]", v) for k, v in self.reward_parts.items())):
            if not math.isfinite(value):
                raise ValueError(f"trajectory {self.id}: {name} is {value}")
        if self.teacher_logp and len(self.teacher_logp) != n:
            raise ValueError(f"trajectory {self.id}: teacher_logp has {len(self.teacher_logp)} "
                             f"entries, tokens {n}")
        k = self.teacher_top_k
        if (k or self.teacher_topk_ids or self.teacher_topk_logp) and not (
                len(self.teacher_topk_ids) == len(self.teacher_topk_logp) == n * k > 0):
            raise ValueError(f"trajectory {self.id}: teacher top-k has {len(self.teacher_topk_ids)} "
                             f"ids and {len(self.teacher_topk_logp)} log-probs; {n} tokens x k={k} "
                             "expected")
        if self.routed_experts is not None:
            r = self.routed_experts
            if r.start < 0 or r.end > n:
                raise ValueError(f"trajectory {self.id}: routed experts cover positions [{r.start}, {r.end}), "
                                 f"the trajectory has {n} tokens")
            r.check_size()
        if (c := self.tool_choice) is not None:
            if not (len(c.counts) == len(c.temperatures) == len(c.positions)
                    and sum(c.counts) == len(c.token_ids) and all(k > 0 for k in c.counts)
                    and all(t > 0 for t in c.temperatures)):
                raise ValueError(f"trajectory {self.id}: tool choice with {len(c.positions)} "
                                 f"positions, {len(c.counts)} counts, {len(c.temperatures)} "
                                 f"temperatures and {len(c.token_ids)} tokens; a non-empty set "
                                 "and a positive temperature per position expected")
            for i, allowed in zip(c.positions, c.sets()):
                if not (0 < i < n and self.loss_mask[i]) or self.tokens[i] not in allowed:
                    raise ValueError(f"trajectory {self.id}: tool choice at position {i} is not a "
                                     "generated token among its choices")
        if self.loss_mask[0]:
            raise ValueError(f"trajectory {self.id}: loss_mask[0] is 1, but the first token has "
                             "no context to be predicted from")
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory {self.id}: reward is {self.reward}")
        covered = [False] * n
        last_version = -1
        last_end = 0
        for span in self.version_spans:
            if not (0 <= span.start < span.end <= n) or span.start < last_end:
                raise ValueError(f"trajectory {self.id}: version span {span} out of order or range")
            if span.policy_version < last_version:
                raise ValueError(f"trajectory {self.id}: version spans go backwards at {span}")
            last_version, last_end = span.policy_version, span.end
            for i in range(span.start, span.end):
                covered[i] = True
        for i, m in enumerate(self.loss_mask):
            if m and not covered[i]:
                raise ValueError(f"trajectory {self.id}: generated token {i} has no policy version")


def group_key(group_id: str, trajectory_id: str) -> str:
    """The G samples of one task share their group id; a trajectory without one is a group of
    its own (SFT data, group size 1). The NUL prefix keeps such keys apart from any real group
    id. The buffer forms groups by this key, and the trainer takes their advantages over it."""
    return group_id if group_id else "\0" + trajectory_id


def spans_from_versions(versions: list[int]) -> list[VersionSpan]:
    """Compress a per-token version list (-1 = not generated) into spans."""
    spans: list[VersionSpan] = []
    start = None
    cur = None
    for i, v in enumerate(versions + [-2]):
        if v != cur:
            if cur is not None and cur >= 0:
                spans.append(VersionSpan(start, i, cur))
            start, cur = i, v
    return spans
