"""The autoscaling loop's knobs: how often it wakes, how far back PromQL looks,
where the operator's own ``/metrics`` is served, and the planner's settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from splitserve_operator.api.series import DEFAULT_SELECTOR
from splitserve_operator.planner.config import PlannerConfig

if TYPE_CHECKING:  # the HTTP client loads only where queries are made
    from splitserve_operator.control.prometheus import PrometheusAuth


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

    forget_after_s: float = 3600.0
    """Seconds (s) without a tick after which a service's planner memory is
    dropped (it was deleted, or autoscaling was turned off)."""

    def planner_config(self) -> PlannerConfig:
        return replace(self.planner, observation_window_s=self.window_s)
