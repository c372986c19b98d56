"""Switching instead of scaling: the planner's tick for a service with switchable workers.

:func:`.core.plan` sizes the fixed pools from a tick's signals; :func:`rebalance` reads
the same signals (TTFT and the prefill queue for prefill, TPOT, KV use and the decode
queue for decode), asks the contract's policy (:mod:`splitserve.role_balance`) whether
one switchable worker should change role, and when it should, the scale-up of the pool
it joins is held this tick: the switch serves the need instead of a new pod. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from splitserve.role_balance import (
    BalanceConfig,
    BalanceDecision,
    BalanceMemory,
    Costs,
    Reason,
    SideLoad,
    Split,
    decide,
)
from splitserve.roles import Role

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.model import Direction, Plan, PoolDecision, Tick
from splitserve_operator.planner.signals import (
    Missing,
    PoolSignals,
    decode_signals,
    prefill_signals,
)


@dataclass(frozen=True)
class FlexPlan:
    plan: Plan
    """The pools' decisions, with the scale-up a switch replaces held."""
    balance: BalanceDecision
    """Whether a switchable worker changes role, and why (its memory for the next tick)."""


def side_load(signals: PoolSignals | Missing) -> SideLoad | None:
    """What the policy reads of one pool's signals (None while they are missing)."""
    if isinstance(signals, Missing):
        return None
    return SideLoad(
        slo_ratio=signals.slo_ratio,
        queue_pressure=signals.queue_pressure,
        kv_pressure=signals.kv_pressure,
    )


def rebalance(
    plan: Plan,
    tick: Tick,
    split: Split,
    costs: Costs,
    memory: BalanceMemory,
    config: PlannerConfig,
    balance: BalanceConfig,
) -> FlexPlan:
    """``plan`` (this tick's :func:`.core.plan`) with the switch decision beside it."""
    obs = tick.observation
    if obs is None:
        return FlexPlan(plan, _hold(memory, "metrics source unreachable"))
    pre = side_load(prefill_signals(obs, tick.slo, config))
    dec = side_load(decode_signals(obs, tick.slo, config, plan.state.output_per_prompt_token))
    if pre is None or dec is None:
        return FlexPlan(plan, _hold(memory, "missing signals"))
    decision = decide(pre, dec, split, costs, memory, tick.now, balance)
    if decision.switch_to is Role.PREFILL:
        plan = replace(plan, prefill=_instead(plan.prefill, decision))
    elif decision.switch_to is Role.DECODE:
        plan = replace(plan, decode=_instead(plan.decode, decision))
    return FlexPlan(plan, decision)


def _instead(d: PoolDecision, switch: BalanceDecision) -> PoolDecision:
    """Hold a scale-up that the switch replaces (a shrink or a hold stays as it is)."""
    if d.direction is not Direction.UP:
        return d
    return replace(
        d,
        replicas=d.previous,
        direction=Direction.HOLD,
        detail=f"{d.detail}; a switchable worker switches instead ({switch.detail})",
    )


def _hold(memory: BalanceMemory, why: str) -> BalanceDecision:
    return BalanceDecision(None, Reason.MISSING, f"holding: {why}", memory)
