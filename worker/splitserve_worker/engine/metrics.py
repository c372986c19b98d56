"""The engine's Prometheus series (names from :mod:`splitserve.metric_names`)."""

from __future__ import annotations

from splitserve import metric_names as names
from splitserve.metric_registry import Metrics


class EngineMetrics:
    GAUGES = (names.RUNNING, names.WAITING, names.KV_BLOCKS_USED, names.KV_BLOCKS_FREE)

    def __init__(self, metrics: Metrics, role: str) -> None:
        self._metrics = metrics
        self.role = role
        self._running = metrics.gauge(names.RUNNING).labels(role=role)
        self._waiting = metrics.gauge(names.WAITING).labels(role=role)
        self._used = metrics.gauge(names.KV_BLOCKS_USED).labels(role=role)
        self._free = metrics.gauge(names.KV_BLOCKS_FREE).labels(role=role)
        self._queries = metrics.counter(names.PREFIX_QUERIES).labels(role=role)
        self._hits = metrics.counter(names.PREFIX_HITS).labels(role=role)
        self._prefill = metrics.counter(names.WORKER_PREFILL_TOKENS).labels(role=role)
        self._decode = metrics.counter(names.WORKER_DECODE_TOKENS).labels(role=role)

    def for_role(self, role: str) -> EngineMetrics:
        """The same series labelled with another role."""
        return EngineMetrics(self._metrics, role)

    def retire(self) -> None:
        """Stop exporting this role's gauges (the worker serves another role now); its
        counters stay, as counters do."""
        for spec in self.GAUGES:
            self._metrics.gauge(spec).remove(self.role)

    def gauges(self, *, running: int, waiting: int, used: int, free: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        self._used.set(used)
        self._free.set(free)

    def prefix(self, queried: int, hit: int) -> None:
        if queried:
            self._queries.inc(queried)
        if hit:
            self._hits.inc(hit)

    def prefilled(self, tokens: int) -> None:
        if tokens:
            self._prefill.inc(tokens)

    def decoded(self, tokens: int) -> None:
        if tokens:
            self._decode.inc(tokens)
