"""The planner: one tick's input in, a decision and the next state out.

No I/O, no clock: time comes in :attr:`Tick.now`. The operator's loop feeds
it what Prometheus showed; the bench feeds it a simulator; the unit tests feed
it numbers worked out by hand.

Per pool, in order:

1. learn: per-replica capacity from what the pool served. Measured while the
   pool is saturated it is the capacity (moving average); while it is not, it
   is only a lower bound (what one replica served inside the SLO).
2. scale up when a trigger fires: the SLO is broken, the router queue would
   eat too much of the TTFT budget, decode KV is nearly full, or (with a
   trusted capacity) arrivals already exceed what the pool can serve. The new
   size is the largest of the triggers' targets and never less than ready + 1.
   Targets count from the demand, not from the current size, so a scale-up
   still starting is not compounded by the next tick.
3. scale down only when comfortably inside the SLO (below the hysteresis
   band, no queue, KV low) for a whole stabilisation window, outside the
   cooldowns, to the largest size proposed during that window; idle pools go
   to their minimum the same way.
4. hold otherwise, and always hold on missing data.
"""

from __future__ import annotations

import math
from dataclasses import replace

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.model import (
    Direction,
    Observation,
    Plan,
    PlannerState,
    Pool,
    PoolDecision,
    PoolMemory,
    PoolStatus,
    Reason,
    Tick,
)
from splitserve_operator.planner.signals import (
    Missing,
    PoolSignals,
    decode_signals,
    prefill_signals,
)

DEFAULT_CONFIG = PlannerConfig()

MIN_LEARN_RATE = 1.0
"""Served tokens/s per replica below which an observation teaches nothing about
capacity (an idle pool's trickle would make every later size enormous)."""

MAX_NEED = 1e6
"""Replica counts computed above this are cut here (the bounds cut further)."""

UP_PRIORITY = (Reason.SLO_BREACH, Reason.QUEUE, Reason.KV_PRESSURE, Reason.DEMAND)
"""When several triggers ask for the same size, the reason reported is the first here."""


def plan(state: PlannerState, tick: Tick, config: PlannerConfig = DEFAULT_CONFIG) -> Plan:
    """Decides both pools for one tick. Pure: same inputs, same :class:`Plan`."""
    obs = tick.observation
    if obs is None:
        why = "metrics source unreachable"
        return Plan(
            prefill=_hold_missing(Pool.PREFILL, tick.prefill, state.prefill, why),
            decode=_hold_missing(Pool.DECODE, tick.decode, state.decode, why),
            state=replace(
                state, prefill=_break_shrink(state.prefill), decode=_break_shrink(state.decode)
            ),
            metrics_ok=False,
        )

    pre = prefill_signals(obs, tick.slo, config)
    dec = decode_signals(obs, tick.slo, config, state.output_per_prompt_token)

    pre_decision, pre_memory = _pool_tick(pre, tick.prefill, state.prefill, tick.now, config)
    dec_decision, dec_memory = _pool_tick(dec, tick.decode, state.decode, tick.now, config)
    ratio = _learn_output_ratio(state.output_per_prompt_token, obs, dec, config)
    return Plan(
        prefill=pre_decision,
        decode=dec_decision,
        state=PlannerState(prefill=pre_memory, decode=dec_memory, output_per_prompt_token=ratio),
        metrics_ok=not isinstance(pre, Missing) and not isinstance(dec, Missing),
    )


# ---------------------------------------------------------------- learning


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
    if _since(memory.last_down_at, now) < config.observation_window_s:
        return memory
    if memory.capacity is None or per_replica > memory.capacity:
        return replace(memory, capacity=per_replica)
    return memory


def _learn_output_ratio(
    prev: float | None, obs: Observation, dec: PoolSignals | Missing, config: PlannerConfig
) -> float | None:
    """Generated tokens per prompt token, averaged while decode is not saturated."""
    if isinstance(dec, Missing) or dec.saturated:
        return prev
    prompt, gen = obs.prompt_token_rate, obs.generation_token_rate
    if prompt is None or gen is None or prompt <= 0 or gen <= 0:
        return prev
    sample = gen / prompt
    if prev is None:
        return sample
    return prev + config.capacity_alpha * (sample - prev)


# ---------------------------------------------------------------- deciding


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


