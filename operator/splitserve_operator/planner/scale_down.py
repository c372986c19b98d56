"""Scaling down: the hysteresis band, the stabilisation window and the cooldowns."""

from __future__ import annotations

from dataclasses import replace

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.decisions import break_shrink, decision, since, within
from splitserve_operator.planner.model import PoolDecision, PoolMemory, PoolStatus, Reason
from splitserve_operator.planner.signals import PoolSignals
from splitserve_operator.planner.sizing import sizing


def maybe_shrink(
    s: PoolSignals, status: PoolStatus, memory: PoolMemory, now: float, config: PlannerConfig
) -> tuple[PoolDecision, PoolMemory]:
    if not (s.idle or s.shrink_ok):
        memory = break_shrink(memory)
        return within(s, status, memory, "inside the hysteresis band"), memory
    by_capacity = sizing(replace(s, demand=s.recent_demand), memory, config, backlog=True)
    if s.idle:
        proposal, reason = status.bounds.min_replicas, Reason.IDLE
        how = f"no traffic: minimum {proposal}"
    elif by_capacity is not None:
        (proposal, how), reason = by_capacity, Reason.SURPLUS
    else:
        proposal, reason = status.replicas - 1, Reason.SURPLUS
        how = f"capacity unknown: one fewer, {proposal}"
    proposal = status.bounds.clamp(proposal)
    if proposal >= status.replicas:
        memory = break_shrink(memory)
        return within(s, status, memory, how), memory
    window_start = now - config.down_stabilization_s
    recent = tuple(p for p in memory.shrink_proposals if p[0] > window_start)
    memory = replace(
        memory,
        shrink_since=now if memory.shrink_since is None else memory.shrink_since,
        shrink_proposals=(*recent, (now, proposal)),
    )
    assert memory.shrink_since is not None
    held = now - memory.shrink_since
    if held < config.down_stabilization_s:
        text = f"{how}; wanted for {held:.0f}s of {config.down_stabilization_s:g}s"
        return decision(s, status, memory, status.replicas, Reason.STABILIZING, text), memory
    since_up = since(memory.last_up_at, now)
    since_down = since(memory.last_down_at, now)
    if since_up < config.cooldown_after_up_s or since_down < config.cooldown_after_down_s:
        text = (
            f"{how}; last up {since_up:.0f}s ago (cooldown {config.cooldown_after_up_s:g}s), "
            f"last down {since_down:.0f}s ago (cooldown {config.cooldown_after_down_s:g}s)"
        )
        return decision(s, status, memory, status.replicas, Reason.COOLDOWN, text), memory
    target = max(p[1] for p in memory.shrink_proposals)
    if target >= status.replicas:
        text = f"{how}; but {target} was proposed within the last {config.down_stabilization_s:g}s"
        return decision(s, status, memory, status.replicas, Reason.STABILIZING, text), memory
    text = f"{how}; largest proposal in the last {config.down_stabilization_s:g}s: {target}"
    memory = replace(memory, last_down_at=now)
    return decision(s, status, memory, target, reason, text), memory
