"""From one :class:`~.model.Observation` to what each pool's rule needs.

Pure arithmetic. Each pool reads its own signals: prefill follows TTFT and the
prefill queue, decode follows TPOT, KV utilisation and the decode queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.model import Observation, Pool, Slo


@dataclass(frozen=True)
class PoolSignals:
    pool: Pool
    slo_ratio: float | None
    """Observed percentile over its SLO; None when there was no reading."""
    latency_s: float | None
    slo_s: float
    demand: float
    """Work arriving, in the pool's capacity unit per second (the larger of the
    main and the fast window: what a scale-up sizes for)."""
    recent_demand: float
    """The same over the fast window alone when there is one (what a shrink
    sizes for: after a load drop the main window lags; the stabilisation
    window's maximum covers the fast window's noise)."""
    served: float
    """Work the pool did, same unit (what capacity is learned from)."""
    backlog_rate: float
    """Extra rate needed to drain the queue within ``queue_drain_s``."""
    queue: float
    queue_wait_s: float
    """Little's law: queued requests over the rate requests leave (s)."""
    queue_budget_s: float
    """Wait allowed in a router queue: ``queue_wait_budget`` x the TTFT SLO (s).
    Both queues delay the first token, so both are budgeted against TTFT."""
    kv_utilization: float | None
    idle: bool
    breach: bool
    queue_pressure: bool
    kv_pressure: bool
    shrink_ok: bool
    """Comfortably inside the SLO: latency under the hysteresis band, queue quiet, KV low."""
    quiet: bool
    """The queue's predicted wait is under ``quiet_queue_fraction`` of the TTFT SLO."""
    draining: bool
    """The pool serves clearly more than arrives (``served > demand x
    DRAINING_MARGIN``): it is catching up on a backlog, and its latency
    percentiles still show requests that waited before it caught up."""
    saturated: bool
    """The pool serves as much as it can, so what it serves per replica is its
    capacity. Prefill: the queue takes more than its share of the TTFT
    budget, or the SLO is broken with requests queued (a slow TTFT with no
    queue is a slow prompt, not a full pool; a short queue inside the SLO is
    what random arrivals do to any pool that is not idle). Decode: TPOT over the SLO (bigger batches
    than the SLO allows), KV nearly full, or requests queued."""


DRAINING_MARGIN = 1.1
"""Served over demand above which a pool counts as draining a backlog (10 %
is well above the noise of rates averaged over a window)."""


@dataclass(frozen=True)
class Missing:
    pool: Pool
    what: str


def _ratio(latency: float | None, slo: float) -> float | None:
    if latency is None or math.isnan(latency):
        return None
    return latency / slo


def _queue_wait(queue: float, request_rate: float, eps: float) -> float:
    if queue <= eps:
        return 0.0
    if request_rate <= 0:
        return math.inf  # requests wait and none leave
    return queue / request_rate


def _arrivals(obs: Observation) -> float | None:
    """Prompt tokens/s arriving: the larger of the main and the fast window."""
    if obs.prompt_token_rate is None:
        return None
    if obs.prompt_token_rate_fast is None:
        return obs.prompt_token_rate
    return max(obs.prompt_token_rate, obs.prompt_token_rate_fast)


