"""What the autoscaling loop writes back: the planner's part of the InferenceService's
status (its records and the ``ScalingActive`` condition) and the Events that announce a
resize. Pure: builds dictionaries and strings from a
:class:`~splitserve_operator.planner.model.Plan`; :class:`~.loop.Autoscaler` applies them
under its own field manager, so the API server merges its condition with the
reconciler's by type.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from splitserve.role_balance import BalanceDecision, Split

from splitserve_operator.api.fields import as_map, count
from splitserve_operator.api.values import Pool
from splitserve_operator.planner.model import Direction, Plan, PoolDecision
from splitserve_operator.planner.model import Pool as PlannerPool

CONDITION = "ScalingActive"
"""Condition type (as the HorizontalPodAutoscaler names it): True while the planner
scales every pool from the metrics it needs; False while it holds, for lack of metrics
or because another writer scales a pool."""
REASON_ACTIVE = "MetricsAvailable"
REASON_HOLDING = "MetricsUnavailable"
REASON_OUTSIDE = "ScaledOutside"
EVENT_SCALED_UP = "ScaledUp"
EVENT_SCALED_DOWN = "ScaledDown"
EVENT_ROLE_SWITCHED = "RoleSwitched"
"""A pod of ``spec.flex`` was relabelled to another role (one Event per switch)."""

POOLS: dict[PlannerPool, Pool] = {
    PlannerPool.PREFILL: Pool.PREFILL,
    PlannerPool.DECODE: Pool.DECODE,
}


def hold_message(hold_reason: str | None) -> str:
    """The condition's message: all is well, or why the planner holds."""
    if hold_reason is None:
        return "the planner has the metrics it needs"
    return f"holding replicas, not scaling on missing data: {hold_reason}"


def outside_message(outside: Mapping[Pool, Sequence[str]], names: Mapping[Pool, str]) -> str:
    """Which pools another writer scales, and how to settle it."""
    parts = []
    for pool, managers in sorted(outside.items()):
        name = names[pool]
        parts.append(
            f"the {pool.value} pool (WorkerPool {name}) is scaled by {', '.join(managers)}, not "
            "the planner: the planner leaves it alone. Turn autoscaling off to let that "
            "scaler drive it, or hand the pool back: kubectl patch workerpool "
            f"{name} --type=merge --field-manager=splitserve-planner "
            '-p \'{"spec":{"replicas":N}}\''
        )
    return "; ".join(parts)


def planner_status(
    body: Mapping[str, Any],
    result: Plan,
    last_scale: MutableMapping[str, str],
    *,
    hold_reason: str | None,
    outside: Mapping[Pool, Sequence[str]],
    names: Mapping[Pool, str],
    stamp: str,
    integrity: Mapping[str, Any] | None = None,
    flex: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The planner's ``status`` for one tick; records ``stamp`` in ``last_scale`` for
    every pool whose replica count it changed. ``integrity``: the ``KVIntegrity``
    condition this tick read, applied beside ``ScalingActive``; ``flex``: the
    switchable pods' ``status.flex`` (:func:`flex_status`), for a service with some."""
    planner_pools: dict[str, Any] = {}
    for d in result.decisions():
        pool = POOLS[d.pool]
        if d.changed and pool not in outside:
            last_scale[pool.value] = stamp
        entry: dict[str, Any] = {
            "desiredReplicas": d.replicas,
            "reason": REASON_OUTSIDE if pool in outside else d.reason.value,
            "message": d.detail[:512],
        }
        if pool.value in last_scale:
            entry["lastScaleTime"] = last_scale[pool.value]
        if d.capacity is not None:
            entry["capacityPerReplica"] = round(d.capacity, 3)
        if d.slo_ratio is not None:
            entry["sloRatio"] = round(d.slo_ratio, 3)
        planner_pools[pool.value] = entry
    if outside:
        active, reason, message = False, REASON_OUTSIDE, outside_message(outside, names)
    elif hold_reason is not None:
        active, reason, message = False, REASON_HOLDING, hold_message(hold_reason)
    else:
        active, reason, message = True, REASON_ACTIVE, hold_message(None)
    status = as_map(body.get("status"))
    generation = count(as_map(body.get("metadata")).get("generation"))
    out: dict[str, Any] = {
        "autoscaling": {
            "lastTickTime": stamp,
            "metricsAvailable": hold_reason is None,
            "pools": planner_pools,
        },
        "conditions": [
            scaling_condition(status, active, reason, message, stamp, generation),
            *([dict(integrity)] if integrity is not None else []),
        ],
    }
    if flex is not None:
        out["flex"] = dict(flex)
    return out


def flex_status(
    split: Split, decision: BalanceDecision, *, last_switch: Mapping[str, str] | None
) -> dict[str, Any]:
    """``status.flex``: the switchable pods per role (after this tick's switch), the
    policy's word on this tick, and the last switch (``time``, ``pod``, ``from``, ``to``)."""
    out: dict[str, Any] = {
        "prefill": split.prefill,
        "decode": split.decode,
        "both": split.both,
        "switching": split.switching,
        "reason": decision.reason.value,
        "message": decision.detail[:512],
    }
    if last_switch is not None:
        out["lastSwitch"] = dict(last_switch)
    return out


def switch_message(pod: str, decision: BalanceDecision) -> str:
    return f"pod {pod} {decision.switch_from} -> {decision.switch_to}: {decision.detail}"


def scaling_condition(
    status: Mapping[str, Any], active: bool, reason: str, message: str, stamp: str, generation: int
) -> dict[str, Any]:
    """The ``ScalingActive`` condition; its ``lastTransitionTime`` moves only on a flip."""
    old = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    value = "True" if active else "False"
    mine = next((c for c in old if c.get("type") == CONDITION), None)
    since = stamp
    if mine is not None and mine.get("status") == value:
        since = str(mine.get("lastTransitionTime") or stamp)
    return {
        "type": CONDITION,
        "status": value,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def event_reason(d: PoolDecision) -> str:
    return EVENT_SCALED_UP if d.direction is Direction.UP else EVENT_SCALED_DOWN


def event_message(d: PoolDecision) -> str:
    return f"{d.pool.value} {d.previous} -> {d.replicas}: {d.reason.value}: {d.detail}"