def _pool_tick(
    signals: PoolSignals | Missing,
    status: PoolStatus,
    memory: PoolMemory,
    now: float,
    config: PlannerConfig,
) -> tuple[PoolDecision, PoolMemory]:
    if isinstance(signals, Missing):
        decision = _hold_missing(signals.pool, status, memory, f"missing {signals.what}")
        return decision, _break_shrink(memory)
    memory = track_settling(memory, status, now)
    if signals.draining or not signals.quiet:
        memory = replace(memory, backlog_at=now)
    settled = is_settled(memory, now, config.observation_window_s)
    # Latency alone is trusted only when it cannot be the echo of a backlog:
    # the pool is settled and either saturated now or clear of any backlog
    # for a whole window.
    latency_trusted = settled and (
        signals.saturated or _since(memory.backlog_at, now) >= config.observation_window_s
    )
    memory = learn_capacity(memory, signals, status.ready, now, config)
    up = _up_target(signals, status, memory, config, settled, latency_trusted)
    if up is not None:
        return _scale_up(signals, status, memory, now, up)
    return _maybe_shrink(signals, status, memory, now, config)


def _up_target(
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
                f"{_latency_name(s)} {s.latency_s:.4g}s is {s.slo_ratio:.3g}x the SLO "
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


def _latency_name(s: PoolSignals) -> str:
    return "TTFT" if s.pool is Pool.PREFILL else "TPOT"


def _scale_up(
    s: PoolSignals,
    status: PoolStatus,
    memory: PoolMemory,
    now: float,
    up: tuple[int, Reason, str],
) -> tuple[PoolDecision, PoolMemory]:
    target, reason, text = up
    memory = _break_shrink(memory)
    bounded = status.bounds.clamp(max(status.replicas, target))
    if bounded > status.replicas:
        memory = replace(memory, last_up_at=now)
        return _decision(s, status, memory, bounded, reason, text), memory
    if bounded < status.replicas:  # the bounds were lowered under the current size
        return _decision(s, status, memory, bounded, Reason.BOUNDS, f"{text}; {status.bounds}"), (
            memory
        )
    if target > status.bounds.max_replicas:
        return _decision(
            s,
            status,
            memory,
            bounded,
            Reason.AT_MAX,
            f"{text}; max is {status.bounds.max_replicas}",
        ), memory
    if status.ready < status.replicas:
        text = f"{text}; {status.replicas} asked, {status.ready} ready"
        return _decision(s, status, memory, bounded, Reason.PENDING, text), memory
    # A trigger fired but asks for no more than the pool has: hold, saying why.
    return _decision(s, status, memory, bounded, reason, text), memory


def _maybe_shrink(
    s: PoolSignals, status: PoolStatus, memory: PoolMemory, now: float, config: PlannerConfig
) -> tuple[PoolDecision, PoolMemory]:
    if not (s.idle or s.shrink_ok):
        memory = _break_shrink(memory)
        return _within(s, status, memory, "inside the hysteresis band"), memory
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
        memory = _break_shrink(memory)
        return _within(s, status, memory, how), memory
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
        return _decision(s, status, memory, status.replicas, Reason.STABILIZING, text), memory
    since_up = _since(memory.last_up_at, now)
    since_down = _since(memory.last_down_at, now)
    if since_up < config.cooldown_after_up_s or since_down < config.cooldown_after_down_s:
        text = (
            f"{how}; last up {since_up:.0f}s ago (cooldown {config.cooldown_after_up_s:g}s), "
            f"last down {since_down:.0f}s ago (cooldown {config.cooldown_after_down_s:g}s)"
        )
        return _decision(s, status, memory, status.replicas, Reason.COOLDOWN, text), memory
    target = max(p[1] for p in memory.shrink_proposals)
    if target >= status.replicas:
        text = f"{how}; but {target} was proposed within the last {config.down_stabilization_s:g}s"
        return _decision(s, status, memory, status.replicas, Reason.STABILIZING, text), memory
    text = f"{how}; largest proposal in the last {config.down_stabilization_s:g}s: {target}"
    memory = replace(memory, last_down_at=now)
    return _decision(s, status, memory, target, reason, text), memory


def _since(t: float | None, now: float) -> float:
    return math.inf if t is None else now - t


def _break_shrink(memory: PoolMemory) -> PoolMemory:
    if memory.shrink_since is None and not memory.shrink_proposals:
        return memory
    return replace(memory, shrink_since=None, shrink_proposals=())


def _within(s: PoolSignals, status: PoolStatus, memory: PoolMemory, why: str) -> PoolDecision:
    bounded = status.bounds.clamp(status.replicas)
    if bounded != status.replicas:
        return _decision(s, status, memory, bounded, Reason.BOUNDS, f"bounds {status.bounds}")
    ratio = "no latency reading" if s.slo_ratio is None else f"{s.slo_ratio:.3g}x SLO"
    return _decision(s, status, memory, status.replicas, Reason.WITHIN_SLO, f"{ratio}; {why}")


def _decision(
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


def _hold_missing(pool: Pool, status: PoolStatus, memory: PoolMemory, why: str) -> PoolDecision:
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
