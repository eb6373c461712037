"""Which keys an RLJob manifest may hold, and what to say about one it may not: the CRD's
camelCase only (`groupSize`; `group_size` is refused naming it), and no field that was removed
(`stages[].epochs`). `kiln.api.validate` uses these for its unknown-field messages.

Not covered: misspellings (validate's generic "unknown field") and fields that moved
(`kiln.api.rl.MOVED_TO_LOSS`).
"""
from __future__ import annotations

import functools
from typing import Any

from pydantic.alias_generators import to_camel

REMOVED_STAGE_FIELDS = {
    "epochs": "epochs was removed (it was never read): an SFT stage runs maxSteps steps over its "
              "demonstration pool; delete the key",
}
"""Stage fields that went away, and what to write instead."""


def snake_case_hint(field: str) -> str | None:
    """The message for a snake_case key whose camelCase spelling is an RLJob key; else None."""
    camel = to_camel(field)
    if camel == field or camel not in _keys():
        return None
    return (f"snake_case key; manifests take the CRD's camelCase keys: write {camel!r} "
            f"instead of {field!r}")


@functools.cache
def _keys() -> frozenset[str]:
    """Every key an RLJob manifest may hold, anywhere (the properties of its JSON schema)."""
    from kiln.api.spec import RLJob

    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                found.update(node["properties"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(RLJob.model_json_schema(by_alias=True))
    return frozenset(found)
