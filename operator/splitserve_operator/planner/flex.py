"""Switching instead of scaling: the planner's tick for a service with switchable workers.

:func:`.core.plan` sizes the fixed pools from a tick's signals; :func:`rebalance` reads
the same signals (TTFT and the prefill queue for prefill, TPOT, KV use and the decode
queue for decode), asks the contract's policy (:mod:`splitserve.role_balance`) whether
one switchable worker should change role, and when it should, the scale-up of the pool
it joins is held this tick: the switch serves the need instead of a new pod. So is the
scale-up while a switch waits only on the policy's clocks (its pressure not yet
sustained, or the dwell since the last switch), when waiting for it and its cost
come to less than a new pod's cold start: a pod ordered now would arrive after the
switch it duplicates. Pure.
"""

from __future__ import annotations

import math
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
    served, why = decision.switch_to, f"a switchable worker switches instead ({decision.detail})"
    if served is Role.BOTH:  # the donor's last worker takes the needy role as well
        served = Role.DECODE if decision.switch_from is Role.PREFILL else Role.PREFILL
    wait = waiting(pre, dec, split, costs, decision, tick.now, balance)
    if wait is not None:
        served = decision.memory.needy
        why = f"a switch to {served} is due in {wait:.3g} s, sooner than a new pod"
    if served is Role.PREFILL:
        plan = replace(plan, prefill=_instead(plan.prefill, why))
    elif served is Role.DECODE:
        plan = replace(plan, decode=_instead(plan.decode, why))
    return FlexPlan(plan, decision)


def waiting(
    prefill: SideLoad,
    decode: SideLoad,
    split: Split,
    costs: Costs,
    decision: BalanceDecision,
    now: float,
    balance: BalanceConfig,
) -> float | None:
    """Seconds until the policy switches, when only its clocks (``sustain_s``,
    ``min_dwell_s``) hold a switch it would make and waiting for it costs less than a
    new pod; else None."""
    if decision.reason not in (Reason.SUSTAIN, Reason.DWELL):
        return None
    mem = decision.memory
    timeless = BalanceMemory(needy=mem.needy, needy_since=-math.inf)
    if decide(prefill, decode, split, costs, timeless, now, balance).reason is not Reason.SWITCH:
        return None
    wait = 0.0
    if mem.needy_since is not None:
        wait = max(wait, balance.sustain_s - (now - mem.needy_since))
    if mem.last_switch_at is not None:
        wait = max(wait, balance.min_dwell_s - (now - mem.last_switch_at))
    cost = costs.drain_s + costs.prefix_hit_ratio * balance.cache_rewarm_s
    if costs.can_scale and wait + cost >= costs.cold_start_s:
        return None
    return wait


def _instead(d: PoolDecision, why: str) -> PoolDecision:
    """Hold a scale-up that a switch replaces (a shrink or a hold stays as it is)."""
    if d.direction is not Direction.UP:
        return d
    return replace(d, replicas=d.previous, direction=Direction.HOLD, detail=f"{d.detail}; {why}")


def _hold(memory: BalanceMemory, why: str) -> BalanceDecision:
    return BalanceDecision(None, Reason.MISSING, f"holding: {why}", memory)
