"""What every model of an ``InferenceService`` spec shares: camelCase on the wire,
strictness, and the quantity type."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints
from pydantic.alias_generators import to_camel

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
Quantity = int | str
"""Checked against :data:`QUANTITY_PATTERN` by the model that holds it."""


class SpecModel(BaseModel):
    """camelCase on the wire, unknown fields refused, types strict, values frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
    )
