"""The rollout service's data-plane messages as they cross the wire: scoring (a teacher's or a
reward model's Score) and generation (a frozen deployment's Generate), used by the servicer and
the clients alike. Its control messages (mode, status, evaluations) are the control floor's
(`kiln.control.wire`)."""
from __future__ import annotations

from collections.abc import Sequence

from kiln.protos.kiln.v1 import rollout_pb2

__all__ = ["MAX_SCORE_TOKENS", "MAX_TOP_K", "generate_request", "sampling_from_proto",
           "score_request", "score_response", "sequences_from_proto"]

#: Tokens one Score call may carry in all: about 4 MiB of ids, and a bound on the work one
#: caller can ask for at once.
MAX_SCORE_TOKENS = 1 << 20


#: The most tokens a Score call may ask for in each place (`top_k`).
MAX_TOP_K = 64


def score_request(sequences: Sequence[Sequence[int]], top_k: int = 0) -> rollout_pb2.ScoreRequest:
    return rollout_pb2.ScoreRequest(
        sequences=[rollout_pb2.TokenSequence(token_ids=list(s)) for s in sequences], top_k=top_k)


def sequences_from_proto(msg: rollout_pb2.ScoreRequest) -> list[list[int]]:
    """The request's sequences; ValueError past MAX_SCORE_TOKENS."""
    total = sum(len(s.token_ids) for s in msg.sequences)
    if total > MAX_SCORE_TOKENS:
        raise ValueError(f"sequences: {total} tokens in one Score call, at most "
                         f"{MAX_SCORE_TOKENS}; split it")
    return [list(s.token_ids) for s in msg.sequences]


def score_response(logprobs: list[list[float]], version: int,
                   topk: list[tuple[list[int], list[float]]] | None = None) -> rollout_pb2.ScoreResponse:
    """`topk`: per sequence, the top k's ids and log-probs (k per position, flattened)."""
    rows = [rollout_pb2.TokenLogprobs(logprobs=row) for row in logprobs]
    for row, (ids, lps) in zip(rows, topk or []):
        row.topk_ids.extend(ids)
        row.topk_logprobs.extend(lps)
    return rollout_pb2.ScoreResponse(sequences=rows, policy_version=version)


def generate_request(prompt: Sequence[int], sampling) -> rollout_pb2.GenerateRequest:
    if getattr(sampling, "tool_choice", None) is not None:
        # A served engine (a frozen deployment) samples plain requests only.
        raise ValueError("sampling.tool_choice: a Generate request does not carry tool choices; "
                         "sample them on the rollout's own engine")
    return rollout_pb2.GenerateRequest(
        token_ids=list(prompt), max_tokens=sampling.max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, stop_token_ids=list(sampling.stop_token_ids))


def sampling_from_proto(msg: rollout_pb2.GenerateRequest):
    """The request's sampling options; ValueError naming a bad field."""
    from kiln.services.rollout.engine import SamplingOptions

    if not msg.token_ids:
        raise ValueError("token_ids: an empty context")
    return SamplingOptions(temperature=msg.temperature, top_p=msg.top_p or 1.0,
                           max_tokens=msg.max_tokens or 1, stop_token_ids=tuple(msg.stop_token_ids))

