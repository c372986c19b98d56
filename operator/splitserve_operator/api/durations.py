"""Durations as the API writes them: Go ``time.ParseDuration`` strings (``"500ms"``,
``"30s"``, ``"1m30s"``), read into seconds.

A spec field annotated with :class:`Duration` takes such a string only (a bare number is
refused: its unit would be a guess), holds it as float seconds in Python, and writes
it back as a duration string in JSON. The CRD checks the same syntax with
:data:`DURATION_PATTERN` and the bounds with CEL's ``duration()``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

_NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
_UNIT = r"(ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
DURATION_PATTERN = re.compile(rf"^({_NUMBER}{_UNIT})+$")
"""Go's duration syntax without a sign (no field here takes a negative one): one or more
number-unit pairs, units ``ns``, ``us`` (or ``µs``), ``ms``, ``s``, ``m``, ``h``."""
_PART = re.compile(rf"{_NUMBER}{_UNIT}")

_UNIT_SECONDS = {
    "ns": Decimal("1e-9"),
    "us": Decimal("1e-6"),
    "\u00b5s": Decimal("1e-6"),
    "\u03bcs": Decimal("1e-6"),
    "ms": Decimal("1e-3"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string (``"1m30s"`` is 90.0); ValueError when it is not one."""
    if not isinstance(text, str) or not DURATION_PATTERN.match(text):
        raise ValueError(f"{text!r} is not a duration such as 500ms, 30s or 2m")
    total = sum(
        (Decimal(found.group(1)) * _UNIT_SECONDS[found.group(3)] for found in _PART.finditer(text)),
        Decimal(0),
    )
    return float(total)


def format_duration(seconds: float) -> str:
    """The shortest plain duration string for ``seconds``: ``30s``, ``500ms``, ``1.5s``."""
    value = Decimal(repr(float(seconds)))
    if value == value.to_integral_value():
        return f"{int(value)}s"
    millis = value * 1000
    if millis == millis.to_integral_value():
        return f"{int(millis)}ms"
    return f"{value.normalize():f}s"


@dataclass(frozen=True)
class Duration:
    """Marks a float field as a duration string on the wire, within bounds: use it as
    ``Annotated[float, Duration(at_most=600)]``. ``above`` is exclusive, ``at_least``
    (when given, instead) and ``at_most`` inclusive, all in seconds."""

    at_most: float
    above: float = 0.0
    at_least: float | None = None

    @property
    def bounds(self) -> str:
        low = (
            f"at least {format_duration(self.at_least)}"
            if self.at_least is not None
            else f"above {format_duration(self.above)}"
        )
        return f"{low} and at most {format_duration(self.at_most)}"

    def read(self, value: object) -> float:
        if not isinstance(value, str):
            raise ValueError(
                f'must be a duration string such as "500ms", "30s" or "2m" ({self.bounds})'
            )
        seconds = parse_duration(value)
        low = self.at_least is not None and seconds < self.at_least
        if low or (self.at_least is None and seconds <= self.above) or seconds > self.at_most:
            raise ValueError(f"must be {self.bounds} (got {value!r})")
        return seconds

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(
            self.read,
            handler(source),
            serialization=core_schema.plain_serializer_function_ser_schema(
                format_duration, return_schema=core_schema.str_schema(), when_used="json"
            ),
        )
