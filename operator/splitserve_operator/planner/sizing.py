"""Pool sizes from demand and the capacity estimate, with the arithmetic shown."""

from __future__ import annotations

import math

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.model import PoolMemory
from splitserve_operator.planner.signals import PoolSignals

MAX_NEED = 1e6
"""Replica counts computed above this are cut here (the bounds cut further)."""


def capacity_target(
    signals: PoolSignals, capacity: float, utilization: float, backlog: bool = True
) -> int:
    """``ceil((demand + backlog_rate) / (capacity * utilization))``.

    ``backlog=False`` leaves the queue out: while replicas are starting, the
    queue grows only because they are not there yet, and the ones already
    asked for will drain it.
    """
    extra = signals.backlog_rate if backlog else 0.0
    need = min((signals.demand + extra) / (capacity * utilization), MAX_NEED)
    # Round away float noise (3000 / 750 must be 4, not 4.000000000000001 -> 5).
    return math.ceil(round(need, 9))


def sizing(
    s: PoolSignals, memory: PoolMemory, config: PlannerConfig, backlog: bool
) -> tuple[int, str] | None:
    """The pool size the capacity estimate asks for, and its arithmetic.

    A trusted capacity is sized at ``target_utilization`` with the backlog. A
    lower bound (what a replica has been seen to serve) is used as it is,
    without the backlog: the true capacity is at least that, and the
    difference is the headroom that absorbs bursts and drains the queue.
    """
    cap = memory.capacity
    if cap is None:
        return None
    util = config.target_utilization if memory.capacity_trusted else 1.0
    # A lower bound's hidden headroom drains the queue; sizing for it as well
    # would count the same spare capacity twice.
    backlog = backlog and memory.capacity_trusted
    n = capacity_target(s, cap, util, backlog)
    extra = s.backlog_rate if backlog else 0.0
    kind = "capacity" if memory.capacity_trusted else "capacity lower bound"
    return n, f"ceil(({s.demand:.4g} + {extra:.4g}) / ({kind} {cap:.4g} x {util:g})) = {n}"