def prefill_signals(obs: Observation, slo: Slo, cfg: PlannerConfig) -> PoolSignals | Missing:
    if obs.prompt_token_rate is None:
        return Missing(Pool.PREFILL, "prompt token rate (router not scraped?)")
    stable = obs.prompt_token_rate
    prompt_rate = max(stable, obs.prompt_token_rate_fast or 0.0)
    request_rate = obs.request_rate or 0.0
    queue = obs.prefill_queue or 0.0
    ratio = _ratio(obs.ttft_s, slo.ttft_s)
    mean_prompt = stable / request_rate if request_rate > 0 else 0.0
    wait = _queue_wait(queue, request_rate, cfg.queue_epsilon)
    breach = ratio is not None and ratio > cfg.breach_ratio
    budget = cfg.queue_wait_budget * slo.ttft_s
    empty_queue = queue <= cfg.queue_epsilon
    quiet = wait <= cfg.quiet_queue_fraction * slo.ttft_s
    served = obs.prefill_served_token_rate
    return PoolSignals(
        pool=Pool.PREFILL,
        slo_ratio=ratio,
        latency_s=obs.ttft_s,
        slo_s=slo.ttft_s,
        demand=prompt_rate,
        recent_demand=obs.prompt_token_rate_fast
        if obs.prompt_token_rate_fast is not None
        else stable,
        served=served if served is not None else prompt_rate,
        backlog_rate=(queue * mean_prompt / cfg.queue_drain_s) if not empty_queue else 0.0,
        queue=queue,
        queue_wait_s=wait,
        queue_budget_s=budget,
        kv_utilization=None,
        idle=prompt_rate <= 0 and empty_queue,
        breach=breach,
        queue_pressure=wait > budget,
        kv_pressure=False,
        shrink_ok=(ratio is None or ratio < cfg.scale_down_ratio) and quiet,
        quiet=quiet,
        draining=(served if served is not None else stable) > prompt_rate * DRAINING_MARGIN,
        saturated=wait > budget or (breach and not quiet),
    )


def decode_signals(
    obs: Observation, slo: Slo, cfg: PlannerConfig, output_per_prompt_token: float | None
) -> PoolSignals | Missing:
    if obs.generation_token_rate is None:
        return Missing(Pool.DECODE, "generation token rate (router not scraped?)")
    gen_rate = obs.generation_token_rate
    request_rate = obs.request_rate or 0.0
    queue = obs.decode_queue or 0.0
    kv = obs.kv_utilization
    ratio = _ratio(obs.tpot_s, slo.tpot_s)
    # Generated tokens are capped by what decode can do while it is saturated
    # and inflated while it catches up; the prompt arrival rate is neither, so
    # once the ratio is known, arrivals are the demand.
    demand = recent = gen_rate
    arrivals = _arrivals(obs)
    if output_per_prompt_token is not None and arrivals is not None:
        demand = arrivals * output_per_prompt_token
        fast = obs.prompt_token_rate_fast
        recent = (fast if fast is not None else arrivals) * output_per_prompt_token
    mean_output = gen_rate / request_rate if request_rate > 0 else 0.0
    wait = _queue_wait(queue, request_rate, cfg.queue_epsilon)
    empty_queue = queue <= cfg.queue_epsilon
    quiet = wait <= cfg.quiet_queue_fraction * slo.ttft_s
    budget = cfg.queue_wait_budget * slo.ttft_s
    served = obs.decode_served_token_rate
    breach = ratio is not None and ratio > cfg.breach_ratio
    kv_pressure = kv is not None and kv >= cfg.kv_high
    no_arrivals = obs.prompt_token_rate is None or obs.prompt_token_rate <= 0
    return PoolSignals(
        pool=Pool.DECODE,
        slo_ratio=ratio,
        latency_s=obs.tpot_s,
        slo_s=slo.tpot_s,
        demand=demand,
        recent_demand=recent,
        served=served if served is not None else gen_rate,
        backlog_rate=(queue * mean_output / cfg.queue_drain_s) if not empty_queue else 0.0,
        queue=queue,
        queue_wait_s=wait,
        queue_budget_s=budget,
        kv_utilization=kv,
        idle=gen_rate <= 0 and empty_queue and no_arrivals,
        breach=breach,
        queue_pressure=wait > budget,
        kv_pressure=kv_pressure,
        shrink_ok=(ratio is None or ratio < cfg.scale_down_ratio)
        and quiet
        and (kv is None or kv < cfg.kv_low),
        quiet=quiet,
        draining=(served if served is not None else gen_rate) > demand * DRAINING_MARGIN,
        saturated=breach or kv_pressure or not quiet,
    )
