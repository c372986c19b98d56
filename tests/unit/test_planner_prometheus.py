"""The Prometheus adapter: queries built from the metric names, answers parsed strictly,
absent series as None, errors as MetricsUnavailable (no server needed: httpx's mock
transport answers like Prometheus's HTTP API)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from splitserve.metric_names import exported_series_names
from splitserve_operator.control.prometheus import (
    MetricsUnavailable,
    PrometheusSource,
    Target,
    parse_scalar,
    queries_for,
)

pytestmark = pytest.mark.unit

TARGET = Target("prod", "chat", quantile=0.9, window_s=60, fast_window_s=30)
METRIC = re.compile(r"\b(splitserve_[a-z0-9_]+)\b")


def test_every_query_names_only_exported_series_and_selects_the_service() -> None:
    queries = queries_for(TARGET).all()
    assert set(queries) == {
        "ttft_s", "tpot_s", "request_rate", "prompt_token_rate", "prompt_token_rate_fast",
        "generation_token_rate", "prefill_queue", "decode_queue", "kv_utilization",
        "prefill_served_token_rate", "decode_served_token_rate",
    }  # fmt: skip
    exported = exported_series_names()
    for field, promql in queries.items():
        named = METRIC.findall(promql)
        assert named, field
        assert set(named) <= exported, (field, promql)
        assert 'namespace="prod",inferenceservice="chat"' in promql, promql
    assert "histogram_quantile(0.9," in queries["ttft_s"]
    assert "[60s]" in queries["tpot_s"] and "[30s]" in queries["prompt_token_rate_fast"]


def _vector(value: str) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1.0, value]}]},
    }


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        (_vector("2.5"), 2.5),
        (_vector("NaN"), None),  # histogram_quantile with no requests
        ({"status": "success", "data": {"resultType": "vector", "result": []}}, None),
        ({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "3"]}}, 3.0),
    ],
)
def test_parse_scalar(payload: dict[str, Any], want: float | None) -> None:
    assert parse_scalar(payload) == want


@pytest.mark.parametrize(
    "payload",
    [
        {"status": "error", "errorType": "bad_data", "error": "parse error"},
        {"status": "success", "data": {"resultType": "matrix", "result": []}},
        {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"value": [1, "1"]}, {"value": [1, "2"]}]},
        },
        _vector("not a number"),
    ],
)
def test_bad_answers_are_unavailable(payload: dict[str, Any]) -> None:
    with pytest.raises(MetricsUnavailable):
        parse_scalar(payload)


def _source(handler: Any) -> PrometheusSource:
    return PrometheusSource(
        "http://prom:9090/", client=httpx.Client(transport=httpx.MockTransport(handler))
    )


def test_observe_maps_each_query_to_its_field() -> None:
    answers = {"ttft_s": "0.4", "kv_utilization": "0.5"}
    queries = {q: f for f, q in queries_for(TARGET).all().items()}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        field = queries[request.url.params["query"]]
        if field in answers:
            return httpx.Response(200, json=_vector(answers[field]))
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "vector", "result": []}}
        )

    obs = _source(handler).observe(TARGET)
    assert obs.ttft_s == 0.4 and obs.kv_utilization == 0.5
    assert obs.prompt_token_rate is None  # absent, not zero


def test_unreachable_and_http_errors_are_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(MetricsUnavailable, match="unreachable"):
        _source(refuse).observe(TARGET)

    with pytest.raises(MetricsUnavailable, match="HTTP 503"):
        _source(lambda r: httpx.Response(503, json={})).observe(TARGET)

    with pytest.raises(MetricsUnavailable, match="not JSON"):
        _source(lambda r: httpx.Response(502, text="<html>bad gateway")).observe(TARGET)

    error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
    with pytest.raises(MetricsUnavailable, match="bad_data"):
        _source(lambda r: httpx.Response(400, json=error)).observe(TARGET)
