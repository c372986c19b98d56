"""A ``/metrics`` target whose router and worker series follow a load mix the test sets.

For tests of the planner's decisions against the real Prometheus where real workers
would only add noise: each scrape reports counters and histograms integrated from the
current :class:`Mix` since the last change (requests per second, tokens per request,
every request's TTFT and TPOT at one value), under the metric names and labels of
:mod:`splitserve.metric_names`, so the operator's own PromQL reads them as it reads a
real service's. ``role="decode"`` KV gauges give the KV use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from splitserve import metric_names as names
from splitserve.metric_server import MetricsServer, start_metrics_server

KV_BLOCKS = 1000


@dataclass(frozen=True)
class Mix:
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    kv_used: float
    """Share of the decode KV blocks in use (0 to 1)."""


class SyntheticService(Collector):
    def __init__(self, mix: Mix, clock: Callable[[], float] = time.monotonic) -> None:
        self._mix = mix
        self._clock = clock
        self._at = clock()
        self._lock = threading.Lock()
        self._requests = self._prompt = self._generated = 0.0
        self._ttft = [0.0] * (len(names.TTFT.buckets) + 1)
        self._tpot = [0.0] * (len(names.TPOT.buckets) + 1)

    def _advance(self) -> None:
        now = self._clock()
        n = self._mix.requests_per_s * (now - self._at)
        self._at = now
        self._requests += n
        self._prompt += n * self._mix.prompt_tokens
        self._generated += n * self._mix.output_tokens
        _observe(self._ttft, names.TTFT.buckets, self._mix.ttft_s, n)
        _observe(self._tpot, names.TPOT.buckets, self._mix.tpot_s, n)

    def set(self, mix: Mix) -> None:
        """From now on the series follow ``mix``."""
        with self._lock:
            self._advance()
            self._mix = mix

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._advance()
            requests = CounterMetricFamily(
                names.REQUESTS.name.removesuffix("_total"), "requests", labels=["outcome"]
            )
            requests.add_metric(["ok"], self._requests)
            yield requests
            for spec, value in ((names.PROMPT_TOKENS, self._prompt),
                                (names.GENERATION_TOKENS, self._generated)):  # fmt: skip
                yield CounterMetricFamily(spec.name.removesuffix("_total"), "tokens", value=value)
            for spec, counts in ((names.TTFT, self._ttft), (names.TPOT, self._tpot)):
                yield _histogram(spec, counts)
            for spec in (names.PREFILL_QUEUE, names.DECODE_QUEUE):
                yield GaugeMetricFamily(spec.name, "queue", value=0.0)
            used = round(self._mix.kv_used * KV_BLOCKS)
            for spec, blocks in ((names.KV_BLOCKS_USED, used),
                                 (names.KV_BLOCKS_FREE, KV_BLOCKS - used)):  # fmt: skip
                gauge = GaugeMetricFamily(spec.name, "kv blocks", labels=["role"])
                gauge.add_metric(["decode"], blocks)
                yield gauge


def _observe(counts: list[float], bounds: Sequence[float], value: float, n: float) -> None:
    """``n`` observations of ``value`` into per-bucket counts (the last: above all)."""
    at = next((i for i, le in enumerate(bounds) if value <= le), len(bounds))
    counts[at] += n


def _histogram(spec: names.MetricSpec, counts: Sequence[float]) -> HistogramMetricFamily:
    cumulative, total = [], 0.0
    for le, c in zip([*map(str, spec.buckets), "+Inf"], counts, strict=True):
        total += c
        cumulative.append((le, total))
    return HistogramMetricFamily(spec.name, "latency", buckets=cumulative, sum_value=0.0)


class SyntheticTarget:
    """:class:`SyntheticService` served on ``127.0.0.1`` (a context manager)."""

    def __init__(self, mix: Mix) -> None:
        self.service = SyntheticService(mix)
        self.registry = CollectorRegistry()
        self.registry.register(self.service)
        self._server: MetricsServer | None = None

    def __enter__(self) -> SyntheticTarget:
        self._server = start_metrics_server(0, self.registry, host="127.0.0.1")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def address(self) -> str:
        assert self._server is not None, "not started"
        return f"127.0.0.1:{self._server.port}"
