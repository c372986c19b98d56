"""The autoscaling loop inside the real operator (kopf) against the Kubernetes API
emulator, when the metrics are not there: it holds every replica count, says so in
the ScalingActive condition and one Warning event, and recovers when they come."""

from __future__ import annotations

from typing import Any

import pytest
from prom_fixture import PrometheusServer, free_port, prometheus  # noqa: F401
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST = AutoscaleConfig(resolution_s=0.5, window_s=10, fast_window_s=5)


def _service(kube_client: Any) -> dict[str, Any]:
    body = kube_client.get(INFERENCE_SERVICE, "default", "demo")
    assert body is not None
    return body


def _condition(body: dict[str, Any]) -> dict[str, Any]:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == "ScalingActive":
            return dict(c)
    return {}


def _autoscaled(inference_service: Any, url: str) -> dict[str, Any]:
    return inference_service(
        decode={"replicas": 2, "gpus": 0},
        slo={"ttft": "1s", "tpot": "50ms"},
        autoscaling={
            "enabled": True,
            "prometheusUrl": url,
            "interval": "5s",
            "decode": {"minReplicas": 1, "maxReplicas": 4},
        },
    )


def _warnings(kube: Any, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.objects("v1/events", "default")
        if e.get("reason") == reason and e["involvedObject"]["name"] == "demo"
    ]


def test_prometheus_unreachable_holds_and_says_so(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator(autoscale=FAST)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    kube_client.create(_autoscaled(inference_service, url))
    cond = wait_for(
        lambda: (
            _condition(_service(kube_client)).get("status") == "False"
            and _condition(_service(kube_client))
        ),
        timeout=30,
        message="ScalingActive=False",
    )
    assert cond["reason"] == "MetricsUnavailable"
    assert "unreachable" in cond["message"] and "not scaling on missing data" in cond["message"]
    status = _service(kube_client)["status"]
    assert status["autoscaling"]["metricsAvailable"] is False
    assert status["autoscaling"]["pools"]["decode"]["reason"] == "MetricsUnavailable"
    # several ticks later: nothing moved, one warning only
    wait_for(lambda: len(_warnings(kube, "MetricsUnavailable")) >= 1)
    first = _service(kube_client)["status"]["autoscaling"]["lastTickTime"]
    wait_for(
        lambda: _service(kube_client)["status"]["autoscaling"]["lastTickTime"] != first,
        timeout=20,
        message="another tick",
    )
    assert len(_warnings(kube, "MetricsUnavailable")) == 1
    assert _service(kube_client)["status"]["pools"]["decode"]["desiredReplicas"] == 2
    deployment = kube_client.get(DEPLOYMENT, "default", "demo-decode")
    assert deployment is not None and deployment["spec"]["replicas"] == 2
    # the operator's own conditions are still there next to ours
    types = {c["type"] for c in _service(kube_client)["status"]["conditions"]}
    assert {"Ready", "Progressing", "Degraded", "ScalingActive", "KVIntegrity"} <= types
    # and without Prometheus nobody can say whether moved KV decodes right
    (integrity,) = [
        c for c in _service(kube_client)["status"]["conditions"] if c["type"] == "KVIntegrity"
    ]
    assert (integrity["status"], integrity["reason"]) == ("Unknown", "MetricsUnavailable")
    assert "unreachable" in integrity["message"]


def test_prometheus_without_data_holds_until_series_exist(
    kube,
    kube_client,
    start_operator,
    inference_service,
    wait_for,
    prometheus: PrometheusServer,  # noqa: F811
) -> None:
    start_operator(autoscale=FAST)
    kube_client.create(_autoscaled(inference_service, prometheus.url))
    cond = wait_for(
        lambda: (
            _condition(_service(kube_client)).get("reason") == "MetricsUnavailable"
            and _condition(_service(kube_client))
        ),
        timeout=30,
        message="holding for missing series",
    )
    assert "missing prompt token rate" in cond["message"]
    assert _service(kube_client)["status"]["pools"]["decode"]["desiredReplicas"] == 2
