"""Prometheus objects for the specs in :mod:`splitserve.metric_names`, created on demand
per registry: the one place a :class:`~splitserve.metric_names.MetricSpec` becomes a
``prometheus_client`` counter, gauge or histogram, for the workers and the operator alike."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from splitserve.metric_names import Kind, MetricSpec


class Metrics:
    """Lazily creates each metric once in its registry; ``get(spec)`` returns it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._made: dict[str, MetricWrapperBase] = {}

    def get(self, spec: MetricSpec) -> MetricWrapperBase:
        made = self._made.get(spec.name)
        if made is not None:
            return made
        m: MetricWrapperBase
        if spec.kind is Kind.COUNTER:
            m = Counter(spec.name, spec.help, spec.labels, registry=self.registry)
        elif spec.kind is Kind.GAUGE:
            m = Gauge(spec.name, spec.help, spec.labels, registry=self.registry)
        else:
            m = Histogram(
                spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry
            )
        self._made[spec.name] = m
        return m

    def counter(self, spec: MetricSpec) -> Counter:
        assert spec.kind is Kind.COUNTER, spec.name
        m = self.get(spec)
        assert isinstance(m, Counter)
        return m

    def gauge(self, spec: MetricSpec) -> Gauge:
        assert spec.kind is Kind.GAUGE, spec.name
        m = self.get(spec)
        assert isinstance(m, Gauge)
        return m

    def histogram(self, spec: MetricSpec) -> Histogram:
        assert spec.kind is Kind.HISTOGRAM, spec.name
        m = self.get(spec)
        assert isinstance(m, Histogram)
        return m
