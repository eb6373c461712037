"""The base of every RLJob section (`kiln.api.spec` is the module to import)."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
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


Quantity = Annotated[
    str,
    Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$", examples=["500m", "4Gi"]),
]
"""A Kubernetes quantity as the RLJob's fields take it ("500m", "4Gi")."""


def _not_milli(value: object) -> object:
    # Kubernetes reads "256m" as 0.256 (bytes here), which some tools take for mebibytes:
    # refused with the spelling that was meant, before the pattern's generic message.
    if isinstance(value, str) and re.fullmatch(r"[0-9]+(\.[0-9]+)?m", value):
        raise ValueError(f"{value!r}: 'm' is milli in a Kubernetes quantity, a fraction of a "
                         f"byte here; for mebibytes write {value[:-1]}Mi")
    return value


ByteQuantity = Annotated[
    str,
    Field(pattern=r"^[0-9]+(\.[0-9]+)?(k|Ki|M|Mi|G|Gi|T|Ti)?$", examples=["512Mi", "4Gi"]),
    BeforeValidator(_not_milli),
]
"""A size in bytes as a Kubernetes quantity ("512Mi", "4Gi", "500M"); milli (`m`) is refused."""

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity ("512Mi", "1.5", "250m") as a plain number."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    return float(match.group(1)) * _FACTORS[match.group(2)]
