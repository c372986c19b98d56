"""Reading fields of API bodies defensively, and the API's timestamp format.

Bodies from the API server (and from other writers) may hold anything where a
field is expected: these helpers answer "what is here, if it is what we expect"
without raising, so a malformed object degrades into "absent", never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any


def as_map(value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else empty."""
    return value if isinstance(value, Mapping) else {}


def as_int(value: object) -> int | None:
    """``value`` if it is an integer (a bool is not one), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def count(value: object, default: int = 0) -> int:
    """``value`` if it is an integer (a bool is not one), else ``default``."""
    number = as_int(value)
    return default if number is None else number


def timestamp(moment: datetime) -> str:
    """``moment`` as the API writes times (RFC 3339, whole seconds, UTC ``Z``)."""
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
