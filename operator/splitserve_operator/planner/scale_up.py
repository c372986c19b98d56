"""Scaling up: which triggers fire, the size they ask for, and the bounded decision."""

from __future__ import annotations

import math
from dataclasses import replace

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.decisions import break_shrink, decision
from splitserve_operator.planner.model import Pool, PoolDecision, PoolMemory, PoolStatus, Reason
from splitserve_operator.planner.signals import PoolSignals
from splitserve_operator.planner.sizing import sizing

UP_PRIORITY = (Reason.SLO_BREACH, Reason.QUEUE, Reason.KV_PRESSURE, Reason.DEMAND)
"""When several triggers ask for the same size, the reason reported is the first here."""


def up_target(
    s: PoolSignals,
    status: PoolStatus,
    memory: PoolMemory,
    config: PlannerConfig,
    settled: bool,
    latency_trusted: bool,
) -> tuple[int, Reason, str] | None:
    """The largest target among the triggers that fire, with its reason and arithmetic.

    Each trigger sizes from demand and capacity when capacity is known. Until
    the pool has settled (see :func:`is_settled`), while it visibly drains a
    backlog, and while it is not saturated (a prefill pool with no queue is
    not short of replicas, whatever its TTFT), that is all: latency and
    queues still show what the replicas already there are fixing. Otherwise
    a trigger without a trusted capacity also steps the pool up from what it
    sees (never less than ready + 1), because then nothing else explains why
    the SLO is missed.
    """
    ready = max(status.ready, 1)
    by_capacity = sizing(s, memory, config, backlog=settled)

    def sized(reactive: int, reactive_text: str) -> tuple[int, str]:
        if by_capacity is not None and memory.capacity_trusted:
            # If the estimate is too high the pool stays saturated and the
            # estimate comes down by itself.
            return by_capacity
        options = [by_capacity] if by_capacity is not None else []
        if latency_trusted and not s.draining:
            options.append((max(reactive, ready + 1), reactive_text))
        if not options:
            if not settled:
                why = "replicas are starting or just started"
            elif s.draining:
                why = "the pool is draining its backlog"
            else:
                why = "the percentiles still show a backlog that is gone"
            return status.replicas, f"waiting: {why}"
        return max(options, key=lambda o: o[0])

    candidates: list[tuple[int, Reason, str]] = []
    if s.breach:
        assert s.slo_ratio is not None
        step = math.ceil(round(ready * min(s.slo_ratio, config.max_up_factor), 9))
        target, how = sized(
            step, f"ceil({ready} x min({s.slo_ratio:.3g}, {config.max_up_factor:g})) = {step}"
        )
        candidates.append(
            (
                target,
                Reason.SLO_BREACH,
                f"{latency_name(s)} {s.latency_s:.4g}s is {s.slo_ratio:.3g}x the SLO "
                f"{s.slo_s:g}s; {how}",
            )
        )
    if s.queue_pressure:
        factor = min(s.queue_wait_s / s.queue_budget_s, config.max_up_factor)
        step = math.ceil(round(ready * factor, 9))
        target, how = sized(
            step,
            f"ceil({ready} x min({s.queue_wait_s:.3g} / {s.queue_budget_s:.3g}, "
            f"{config.max_up_factor:g})) = {step}",
        )
        candidates.append(
            (
                target,
                Reason.QUEUE,
                f"{s.queue:.3g} queued, predicted wait {s.queue_wait_s:.3g}s; {how}",
            )
        )
    if s.kv_pressure:
        assert s.kv_utilization is not None
        step = math.ceil(round(ready * s.kv_utilization / config.kv_target, 9))
        target = max(step, ready + 1) if settled and not s.draining else status.replicas
        candidates.append(
            (
                target,
                Reason.KV_PRESSURE,
                f"KV {s.kv_utilization:.0%} used; ceil({ready} x {s.kv_utilization:.3g} / "
                f"{config.kv_target:g}) = {step}",
            )
        )
    if by_capacity is not None:
        assert memory.capacity is not None
        extra = s.backlog_rate if settled else 0.0
        load = (s.demand + extra) / (memory.capacity * ready)
        limit = config.proactive_utilization if memory.capacity_trusted else config.panic_ratio
        # A lower bound learned at light load says little: panic on it only when
        # the pool also shows stress (latency above the band, a queue, KV filling).
        stressed = memory.capacity_trusted or not (s.shrink_ok or s.idle)
        if load > limit and stressed:
            candidates.append(
                (
                    by_capacity[0],
                    Reason.DEMAND,
                    f"arrivals are {load:.3g}x what {ready} ready serve (limit {limit:g}); "
                    f"{by_capacity[1]}",
                )
            )
    if not candidates:
        return None
    top = max(c[0] for c in candidates)
    for reason in UP_PRIORITY:
        for target, r, text in candidates:
            if r is reason and target == top:
                return target, r, text
    raise AssertionError("unreachable")  # pragma: no cover


def latency_name(s: PoolSignals) -> str:
    return "TTFT" if s.pool is Pool.PREFILL else "TPOT"


def scale_up(
    s: PoolSignals,
    status: PoolStatus,
    memory: PoolMemory,
    now: float,
    up: tuple[int, Reason, str],
) -> tuple[PoolDecision, PoolMemory]:
    target, reason, text = up
    memory = break_shrink(memory)
    bounded = status.bounds.clamp(max(status.replicas, target))
    if bounded > status.replicas:
        memory = replace(memory, last_up_at=now)
        return decision(s, status, memory, bounded, reason, text), memory
    if bounded < status.replicas:  # the bounds were lowered under the current size
        return decision(s, status, memory, bounded, Reason.BOUNDS, f"{text}; {status.bounds}"), (
            memory
        )
    if target > status.bounds.max_replicas:
        return decision(
            s,
            status,
            memory,
            bounded,
            Reason.AT_MAX,
            f"{text}; max is {status.bounds.max_replicas}",
        ), memory
    if status.ready < status.replicas:
        text = f"{text}; {status.replicas} asked, {status.ready} ready"
        return decision(s, status, memory, bounded, Reason.PENDING, text), memory
    # A trigger fired but asks for no more than the pool has: hold, saying why.
    return decision(s, status, memory, bounded, reason, text), memory
