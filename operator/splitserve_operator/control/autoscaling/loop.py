"""The autoscaling loop: Prometheus in, the planner's decision out to the cluster.

Every ``autoscaling.interval`` (per InferenceService; a kopf timer wakes
every ``AutoscaleConfig.resolution_s`` and skips services whose interval has
not passed) :meth:`Autoscaler.tick`:

1. reads the pools' Deployments (ready replicas) and the planner's last
   ``status.pools.<pool>.desiredReplicas``;
2. asks the :class:`~splitserve_operator.control.prometheus.MetricsSource` for one
   observation (PromQL over Prometheus's HTTP API);
3. runs the pure planner (:func:`splitserve_operator.planner.core.plan`);
4. writes the decision where the operator's seam expects it,
   ``status.pools.<pool>.desiredReplicas`` (the reconciler applies it to the
   Deployment, clamped to the bounds; see ``render/replicas.py``), with the
   reasons under ``status.autoscaling`` and the ``ScalingActive`` condition;
   records an Event on every change, and updates the operator's metrics.

Prometheus unreachable or the series missing: the planner holds, the
condition ``ScalingActive`` turns False with reason ``MetricsUnavailable``,
one Warning event says why, and no replica count moves.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.metric_server import MetricsServer, start_metrics_server

from splitserve_operator.api.fields import as_int, as_map, timestamp
from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.autoscaling.metrics import OperatorMetrics
from splitserve_operator.control.autoscaling.status import (
    POOLS,
    REASON_ACTIVE,
    REASON_HOLDING,
    event_message,
    event_reason,
    hold_message,
    status_patch,
)
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE, ApiError, Cluster
from splitserve_operator.control.prometheus import (
    MetricsSource,
    MetricsUnavailable,
    PrometheusSource,
    Target,
)
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.model import Bounds, Plan, PlannerState, PoolStatus, Slo, Tick
from splitserve_operator.planner.model import Pool as PlannerPool

log = logging.getLogger(__name__)


@dataclass
class _Memory:
    state: PlannerState
    last_tick: float
    scaling_active: bool | None = None
    last_scale: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TickResult:
    plan: Plan
    patched: bool
    hold_reason: str | None
    """Why the tick held for missing data, else None."""


class Autoscaler:
    """Runs planner ticks for every InferenceService with autoscaling enabled."""

    def __init__(
        self,
        cluster: Cluster,
        config: AutoscaleConfig | None = None,
        *,
        source_factory: Callable[[str], MetricsSource] | None = None,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        record_events: bool = True,
    ) -> None:
        self.cluster = cluster
        self.config = config or AutoscaleConfig()
        self.metrics = metrics or OperatorMetrics()
        self._source_factory = source_factory or self._prometheus
        self._sources: dict[str, MetricsSource] = {}
        self._memory: dict[tuple[str, str, str], _Memory] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall_clock
        self._record_events = record_events
        self._server: MetricsServer | None = None

    def _prometheus(self, url: str) -> MetricsSource:
        return PrometheusSource(
            url, selector_template=self.config.selector_template, auth=self.config.prometheus_auth
        )

    def _source(self, url: str) -> MetricsSource:
        with self._lock:
            source = self._sources.get(url)
            if source is None:
                source = self._sources[url] = self._source_factory(url)
            return source

    # -- the operator's own /metrics ------------------------------------------------

    def start_metrics_server(self) -> int | None:
        if self.config.metrics_port is None or self._server is not None:
            return self._server.port if self._server else None
        self._server = start_metrics_server(
            self.config.metrics_port, self.metrics.registry, host=self.config.metrics_host
        )
        log.info("operator metrics on %s", self._server.url)
        return self._server.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for source in self._sources.values():
            close = getattr(source, "close", None)
            if callable(close):
                close()
        self._sources.clear()

    # -- one tick ----------------------------------------------------------------------

    def due(self, body: Mapping[str, Any]) -> bool:
        """Whether ``body``'s interval has passed since its last tick."""
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return False
        if not spec.autoscaling.enabled:
            return False
        memory = self._memory.get(self._key(body))
        return memory is None or (
            self._clock() - memory.last_tick >= spec.autoscaling.interval - 0.5
        )

    @staticmethod
    def _key(body: Mapping[str, Any]) -> tuple[str, str, str]:
        meta = as_map(body.get("metadata"))
        return (
            str(meta.get("namespace") or ""),
            str(meta.get("name") or ""),
            str(meta.get("uid") or ""),
        )

    def tick(self, body: Mapping[str, Any], *, force: bool = False) -> TickResult | None:
        """One planner tick for ``body`` if it is due (or ``force``); None if skipped."""
        if not force and not self.due(body):
            return None
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return None
        if not spec.autoscaling.enabled or spec.autoscaling.prometheus_url is None:
            return None
        namespace, name, _uid = key = self._key(body)
        now = self._clock()
        self._forget_stale(now)
        statuses = self._pool_statuses(body, spec, namespace, name)
        if statuses is None:
            return None  # Deployments not created yet: the reconciler is still at work
        slo = Slo(
            ttft_s=float(spec.slo.ttft or 0.0),
            tpot_s=float(spec.slo.tpot or 0.0),
            percentile=spec.slo.quantile,
        )
        target = Target(
            namespace, name, slo.percentile, self.config.window_s, self.config.fast_window_s
        )
        hold_reason: str | None = None
        try:
            observation = self._source(spec.autoscaling.prometheus_url).observe(target)
        except MetricsUnavailable as exc:
            observation, hold_reason = None, str(exc)
        memory = self._memory.get(key)
        if memory is None:
            memory = _Memory(
                state=PlannerState.initial(
                    self.config.planner.prefill_capacity_hint,
                    self.config.planner.decode_capacity_hint,
                ),
                last_tick=now,
            )
            self._memory[key] = memory
        result = plan(
            memory.state,
            Tick(
                now=now,
                slo=slo,
                prefill=statuses[PlannerPool.PREFILL],
                decode=statuses[PlannerPool.DECODE],
                observation=observation,
            ),
            self.config.planner_config(),
        )
        memory.state = result.state
        memory.last_tick = now
        if not result.metrics_ok and hold_reason is None:
            hold_reason = (
                "; ".join(
                    d.detail.removeprefix("holding: ")
                    for d in result.decisions()
                    if d.reason.value == REASON_HOLDING
                )
                or "metrics missing"
            )
        patched = self._write(body, spec, result, memory, hold_reason)
        ready = {p: s.ready for p, s in statuses.items()}
        self.metrics.record(namespace, name, result, ready, slo)
        self._events(body, result, memory, hold_reason)
        for d in result.decisions():
            if d.changed:
                log.info(
                    "%s/%s %s %d -> %d: %s: %s",
                    namespace,
                    name,
                    d.pool.value,
                    d.previous,
                    d.replicas,
                    d.reason.value,
                    d.detail,
                )
        return TickResult(plan=result, patched=patched, hold_reason=hold_reason)

    def _forget_stale(self, now: float) -> None:
        stale = [
            k for k, m in self._memory.items() if now - m.last_tick > self.config.forget_after_s
        ]
        for k in stale:
            del self._memory[k]

    def _pool_statuses(
        self, body: Mapping[str, Any], spec: InferenceServiceSpec, namespace: str, name: str
    ) -> dict[PlannerPool, PoolStatus] | None:
        recorded = as_map(as_map(body.get("status")).get("pools"))
        out: dict[PlannerPool, PoolStatus] = {}
        for planner_pool, pool in POOLS.items():
            deployment = self.cluster.get(DEPLOYMENT, namespace, f"{name}-{pool.value}")
            if deployment is None:
                return None
            applied = as_int(as_map(deployment.get("spec")).get("replicas"))
            ready = as_int(as_map(deployment.get("status")).get("readyReplicas")) or 0
            desired = as_int(as_map(recorded.get(pool.value)).get("desiredReplicas"))
            bounds = spec.autoscaling.bounds(pool)
            current = desired if desired is not None else (applied if applied is not None else 1)
            out[planner_pool] = PoolStatus(
                replicas=current,
                ready=ready,
                bounds=Bounds(bounds.min_replicas, bounds.max_replicas),
            )
        return out

    # -- writing the decision ------------------------------------------------------------

    def _write(
        self,
        body: Mapping[str, Any],
        spec: InferenceServiceSpec,
        result: Plan,
        memory: _Memory,
        hold_reason: str | None,
    ) -> bool:
        namespace, name, _ = self._key(body)
        stamp = timestamp(self._wall())
        patch = status_patch(body, result, memory.last_scale, hold_reason, stamp)
        try:
            self.cluster.patch(
                INFERENCE_SERVICE, namespace, name, {"status": patch}, subresource="status"
            )
        except ApiError as exc:  # the next tick retries
            log.warning("could not write the planner's decision on %s/%s: %s", namespace, name, exc)
            return False
        return True

    def _events(
        self, body: Mapping[str, Any], result: Plan, memory: _Memory, hold_reason: str | None
    ) -> None:
        active = hold_reason is None
        was = memory.scaling_active
        memory.scaling_active = active
        if not self._record_events:
            return
        if not active and was is not False:
            self.cluster.event(
                body,
                "Warning",
                REASON_HOLDING,
                hold_message(hold_reason),
            )
        elif active and was is False:
            self.cluster.event(body, "Normal", REASON_ACTIVE, "metrics are back; planning again")
        for d in result.decisions():
            if d.changed:
                self.cluster.event(body, "Normal", event_reason(d), event_message(d))
