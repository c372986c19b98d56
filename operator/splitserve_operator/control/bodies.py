"""What one reconcile reads from API bodies, defensively: an object's controller, its
labels and the Degraded condition, whatever the body holds (see
:mod:`splitserve_operator.api.fields`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve_operator.api.fields import as_map


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    refs = as_map(obj.get("metadata")).get("ownerReferences")
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def label_of(obj: Mapping[str, Any], key: str) -> str | None:
    value = as_map(as_map(obj.get("metadata")).get("labels")).get(key)
    return str(value) if value is not None else None


def degraded_condition(status: Mapping[str, Any]) -> tuple[object, object, object]:
    conditions = status.get("conditions")
    for c in conditions if isinstance(conditions, list) else []:
        if isinstance(c, Mapping) and c.get("type") == "Degraded":
            return c.get("status"), c.get("reason"), c.get("message")
    return None, None, None
