"""Values in and out of one planner tick. All frozen; all units in the names or docs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Pool(StrEnum):
    """A pool the planner sizes: prefill or decode. Not the spec's
    :class:`~splitserve_operator.api.values.Pool`, which also names the router (a pool the
    planner never scales); the values are the same strings, so
    ``api.values.Pool(pool.value)`` is the spec's pool of a planner pool."""

    PREFILL = "prefill"
    DECODE = "decode"


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class Reason(StrEnum):
    """Why a pool has the size it has after a tick."""

    SLO_BREACH = "SLOBreach"
    """The observed latency percentile is above the SLO."""
    QUEUE = "QueueBacklog"
    """Waiting in the router queue would take too much of the TTFT SLO."""
    KV_PRESSURE = "KVPressure"
    """Decode KV cache nearly full."""
    DEMAND = "DemandAboveCapacity"
    """Arrivals exceed what the learned capacity serves (ahead of a breach)."""
    IDLE = "Idle"
    """No traffic and empty queues: shrink to the minimum."""
    SURPLUS = "Surplus"
    """Comfortably within SLO and the learned capacity needs fewer replicas."""
    WITHIN_SLO = "WithinSLO"
    """Nothing to do."""
    STABILIZING = "Stabilizing"
    """A shrink is wanted but has not been wanted for long enough yet."""
    COOLDOWN = "Cooldown"
    """A shrink is wanted but a recent change forbids it for now."""
    PENDING = "ReplicasPending"
    """A scale-up is still starting; the current size already covers the need."""
    AT_MAX = "AtMaxReplicas"
    """More replicas are needed than the bounds allow."""
    BOUNDS = "OutsideBounds"
    """The current size was outside the bounds and has been brought inside."""
    MISSING_DATA = "MetricsUnavailable"
    """The metrics the decision needs are missing: hold."""


@dataclass(frozen=True)
class Slo:
    """The objectives one tick plans for, resolved to numbers. Not the spec's
    :class:`~splitserve_operator.api.models.SloSpec`, the wire form whose fields may be
    left out; the autoscaling loop turns one into the other."""

    ttft_s: float
    """Time to first token objective (s) at ``percentile``."""
    tpot_s: float
    """Time per output token objective (s) at ``percentile``."""
    percentile: float = 0.9
    """Quantile (0..1) the objectives apply to, e.g. 0.9 for p90."""


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"bad bounds: min {self.min_replicas} max {self.max_replicas}")

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class PoolStatus:
    replicas: int
    """Replicas the Deployment asks for now (its ``spec.replicas``)."""
    ready: int
    """Replicas ready to serve (``status.readyReplicas``)."""
    bounds: Bounds


@dataclass(frozen=True)
class Observation:
    """What the metrics showed over the last window. ``None`` means the series
    is absent (not scraped, not exported); 0 means it exists and is zero.
    Rates are per second, averaged over the window."""

    ttft_s: float | None = None
    """Observed TTFT at the SLO percentile (s); None when no first token in the window."""
    tpot_s: float | None = None
    """Observed TPOT at the SLO percentile (s); None when no request finished."""
    request_rate: float | None = None
    """Finished requests/s (router)."""
    prompt_token_rate: float | None = None
    """Prompt tokens/s received by the router (arrivals: not capped by capacity)."""
    prompt_token_rate_fast: float | None = None
    """The same rate over a short window (Knative's "panic window"): a load
    step shows here one tick after it starts, while the main window still
    averages it with what came before. Used to scale up sooner, never to
    scale down."""
    generation_token_rate: float | None = None
    """Generated tokens/s (router)."""
    prefill_queue: float | None = None
    """Requests waiting for a prefill worker (router)."""
    decode_queue: float | None = None
    """Requests waiting for a decode worker (router)."""
    kv_utilization: float | None = None
    """Decode pool KV blocks used over used + free (0..1)."""
    prefill_served_token_rate: float | None = None
    """Prompt tokens/s computed by the prefill pool; falls back to ``prompt_token_rate``."""
    decode_served_token_rate: float | None = None
    """Tokens/s decoded by the decode pool; falls back to ``generation_token_rate``."""


@dataclass(frozen=True)
class Tick:
    now: float
    """Seconds on any monotonic clock; only differences are used."""
    slo: Slo
    prefill: PoolStatus
    decode: PoolStatus
    observation: Observation | None
    """None when the metrics source could not be read at all."""


@dataclass(frozen=True)
class PoolMemory:
    """What the planner remembers about one pool between ticks."""

    capacity: float | None = None
    """Per-replica capacity (prefill: prompt tokens/s, decode: generated tokens/s)."""
    capacity_trusted: bool = False
    """True once capacity was measured while the pool was saturated; before
    that it is only a lower bound (what a replica served within the SLO)."""
    last_up_at: float | None = None
    last_down_at: float | None = None
    saturated_since: float | None = None
    """When the pool started to be saturated without a break (None: not saturated)."""
    backlog_at: float | None = None
    """Last tick at which the pool had a queue that was not quiet, or was
    draining one: latency percentiles lag a backlog by one window."""
    pending: bool = False
    """Fewer replicas were ready than asked for at the last tick."""
    settled_at: float | None = None
    """When the pool last became fully ready after being pending (None: long ago)."""
    shrink_since: float | None = None
    """When the shrink condition started to hold without a break."""
    shrink_proposals: tuple[tuple[float, int], ...] = ()
    """(time, size) proposed by the shrink rule within the last stabilisation
    window; a shrink goes to the largest of them."""


@dataclass(frozen=True)
class PlannerState:
    prefill: PoolMemory = field(default_factory=PoolMemory)
    decode: PoolMemory = field(default_factory=PoolMemory)
    output_per_prompt_token: float | None = None
    """Generated tokens per prompt token, learned while decode is not saturated:
    turns the (uncapped) prompt arrival rate into decode demand."""

    @classmethod
    def initial(
        cls, prefill_capacity: float | None = None, decode_capacity: float | None = None
    ) -> PlannerState:
        return cls(
            prefill=PoolMemory(capacity=prefill_capacity),
            decode=PoolMemory(capacity=decode_capacity),
        )


@dataclass(frozen=True)
class PoolDecision:
    pool: Pool
    previous: int
    replicas: int
    direction: Direction
    reason: Reason
    detail: str
    """One human line with the numbers behind the decision."""
    slo_ratio: float | None = None
    capacity: float | None = None

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


@dataclass(frozen=True)
class Plan:
    prefill: PoolDecision
    decode: PoolDecision
    state: PlannerState
    metrics_ok: bool
    """False when the tick held because metrics were missing."""

    def decisions(self) -> tuple[PoolDecision, PoolDecision]:
        return (self.prefill, self.decode)
