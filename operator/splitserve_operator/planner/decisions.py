"""Building a pool's decision, and the small helpers every decision path shares."""

from __future__ import annotations

import math
from dataclasses import replace

from splitserve_operator.planner.model import (
    Direction,
    Pool,
    PoolDecision,
    PoolMemory,
    PoolStatus,
    Reason,
)
from splitserve_operator.planner.signals import PoolSignals


def since(t: float | None, now: float) -> float:
    return math.inf if t is None else now - t


def break_shrink(memory: PoolMemory) -> PoolMemory:
    if memory.shrink_since is None and not memory.shrink_proposals:
        return memory
    return replace(memory, shrink_since=None, shrink_proposals=())


def within(s: PoolSignals, status: PoolStatus, memory: PoolMemory, why: str) -> PoolDecision:
    bounded = status.bounds.clamp(status.replicas)
    if bounded != status.replicas:
        return decision(s, status, memory, bounded, Reason.BOUNDS, f"bounds {status.bounds}")
    ratio = "no latency reading" if s.slo_ratio is None else f"{s.slo_ratio:.3g}x SLO"
    return decision(s, status, memory, status.replicas, Reason.WITHIN_SLO, f"{ratio}; {why}")


def decision(
    s: PoolSignals,
    status: PoolStatus,
    memory: PoolMemory,
    replicas: int,
    reason: Reason,
    detail: str,
) -> PoolDecision:
    if replicas > status.replicas:
        direction = Direction.UP
    elif replicas < status.replicas:
        direction = Direction.DOWN
    else:
        direction = Direction.HOLD
    return PoolDecision(
        pool=s.pool,
        previous=status.replicas,
        replicas=replicas,
        direction=direction,
        reason=reason,
        detail=detail,
        slo_ratio=s.slo_ratio,
        capacity=memory.capacity,
    )


def hold_missing(pool: Pool, status: PoolStatus, memory: PoolMemory, why: str) -> PoolDecision:
    # Bounds come from the spec, not from metrics: a size outside them is
    # corrected even while metrics are missing. Nothing else moves.
    bounded = status.bounds.clamp(status.replicas)
    direction = (
        Direction.HOLD
        if bounded == status.replicas
        else (Direction.UP if bounded > status.replicas else Direction.DOWN)
    )
    return PoolDecision(
        pool=pool,
        previous=status.replicas,
        replicas=bounded,
        direction=direction,
        reason=Reason.MISSING_DATA if bounded == status.replicas else Reason.BOUNDS,
        detail=f"holding: {why}",
        capacity=memory.capacity,
    )
