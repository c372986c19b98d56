"""What the planner learns from each tick: settling, per-replica capacity, output ratio."""

from __future__ import annotations

import math
from dataclasses import replace

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.decisions import since
from splitserve_operator.planner.model import Observation, PoolMemory, PoolStatus
from splitserve_operator.planner.signals import Missing, PoolSignals

MIN_LEARN_RATE = 1.0
"""Served tokens/s per replica below which an observation teaches nothing about
capacity (an idle pool's trickle would make every later size enormous)."""


def track_settling(memory: PoolMemory, status: PoolStatus, now: float) -> PoolMemory:
    """Notes when a pool that was starting replicas has all of them ready."""
    if status.ready < status.replicas:
        return memory if memory.pending else replace(memory, pending=True)
    if memory.pending:
        return replace(memory, pending=False, settled_at=now)
    return memory


def is_settled(memory: PoolMemory, now: float, window_s: float) -> bool:
    """All replicas ready, for at least one observation window."""
    if memory.pending:
        return False
    return memory.settled_at is None or now - memory.settled_at >= window_s


def learn_capacity(
    memory: PoolMemory, signals: PoolSignals, ready: int, now: float, config: PlannerConfig
) -> PoolMemory:
    """Updates the per-replica capacity from one observation of a ready pool.

    Saturated (see :attr:`PoolSignals.saturated`) for a whole observation
    window that also began after the pool last changed size (a shorter spell
    mixes the pool's peak with what came before):
    ``capacity += alpha * (served/ready - capacity)``, or the first such value
    outright, and the estimate becomes trusted. Not saturated:
    ``capacity = max(capacity, served/ready)``, a lower bound (trust
    unchanged), also while the pool drains a backlog with replicas just
    added (the peak a replica is seen to serve) but not within a window
    after replicas were removed.
    """
    if not signals.saturated:
        memory = replace(memory, saturated_since=None) if memory.saturated_since else memory
    elif memory.saturated_since is None:
        memory = replace(memory, saturated_since=now)
    if ready <= 0 or memory.pending:
        return memory
    per_replica = signals.served / ready
    if per_replica < MIN_LEARN_RATE:
        return memory
    if signals.saturated:
        assert memory.saturated_since is not None
        start = max(memory.saturated_since, memory.settled_at or -math.inf)
        if now - start < config.observation_window_s:
            return memory
        if memory.capacity is None or not memory.capacity_trusted:
            return replace(memory, capacity=per_replica, capacity_trusted=True)
        blended = memory.capacity + config.capacity_alpha * (per_replica - memory.capacity)
        return replace(memory, capacity=blended)
    # served/ready is a lower bound of the capacity unless replicas were
    # removed within the window (then the served rate counts replicas gone).
    if since(memory.last_down_at, now) < config.observation_window_s:
        return memory
    if memory.capacity is None or per_replica > memory.capacity:
        return replace(memory, capacity=per_replica)
    return memory


def learn_output_ratio(
    prev: float | None, obs: Observation, dec: PoolSignals | Missing, config: PlannerConfig
) -> float | None:
    """Generated tokens per prompt token, averaged while decode is not saturated.

    Prompt rates under :data:`MIN_LEARN_RATE` teach nothing: a trickle of prompt tokens
    (a rate window's tail) would make the ratio, and every decode size after it, huge
    or infinite."""
    if isinstance(dec, Missing) or dec.saturated:
        return prev
    prompt, gen = obs.prompt_token_rate, obs.generation_token_rate
    if prompt is None or gen is None or prompt < MIN_LEARN_RATE or gen <= 0:
        return prev
    sample = gen / prompt
    if prev is None:
        return sample
    return prev + config.capacity_alpha * (sample - prev)
