"""The base of every RLJob section (`kiln.api.spec` is the module to import)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    """Base of every RLJob section: camelCase on the wire, unknown fields refused, every field
    documented by its docstring (which becomes its description in the CRD)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )
