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

This module runs those steps in order; each has its own module
(:mod:`.learning`, :mod:`.sizing`, :mod:`.scale_up`, :mod:`.scale_down`,
:mod:`.decisions`).
"""

from __future__ import annotations

from dataclasses import replace

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.decisions import break_shrink, hold_missing, since
from splitserve_operator.planner.learning import (
    is_settled,
    learn_capacity,
    learn_output_ratio,
    track_settling,
)
from splitserve_operator.planner.model import (
    Plan,
    PlannerState,
    Pool,
    PoolDecision,
    PoolMemory,
    PoolStatus,
    Tick,
)
from splitserve_operator.planner.scale_down import maybe_shrink
from splitserve_operator.planner.scale_up import scale_up, up_target
from splitserve_operator.planner.signals import (
    Missing,
    PoolSignals,
    decode_signals,
    prefill_signals,
)

__all__ = ["DEFAULT_CONFIG", "plan"]

DEFAULT_CONFIG = PlannerConfig()


def plan(state: PlannerState, tick: Tick, config: PlannerConfig = DEFAULT_CONFIG) -> Plan:
    """Decides both pools for one tick. Pure: same inputs, same :class:`Plan`."""
    obs = tick.observation
    if obs is None:
        why = "metrics source unreachable"
        return Plan(
            prefill=hold_missing(Pool.PREFILL, tick.prefill, state.prefill, why),
            decode=hold_missing(Pool.DECODE, tick.decode, state.decode, why),
            state=replace(
                state, prefill=break_shrink(state.prefill), decode=break_shrink(state.decode)
            ),
            metrics_ok=False,
        )

    pre = prefill_signals(obs, tick.slo, config)
    dec = decode_signals(obs, tick.slo, config, state.output_per_prompt_token)

    pre_decision, pre_memory = _pool_tick(pre, tick.prefill, state.prefill, tick.now, config)
    dec_decision, dec_memory = _pool_tick(dec, tick.decode, state.decode, tick.now, config)
    ratio = learn_output_ratio(state.output_per_prompt_token, obs, dec, config)
    return Plan(
        prefill=pre_decision,
        decode=dec_decision,
        state=PlannerState(prefill=pre_memory, decode=dec_memory, output_per_prompt_token=ratio),
        metrics_ok=not isinstance(pre, Missing) and not isinstance(dec, Missing),
    )


def _pool_tick(
    signals: PoolSignals | Missing,
    status: PoolStatus,
    memory: PoolMemory,
    now: float,
    config: PlannerConfig,
) -> tuple[PoolDecision, PoolMemory]:
    if isinstance(signals, Missing):
        decision = hold_missing(signals.pool, status, memory, f"missing {signals.what}")
        return decision, break_shrink(memory)
    memory = track_settling(memory, status, now)
    if signals.draining or not signals.quiet:
        memory = replace(memory, backlog_at=now)
    settled = is_settled(memory, now, config.observation_window_s)
    # Latency alone is trusted only when it cannot be the echo of a backlog:
    # the pool is settled and either saturated now or clear of any backlog
    # for a whole window.
    latency_trusted = settled and (
        signals.saturated or since(memory.backlog_at, now) >= config.observation_window_s
    )
    memory = learn_capacity(memory, signals, status.ready, now, config)
    up = up_target(signals, status, memory, config, settled, latency_trusted)
    if up is not None:
        return scale_up(signals, status, memory, now, up)
    return maybe_shrink(signals, status, memory, now, config)
