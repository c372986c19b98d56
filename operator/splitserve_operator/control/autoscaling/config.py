"""The autoscaling loop's knobs: how often it wakes, how far back PromQL looks,
where the operator's own ``/metrics`` is served, and the planner's settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from splitserve.role_balance import BalanceConfig

from splitserve_operator.api.series import DEFAULT_SELECTOR
from splitserve_operator.planner.config import PlannerConfig

if TYPE_CHECKING:  # the HTTP client loads only where queries are made
    from splitserve_operator.control.prometheus import PrometheusAuth


@dataclass(frozen=True)
class FlexConfig:
    """How the loop weighs switching a pod of ``spec.flex`` against adding one."""

    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """The switch policy's knobs (:mod:`splitserve.role_balance`): at most one switch
    per ``min_dwell_s`` (60 s), pressure sustained for ``sustain_s`` (10 s), a donor
    under ``comfort_band`` of its SLO."""

    drain_s: float = 30.0
    """Seconds (s) a donor pod is expected to drain before it serves its new role: its
    streams run out or migrate within the worker's drain bound."""

    prefix_hit_ratio: float = 0.5
    """Share (0 to 1) of prompt tokens a donor's prefix cache is expected to serve; a
    switch loses that cache (the policy's ``cache_rewarm_s`` prices it)."""

    cold_start_s: float = 300.0
    """Seconds (s) a new worker pod takes to serve (scheduling, image, weights): what a
    switch is weighed against while the fixed pool it helps may still grow."""

    def __post_init__(self) -> None:
        if self.drain_s < 0 or self.cold_start_s < 0:
            raise ValueError("drain_s and cold_start_s must be >= 0 seconds")
        if not 0 <= self.prefix_hit_ratio <= 1:
            raise ValueError(f"prefix_hit_ratio must be in [0, 1], got {self.prefix_hit_ratio}")


@dataclass(frozen=True)
class AutoscaleConfig:
    resolution_s: float = 5.0
    """Seconds (s) between wake-ups of the operator-wide autoscaling loop
    (:mod:`.schedule`). Each InferenceService is ticked at its own
    ``autoscaling.interval`` (at least 5 s) on the loop's clock, so this only
    bounds how late a tick can be."""

    window_s: float = 60.0
    """Seconds (s) the PromQL rates and percentiles look back. Four scrapes at
    least: 60 s suits a 15 s scrape interval. Also the planner's
    ``observation_window_s`` (it waits this long after a resize before
    trusting what it sees)."""

    fast_window_s: float = 30.0
    """Seconds (s) of the short arrival-rate window that notices a load step
    sooner (two scrapes at least)."""

    integrity_window_s: float = 600.0
    """Seconds (s) over which a correctness-guard mismatch keeps the ``KVIntegrity``
    condition False (the chart's alert looks back as far): long enough to be read, short
    enough that a fixed service turns True again on its own."""

    selector_template: str = DEFAULT_SELECTOR
    """PromQL label matchers picking one service's series; ``{namespace}`` and
    ``{name}`` are filled in (see :data:`~splitserve_operator.api.series.DEFAULT_SELECTOR`)."""

    metrics_port: int | None = None
    """Port for the operator's own ``/metrics`` (planner decisions, desired vs
    ready replicas); None: not served. 0 picks a free port."""

    metrics_host: str = "0.0.0.0"

    prometheus_auth: PrometheusAuth | None = None
    """Credentials for the cluster's Prometheus (bearer token file, CA bundle), sent
    only to queries of the URL they name; None: queries go unauthenticated."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The planner's knobs; its ``observation_window_s`` is set to ``window_s``."""

    flex: FlexConfig = field(default_factory=FlexConfig)
    """How pods of a service's ``spec.flex`` are switched between roles."""

    forget_after_s: float = 3600.0
    """Seconds (s) without a tick after which a service's planner memory is
    dropped (it was deleted, or autoscaling was turned off)."""

    def planner_config(self) -> PlannerConfig:
        return replace(self.planner, observation_window_s=self.window_s)
