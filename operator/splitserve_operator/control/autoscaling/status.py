"""What the autoscaling loop writes back: the planner's ``status`` patch, the
``ScalingActive`` condition and the Events that announce a resize.

Pure: builds dictionaries and strings from a :class:`~splitserve_operator.planner.model.Plan`;
:class:`~.loop.Autoscaler` sends them to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from splitserve_operator.api.fields import as_map, count
from splitserve_operator.api.values import Pool
from splitserve_operator.planner.model import Direction, Plan, PoolDecision
from splitserve_operator.planner.model import Pool as PlannerPool

CONDITION = "ScalingActive"
"""Condition type (as the HorizontalPodAutoscaler names it): True while the
planner has the metrics it needs, False while it holds for lack of them."""
REASON_ACTIVE = "MetricsAvailable"
REASON_HOLDING = "MetricsUnavailable"
EVENT_SCALED_UP = "ScaledUp"
EVENT_SCALED_DOWN = "ScaledDown"

POOLS: dict[PlannerPool, Pool] = {
    PlannerPool.PREFILL: Pool.PREFILL,
    PlannerPool.DECODE: Pool.DECODE,
}


def hold_message(hold_reason: str | None) -> str:
    """The condition's message: all is well, or why the planner holds."""
    if hold_reason is None:
        return "the planner has the metrics it needs"
    return f"holding replicas, not scaling on missing data: {hold_reason}"


def status_patch(
    body: Mapping[str, Any],
    result: Plan,
    last_scale: MutableMapping[str, str],
    hold_reason: str | None,
    stamp: str,
) -> dict[str, Any]:
    """The ``status`` merge patch for one tick; records ``stamp`` in ``last_scale``
    for every pool whose replica count changed."""
    status = as_map(body.get("status"))
    pools: dict[str, Any] = {}
    planner_pools: dict[str, Any] = {}
    for d in result.decisions():
        pool = POOLS[d.pool].value
        if d.changed:
            # d.previous is the recorded target (else the Deployment's size)
            pools[pool] = {"desiredReplicas": d.replicas}
            last_scale[pool] = stamp
        entry: dict[str, Any] = {
            "desiredReplicas": d.replicas,
            "reason": d.reason.value,
            "message": d.detail[:512],
        }
        if pool in last_scale:
            entry["lastScaleTime"] = last_scale[pool]
        if d.capacity is not None:
            entry["capacityPerReplica"] = round(d.capacity, 3)
        if d.slo_ratio is not None:
            entry["sloRatio"] = round(d.slo_ratio, 3)
        planner_pools[pool] = entry
    active = hold_reason is None
    message = hold_message(hold_reason)
    conditions = scaling_conditions(
        status, active, message, stamp, count(as_map(body.get("metadata")).get("generation"))
    )
    patch: dict[str, Any] = {
        "autoscaling": {
            "lastTickTime": stamp,
            "metricsAvailable": active,
            "pools": planner_pools,
        },
    }
    if conditions is not None:
        patch["conditions"] = conditions
    if pools:
        patch["pools"] = pools
    return patch


def scaling_conditions(
    status: Mapping[str, Any], active: bool, message: str, stamp: str, generation: int
) -> list[dict[str, Any]] | None:
    """All conditions with ours set; None when ours is unchanged (list merge patches
    replace the whole list, so the others are sent back as they are)."""
    old = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    value = "True" if active else "False"
    reason = REASON_ACTIVE if active else REASON_HOLDING
    mine = next((c for c in old if c.get("type") == CONDITION), None)
    if mine is not None and mine.get("status") == value and mine.get("message") == message:
        return None
    since = stamp
    if mine is not None and mine.get("status") == value:
        since = str(mine.get("lastTransitionTime") or stamp)
    new = {
        "type": CONDITION,
        "status": value,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }
    return [dict(c) for c in old if c.get("type") != CONDITION] + [new]


def event_reason(d: PoolDecision) -> str:
    return EVENT_SCALED_UP if d.direction is Direction.UP else EVENT_SCALED_DOWN


def event_message(d: PoolDecision) -> str:
    return f"{d.pool.value} {d.previous} -> {d.replicas}: {d.reason.value}: {d.detail}"
