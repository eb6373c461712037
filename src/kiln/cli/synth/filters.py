"""Filters every synthesis pipeline shares.

Near-duplicates: MinHash over word 5-shingles (word 1-grams for short texts) estimates the
Jaccard similarity of two texts from `num_perm` hash minima; texts whose estimate reaches the
threshold are duplicates, and the later one is dropped. Hashes are seeded, so a run is
reproducible. O(n^2) comparisons: fine for the thousands of tasks a run keeps.
"""
from __future__ import annotations

import hashlib
import re

_MERSENNE = (1 << 61) - 1


def _shingles(text: str, k: int = 5) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    if len(words) < k:
        return set(words) or {""}
    return {" ".join(words[i:i + k]) for i in range(len(words) - k + 1)}


def minhash_signature(text: str, num_perm: int = 64) -> list[int]:
    hashes = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
              for s in _shingles(text)]
    sig = []
    for i in range(num_perm):
        a, b = 2 * i + 1, 7919 * (i + 1)
        sig.append(min((a * h + b) % _MERSENNE for h in hashes))
    return sig


def similarity(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def near_duplicates(texts: list[str], threshold: float = 0.8, num_perm: int = 64) -> set[int]:
    """Indices of texts that are near-duplicates of an earlier one (to drop)."""
    sigs = [minhash_signature(t, num_perm) for t in texts]
    drop: set[int] = set()
    for j in range(len(sigs)):
        for i in range(j):
            if i not in drop and similarity(sigs[i], sigs[j]) >= threshold:
                drop.add(j)
                break
    return drop
