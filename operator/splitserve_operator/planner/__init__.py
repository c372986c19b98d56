"""The SLO-driven planner: a pure function from one tick's observations to
prefill and decode replica counts, each with a reason. No I/O (enforced by
``.importlinter``); time is passed in."""

from splitserve_operator.planner.config import PlannerConfig, PlannerConfigError
from splitserve_operator.planner.core import DEFAULT_CONFIG, capacity_target, learn_capacity, plan
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    Plan,
    PlannerState,
    Pool,
    PoolDecision,
    PoolMemory,
    PoolStatus,
    Reason,
    Slo,
    Tick,
)

__all__ = [
    "DEFAULT_CONFIG",
    "Bounds",
    "Direction",
    "Observation",
    "Plan",
    "PlannerConfig",
    "PlannerConfigError",
    "PlannerState",
    "Pool",
    "PoolDecision",
    "PoolMemory",
    "PoolStatus",
    "Reason",
    "Slo",
    "Tick",
    "capacity_target",
    "learn_capacity",
    "plan",
]
