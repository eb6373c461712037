"""The names a LoRA policy version carries, without torch: the weight-sync service tells an
adapter version from one of complete weights by them (`kiln.models.lora` builds the versions).

A LoRA version holds PEFT-named A and B tensors (`*.lora_A.weight`, `*.lora_B.weight`) and one
tensor named `BASE_DIGEST`, the digest of the base weights the adapter was trained on; a
version without `BASE_DIGEST` carries complete weights and becomes the base of later adapters.
"""
from __future__ import annotations

from collections.abc import Iterable

BASE_DIGEST = "kiln.lora.base_digest"
"""The name under which a version carries `weights_digest` of the base its adapter sits on."""


def is_adapter_name(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def is_adapter_version(names: Iterable[str]) -> bool:
    """Whether a version with these tensor names is an adapter to merge into a base (rather
    than complete weights)."""
    return BASE_DIGEST in set(names)
