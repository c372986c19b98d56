"""The operator's own Prometheus series: what the planner decided and why,
desired against ready replicas, the objectives it scales for."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics

from splitserve_operator.planner.model import Plan, Slo
from splitserve_operator.planner.model import Pool as PlannerPool


class OperatorMetrics:
    """The operator's series (names from :mod:`splitserve.metric_names`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.metrics = Metrics(registry)
        self.registry = self.metrics.registry
        self.decisions = self.metrics.counter(names.PLANNER_DECISIONS)
        self.desired = self.metrics.gauge(names.REPLICAS_DESIRED)
        self.ready = self.metrics.gauge(names.REPLICAS_READY)
        self.available = self.metrics.gauge(names.PLANNER_METRICS_AVAILABLE)
        self.capacity = self.metrics.gauge(names.PLANNER_CAPACITY)
        self.slo_ratio = self.metrics.gauge(names.PLANNER_SLO_RATIO)
        self.slo_target = self.metrics.gauge(names.SLO_TARGET)

    def record(
        self,
        namespace: str,
        name: str,
        result: Plan,
        ready: Mapping[PlannerPool, int],
        slo: Slo,
    ) -> None:
        for objective, seconds in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
            self.slo_target.labels(namespace=namespace, service=name, objective=objective).set(
                seconds
            )
        self.available.labels(namespace=namespace, service=name).set(
            1.0 if result.metrics_ok else 0.0
        )
        for d in result.decisions():
            labels = {"namespace": namespace, "service": name, "pool": d.pool.value}
            self.decisions.labels(direction=d.direction.value, **labels).inc()
            self.desired.labels(**labels).set(d.replicas)
            self.ready.labels(**labels).set(ready[d.pool])
            if d.capacity is not None:
                self.capacity.labels(**labels).set(d.capacity)
            if d.slo_ratio is not None:
                self.slo_ratio.labels(**labels).set(d.slo_ratio)
