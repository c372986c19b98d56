"""The metric names module: one source, Prometheus conventions, and what it exports."""

from __future__ import annotations

import itertools
import re
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.metric_server import start_metrics_server

pytestmark = pytest.mark.unit

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
UNITS = (
    "_seconds",
    "_bytes",
    "_ratio",
    "_total",
    "_depth",
    "_sequences",
    "_used",
    "_free",
    "_replicas_desired",
    "_replicas_ready",
    "_available",
    "_per_replica",
)


def test_names_follow_the_conventions() -> None:
    seen: set[str] = set()
    for spec in names.ALL:
        assert spec.name.startswith(names.PREFIX), spec.name
        assert NAME.match(spec.name), spec.name
        assert spec.name not in seen, f"{spec.name} defined twice"
        seen.add(spec.name)
        assert spec.help.strip(), spec.name
        if spec.kind is names.Kind.COUNTER:
            assert spec.name.endswith("_total"), spec.name
        else:
            assert not spec.name.endswith("_total"), spec.name
        if spec.kind is names.Kind.HISTOGRAM:
            assert spec.name.endswith("_seconds"), spec.name  # every histogram is a duration
        for label in spec.labels:
            assert NAME.match(label) and label != "le", (spec.name, label)


def test_latency_buckets_cover_10ms_to_60s() -> None:
    b = names.LATENCY_BUCKETS
    assert list(b) == sorted(b)
    assert b[0] <= 0.01 and b[-1] >= 60.0


def test_every_histogram_has_sorted_distinct_buckets() -> None:
    for spec in names.ALL:
        if spec.kind is names.Kind.HISTOGRAM:
            b = spec.buckets
            assert list(b) == sorted(set(b)) and b[0] > 0, spec.name


def test_tpot_buckets_resolve_decode_slos_to_a_few_ms() -> None:
    b = names.TPOT.buckets
    assert b[0] <= 0.001 and b[-1] >= 2.0
    # from 1 ms to 20 ms (where decode SLOs sit) no two bounds are more than 2.5 ms apart
    low = [x for x in b if x <= 0.02]
    assert low[-1] == 0.02 and max(y - x for x, y in itertools.pairwise(low)) <= 0.0025 + 1e-12


def test_a_histogram_is_exported_with_its_own_buckets() -> None:
    m = Metrics(CollectorRegistry())
    m.histogram(names.TPOT).observe(0.0042)
    m.histogram(names.TTFT).observe(0.42)
    text = generate_latest(m.registry).decode()
    assert f'{names.TPOT.name}_bucket{{le="0.004"}} 0.0' in text
    assert f'{names.TPOT.name}_bucket{{le="0.005"}} 1.0' in text
    assert f'{names.TTFT.name}_bucket{{le="0.005"}} 0.0' in text
    assert f'{names.TTFT.name}_bucket{{le="0.004"}}' not in text


def test_the_planner_and_operator_series_are_defined() -> None:
    defined = {spec.name for spec in names.ALL}
    for needed in (
        "splitserve_time_to_first_token_seconds",
        "splitserve_time_per_output_token_seconds",
        "splitserve_prompt_tokens_total",
        "splitserve_generation_tokens_total",
        "splitserve_prefill_queue_depth",
        "splitserve_decode_queue_depth",
        "splitserve_kv_blocks_used",
        "splitserve_kv_blocks_free",
        "splitserve_planner_decisions_total",
        "splitserve_pool_replicas_desired",
        "splitserve_pool_replicas_ready",
        "splitserve_gpu_utilization_ratio",
    ):
        assert needed in defined


def test_exported_series_names_match_what_prometheus_client_writes() -> None:
    metrics = Metrics(CollectorRegistry())
    for spec in names.ALL:
        m = metrics.get(spec)
        labelled = m.labels(*["x"] * len(spec.labels)) if spec.labels else m
        if spec.kind is names.Kind.HISTOGRAM:
            labelled.observe(0.1)  # type: ignore[attr-defined]
        elif spec.kind is names.Kind.COUNTER:
            labelled.inc()  # type: ignore[attr-defined]
        else:
            labelled.set(1)  # type: ignore[attr-defined]
    text = generate_latest(metrics.registry).decode()
    written = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    assert written <= names.exported_series_names()
    assert {spec.name for spec in names.ALL if spec.kind is names.Kind.GAUGE} <= written


def test_metrics_objects_are_made_once_per_registry() -> None:
    metrics = Metrics(CollectorRegistry())
    assert metrics.counter(names.REQUESTS) is metrics.counter(names.REQUESTS)
    with pytest.raises(AssertionError):
        metrics.gauge(names.REQUESTS)


def test_metrics_server_serves_a_registry() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.counter(names.PROMPT_TOKENS).inc(42)
    server = start_metrics_server(0, metrics.registry, host="127.0.0.1")
    try:
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as response:
            body = response.read().decode()
        assert "splitserve_prompt_tokens_total 42.0" in body
    finally:
        server.close()
