"""The planner's knobs: one frozen dataclass, every field with its unit and why.

Validated at construction (:meth:`PlannerConfig.__post_init__`), so a bad value
fails when the operator starts, not at the first tick.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlannerConfigError(ValueError):
    """A planner setting is out of range or contradicts another one."""


@dataclass(frozen=True)
class PlannerConfig:
    target_utilization: float = 0.8
    """Fraction of a replica's learned capacity the planner sizes a pool for
    (0..1). The capacity is learned at saturation, so this is the headroom
    left for bursts between two ticks and for the replica start-up time; 0.8
    leaves a fifth of each replica free."""

    proactive_utilization: float = 0.95
    """Predicted utilisation (demand over trusted capacity) above which a pool
    is scaled up before its latency breaks the SLO (a load step shows in the
    arrival rate one tick before it shows in the percentiles)."""

    panic_ratio: float = 2.0
    """Before capacity is trusted it is only a lower bound, so arrivals above it
    prove nothing; arrivals above this many times what the ready replicas have
    been seen to serve do (Knative's panic threshold, 200 %): scale up to
    serve them at the lower bound, without waiting for the SLO to break."""

    breach_ratio: float = 1.0
    """Observed percentile over SLO above which the SLO counts as broken."""

    scale_down_ratio: float = 0.8
    """Observed percentile over SLO below which a pool may shrink. The band
    between this and ``breach_ratio`` is the hysteresis that stops flapping;
    it is narrow because decode TPOT has a floor (an empty batch still reads
    every weight) that can sit at half the SLO or more, and because the size a
    pool shrinks to comes from its capacity, not from this ratio."""

    max_up_factor: float = 2.0
    """When capacity is not yet known, the most a breach can multiply a pool
    by in one tick (the reactive step is ``ceil(ready * min(ratio, this))``)."""

    queue_wait_budget: float = 0.5
    """Fraction of the TTFT SLO that time spent waiting in a router queue may
    take before the pool is scaled up, whatever the observed TTFT says:
    queued requests have not produced a first token yet, so the TTFT
    histogram lags the queue."""

    quiet_queue_fraction: float = 0.1
    """A queue whose predicted wait is under this fraction of the TTFT SLO
    counts as quiet: random arrivals keep a few requests queued in any busy
    pool (a tenth of a second's worth), and that must neither block a shrink
    nor count as saturation."""

    queue_drain_s: float = 30.0
    """Seconds (s) within which a sized-up pool should drain the requests
    already queued, on top of serving new arrivals."""

    kv_high: float = 0.90
    """Decode KV-cache utilisation (0..1) that triggers a scale-up: beyond it
    new sequences wait for blocks."""

    kv_target: float = 0.75
    """KV utilisation the decode pool is sized to after a KV-driven scale-up."""

    kv_low: float = 0.60
    """KV utilisation under which the decode pool may shrink."""

    down_stabilization_s: float = 120.0
    """Seconds (s) the shrink condition must hold without a break before a pool
    shrinks; it then shrinks to the largest size proposed in that window
    (the Kubernetes HPA's stabilisation window)."""

    cooldown_after_up_s: float = 300.0
    """Seconds (s) after a scale-up during which the pool is never shrunk: an
    up followed by a down within five minutes is what "flapping" means here
    (and in ``bench/planner.py``)."""

    cooldown_after_down_s: float = 60.0
    """Seconds (s) after a scale-down before the next scale-down."""

    observation_window_s: float = 60.0
    """Seconds (s) the metrics are averaged over (the PromQL window). After a
    pool's ready size changes, readings mix the old and new sizes until this
    has passed: in that time the planner neither learns capacity from the
    pool nor adds replicas on latency alone (the percentiles still show the
    queue the new replicas are draining); it sizes from capacity only."""

    capacity_alpha: float = 0.3
    """Weight (0..1) of a new saturated observation in the capacity estimate's
    moving average; 0.3 follows a real change within a few ticks and ignores a
    single noisy one."""

    prefill_capacity_hint: float | None = None
    """Optional prior for prefill capacity per replica (prompt tokens/s),
    e.g. from the simulator; ``None`` learns it from the metrics only."""

    decode_capacity_hint: float | None = None
    """Optional prior for decode capacity per replica (generated tokens/s)."""

    queue_epsilon: float = 0.5
    """Queue depths (requests) at or below this count as empty (gauges are
    averaged over scrapes and can read 0.33)."""

    def __post_init__(self) -> None:
        fractions = {
            "target_utilization": self.target_utilization,
            "queue_wait_budget": self.queue_wait_budget,
            "quiet_queue_fraction": self.quiet_queue_fraction,
            "kv_high": self.kv_high,
            "kv_target": self.kv_target,
            "kv_low": self.kv_low,
            "capacity_alpha": self.capacity_alpha,
        }
        for name, value in fractions.items():
            if not 0.0 < value <= 1.0:
                raise PlannerConfigError(f"{name}={value} must be in (0, 1]")
        if not self.target_utilization < self.proactive_utilization:
            raise PlannerConfigError(
                "target_utilization must be below proactive_utilization, or a freshly sized "
                "pool would immediately be scaled up again"
            )
        if not 0.0 < self.scale_down_ratio < self.breach_ratio:
            raise PlannerConfigError("need 0 < scale_down_ratio < breach_ratio (hysteresis band)")
        if not self.quiet_queue_fraction < self.queue_wait_budget:
            raise PlannerConfigError("quiet_queue_fraction must be below queue_wait_budget")
        if not self.kv_low < self.kv_target < self.kv_high:
            raise PlannerConfigError("need kv_low < kv_target < kv_high (hysteresis band)")
        if self.panic_ratio <= 1.0:
            raise PlannerConfigError("panic_ratio must be above 1")
        if self.max_up_factor <= 1.0:
            raise PlannerConfigError("max_up_factor must be above 1")
        for name in ("queue_drain_s", "down_stabilization_s", "observation_window_s"):
            if getattr(self, name) <= 0:
                raise PlannerConfigError(f"{name} must be positive")
        for name in ("cooldown_after_up_s", "cooldown_after_down_s", "queue_epsilon"):
            if getattr(self, name) < 0:
                raise PlannerConfigError(f"{name} must not be negative")
        for name in ("prefill_capacity_hint", "decode_capacity_hint"):
            hint = getattr(self, name)
            if hint is not None and hint <= 0:
                raise PlannerConfigError(f"{name} must be positive when set")
