"""The experts an MoE rollout chose, carried on a trajectory for routing replay.

For each token position `t` in `[start, start + rows)` and each MoE layer, the `topk` expert ids
the inference engine routed token `t`'s hidden state to (in the order the engine returned them;
replay compares sets). Position `t`'s routing shapes the log-prob of token `t + 1`, so the last
token of a trajectory needs none: an engine reports prompt and generated tokens but the last.

Encoding: the ids laid out `[rows, layers, topk]`, each in `bits = ceil(log2(num_experts))`
bits, packed big-endian into bytes. Size bound: `ceil(rows * layers * topk * bits / 8)` bytes,
e.g. 1.5 bytes per token for the tiny test model (2 layers, top-2 of 8), 336 bytes per token for
a 48-layer top-8-of-128 model (10.5 MiB for 32k tokens), 2-4x less than int32 ids.

Torch-free (numpy only, imported when packing or unpacking).
"""
from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass


def id_bits(num_experts: int) -> int:
    """Bits per expert id."""
    return max(1, (num_experts - 1).bit_length())


def packed_size(rows: int, layers: int, topk: int, num_experts: int) -> int:
    """Bytes the packed ids take (the stated bound is this, exactly)."""
    return -(-rows * layers * topk * id_bits(num_experts) // 8)


@dataclass(frozen=True)
class RoutedExperts:
    layers: int
    topk: int
    num_experts: int
    start: int
    """First token position covered."""
    rows: int
    """Token positions covered: `[start, start + rows)`."""
    packed: bytes
    versions: tuple[tuple[int, int], ...] = ()
    """The policy version each row was routed under, as `(first position, version)` pairs in
    order, each holding until the next; empty when the engine did not say (the trainer then
    cannot tell a row routed under newer weights than its token was sampled with)."""

    @classmethod
    def pack(cls, ids, num_experts: int, start: int = 0, version: int | None = None) -> "RoutedExperts":
        """From an integer array-like `[rows, layers, topk]` of expert ids, all routed under
        policy `version` (if given)."""
        import numpy as np

        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 3:
            raise ValueError(f"routed experts must be [rows, layers, topk], got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
            raise ValueError(f"expert ids must be in [0, {num_experts}); got {arr.min()}..{arr.max()}")
        bits = id_bits(num_experts)
        # Each id as `bits` big-endian bits, then all bits packed 8 to a byte.
        shifts = np.arange(bits - 1, -1, -1, dtype=np.int64)
        bit_array = ((arr.reshape(-1, 1) >> shifts) & 1).astype(np.uint8)
        return cls(layers=arr.shape[1], topk=arr.shape[2], num_experts=num_experts, start=start,
                   rows=arr.shape[0], packed=np.packbits(bit_array.reshape(-1)).tobytes(),
                   versions=((start, version),) if version is not None else ())

    def unpack(self):
        """The ids as a numpy int64 array `[rows, layers, topk]`."""
        import numpy as np

        self.check_size()
        bits = id_bits(self.num_experts)
        count = self.rows * self.layers * self.topk
        flat = np.unpackbits(np.frombuffer(self.packed, dtype=np.uint8))[: count * bits]
        weights = (1 << np.arange(bits - 1, -1, -1, dtype=np.int64))
        ids = flat.reshape(count, bits).astype(np.int64) @ weights
        return ids.reshape(self.rows, self.layers, self.topk)

    def check_size(self) -> None:
        expected = packed_size(self.rows, self.layers, self.topk, self.num_experts)
        if len(self.packed) != expected:
            raise ValueError(f"routed experts: {len(self.packed)} packed bytes, expected {expected} for "
                             f"{self.rows} rows x {self.layers} layers x top-{self.topk} of {self.num_experts}")

    @property
    def end(self) -> int:
        return self.start + self.rows

    def version_at(self, position: int) -> int | None:
        """The policy version row `position` was routed under (None: not recorded)."""
        found = None
        for first, version in self.versions:
            if first > position:
                break
            found = version
        return found

    def to_dict(self) -> dict:
        return {"layers": self.layers, "topk": self.topk, "num_experts": self.num_experts,
                "start": self.start, "rows": self.rows, "packed": base64.b64encode(self.packed).decode(),
                "versions": [list(v) for v in self.versions]}

    @classmethod
    def from_dict(cls, data: dict) -> "RoutedExperts":
        versions = tuple((int(a), int(b)) for a, b in data.get("versions", ()))
        return cls(**{**data, "packed": base64.b64decode(data["packed"]), "versions": versions})


def merge_routing(old: RoutedExperts | None, new: RoutedExperts | None) -> RoutedExperts | None:
    """An episode's routing after one more generation on its context: `new` covers the
    positions that generation computed (an engine with a prefix cache reports only those), so
    `old` keeps the positions before `new.start` and `new` wins from there on. A gap between
    them (positions neither computed) leaves only `new`; the trainer uses its own routing for
    positions no record covers."""
    if new is None or old is None:
        return new or old
    if new.start > old.end or new.start <= old.start:
        return new
    import numpy as np

    kept = old.unpack()[: new.start - old.start]
    merged = RoutedExperts.pack(np.concatenate([kept, new.unpack()]), new.num_experts, old.start)
    if not (old.versions and new.versions):
        return merged
    versions = tuple(v for v in old.versions if v[0] < new.start) + new.versions
    return dataclasses.replace(merged, versions=versions)


def straddled_positions(routed: RoutedExperts | None, spans) -> list[int]:
    """Generated token positions whose recorded routing is not the one they were sampled under:
    token p (sampled under its span's version) is predicted from row p - 1, and that row was
    routed under another version. It happens when weights change inside one generation: an
    engine recomputes the context under the new weights and keeps that routing for the earlier
    tokens too, so replaying it would not reproduce their sampling. `spans`: the trajectory's
    `VersionSpan`s. Empty when the routing has no versions."""
    if routed is None or not routed.versions:
        return []
    out = []
    for span in spans:
        for p in range(max(span.start, routed.start + 1), min(span.end, routed.end + 1)):
            row = routed.version_at(p - 1)
            if row is not None and row != span.policy_version:
                out.append(p)
    return out
