"""Reading API bodies defensively: an object's controller, labels, replica count,
the planner's recorded target and the Degraded condition, whatever the body holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve_operator.render import ServiceRef
from splitserve_operator.spec import Pool


def as_map(value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else empty: bodies from the API may hold anything."""
    return value if isinstance(value, Mapping) else {}


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    refs = as_map(obj.get("metadata")).get("ownerReferences")
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def label_of(obj: Mapping[str, Any], key: str) -> str | None:
    value = as_map(as_map(obj.get("metadata")).get("labels")).get(key)
    return str(value) if value is not None else None


def planned_replicas(body: Mapping[str, Any], pool: Pool) -> int | None:
    pools = as_map(as_map(body.get("status")).get("pools"))
    value = as_map(pools.get(pool.value)).get("desiredReplicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def live_replicas(deployment: Mapping[str, Any] | None, ref: ServiceRef) -> int | None:
    if not deployment or controller_uid(deployment) != ref.uid:
        return None
    value = as_map(deployment.get("spec")).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def degraded_condition(status: Mapping[str, Any]) -> tuple[object, object, object]:
    conditions = status.get("conditions")
    for c in conditions if isinstance(conditions, list) else []:
        if isinstance(c, Mapping) and c.get("type") == "Degraded":
            return c.get("status"), c.get("reason"), c.get("message")
    return None, None, None
