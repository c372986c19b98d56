"""The autoscaling loop with a fake cluster, a fake metrics source and a fake clock:
what it writes to status, which events it records, what its metrics say."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from splitserve_operator.api.status import compute_status
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.autoscaling.metrics import OperatorMetrics
from splitserve_operator.control.autoscaling.status import CONDITION
from splitserve_operator.control.prometheus import MetricsUnavailable, Target
from splitserve_operator.planner.model import Observation

pytestmark = pytest.mark.unit

CALM = dict(
    ttft_s=0.2, tpot_s=0.04, request_rate=20.0, prompt_token_rate=10240.0,
    generation_token_rate=2560.0, prefill_queue=0.0, decode_queue=0.0, kv_utilization=0.5,
)  # fmt: skip


class FakeCluster:
    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    def deployment(self, name: str, replicas: int, ready: int) -> None:
        self.deployments[name] = {
            "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready},
        }

    def get(self, kind: Any, namespace: str, name: str) -> dict[str, Any] | None:
        return self.deployments.get(name)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        raise AssertionError("the autoscaling loop creates nothing")

    def patch(
        self,
        kind: Any,
        namespace: str,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        content_type: str = "",
    ) -> dict[str, Any]:
        assert subresource == "status"
        self.status_patches.append(patch["status"])
        return {}

    def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


class FakeSource:
    def __init__(self) -> None:
        self.obs: Observation | Exception = Observation(**CALM)  # type: ignore[arg-type]
        self.targets: list[Target] = []

    def observe(self, target: Target) -> Observation:
        self.targets.append(target)
        if isinstance(self.obs, Exception):
            raise self.obs
        return self.obs


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def service(**autoscaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "prod", "uid": "u1", "generation": 3},
        "spec": {
            "model": {"name": "m"},
            "image": "img",
            "slo": {"ttft": "1s", "tpot": "50ms", "percentile": 90},
            "autoscaling": {
                "enabled": True,
                "prometheusUrl": "http://prom:9090",
                "interval": "30s",
                "decode": {"minReplicas": 1, "maxReplicas": 6},
                **autoscaling,
            },
        },
        "status": {
            "pools": {"decode": {"desiredReplicas": 2}, "prefill": {}},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@pytest.fixture
def rig() -> tuple[Autoscaler, FakeCluster, FakeSource, Clock]:
    cluster, source, clock = FakeCluster(), FakeSource(), Clock()
    cluster.deployment("chat-prefill", 2, 2)
    cluster.deployment("chat-decode", 2, 2)
    scaler = Autoscaler(
        cluster,
        AutoscaleConfig(window_s=60, fast_window_s=30),
        source_factory=lambda url: source,
        metrics=OperatorMetrics(CollectorRegistry()),
        clock=clock,
        wall_clock=lambda: dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.UTC),
    )
    return scaler, cluster, source, clock


def _sample(scaler: Autoscaler, name: str, **labels: str) -> float | None:
    return scaler.metrics.registry.get_sample_value(name, labels)


def test_a_tpot_breach_scales_decode_and_says_why(rig: Any) -> None:
    scaler, cluster, source, _ = rig
    source.obs = Observation(**{**CALM, "tpot_s": 0.075})  # 1.5x the SLO
    result = scaler.tick(service())
    assert result is not None and result.patched
    patch = cluster.status_patches[-1]
    # ceil(2 x min(1.5, 2)) = 3, written where the reconciler reads the planner's target
    assert patch["pools"] == {"decode": {"desiredReplicas": 3}}
    decode = patch["autoscaling"]["pools"]["decode"]
    assert decode["reason"] == "SLOBreach" and decode["desiredReplicas"] == 3
    assert decode["sloRatio"] == 1.5 and decode["lastScaleTime"] == "2026-11-29T10:00:00Z"
    assert patch["autoscaling"]["metricsAvailable"] is True
    (cond,) = [c for c in patch["conditions"] if c["type"] == CONDITION]
    assert (cond["status"], cond["reason"]) == ("True", "MetricsAvailable")
    assert {"type": "Ready", "status": "True"} in patch["conditions"]  # others sent back as-is
    assert cluster.events == [("Normal", "ScaledUp", cluster.events[0][2])]
    assert "decode 2 -> 3: SLOBreach" in cluster.events[0][2]
    labels = {"namespace": "prod", "service": "chat", "pool": "decode"}
    assert _sample(scaler, "splitserve_pool_replicas_desired", **labels) == 3
    assert _sample(scaler, "splitserve_pool_replicas_ready", **labels) == 2
    assert _sample(scaler, "splitserve_planner_decisions_total", direction="up", **labels) == 1
    assert (
        _sample(scaler, "splitserve_planner_metrics_available", namespace="prod", service="chat")
        == 1
    )
    assert (
        _sample(
            scaler,
            "splitserve_slo_target_seconds",
            namespace="prod",
            service="chat",
            objective="tpot",
        )
        == 0.05
    )
    (target,) = source.targets
    assert (target.namespace, target.name, target.quantile) == ("prod", "chat", 0.9)


def test_ticks_follow_the_interval(rig: Any) -> None:
    scaler, _, source, clock = rig
    assert scaler.tick(service()) is not None
    clock.t += 10
    assert scaler.tick(service()) is None  # 10 s < interval 30s
    assert scaler.tick(service(), force=True) is not None
    clock.t += 30
    assert scaler.tick(service()) is not None
    assert len(source.targets) == 3


def test_unreachable_prometheus_holds_and_says_so_once(rig: Any) -> None:
    scaler, cluster, source, clock = rig
    source.obs = MetricsUnavailable("Prometheus at http://prom:9090 unreachable: refused")
    result = scaler.tick(service())
    assert result is not None and result.hold_reason is not None
    patch = cluster.status_patches[-1]
    assert "pools" not in patch  # 2 and 2 stay as they are
    (cond,) = [c for c in patch["conditions"] if c["type"] == CONDITION]
    assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
    assert "unreachable" in cond["message"]
    assert patch["autoscaling"]["pools"]["decode"]["reason"] == "MetricsUnavailable"
    assert [e[:2] for e in cluster.events] == [("Warning", "MetricsUnavailable")]
    assert (
        _sample(scaler, "splitserve_planner_metrics_available", namespace="prod", service="chat")
        == 0
    )
    # still down on the next tick: no second warning, and the condition is not re-sent
    body = service()
    body["status"]["conditions"] = patch["conditions"]
    clock.t += 30
    scaler.tick(body)
    assert len(cluster.events) == 1
    assert "conditions" not in cluster.status_patches[-1]
    # back: a Normal event and the condition flips
    source.obs = Observation(**CALM)  # type: ignore[arg-type]
    clock.t += 30
    scaler.tick(body)
    assert cluster.events[-1][:2] == ("Normal", "MetricsAvailable")


def test_missing_series_hold_with_the_reason(rig: Any) -> None:
    scaler, cluster, source, _ = rig
    source.obs = Observation()  # Prometheus answers, but nothing is scraped
    result = scaler.tick(service())
    assert result is not None and not result.plan.metrics_ok
    assert "prompt token rate" in (result.hold_reason or "")
    assert "pools" not in cluster.status_patches[-1]


def test_nothing_before_the_deployments_exist_or_when_disabled(rig: Any) -> None:
    scaler, cluster, _, _ = rig
    assert scaler.tick(service(enabled=False)) is None
    del cluster.deployments["chat-decode"]
    assert scaler.tick(service()) is None
    assert cluster.status_patches == []


def test_the_operators_status_keeps_the_planners_condition() -> None:
    ours = {
        "type": CONDITION,
        "status": "False",
        "reason": "MetricsUnavailable",
        "message": "x",
        "lastTransitionTime": "2026-11-29T10:00:00Z",
    }
    status = compute_status(
        generation=1,
        pools={},
        desired={},
        problems=[],
        previous={"conditions": [ours]},
        now=dt.datetime(2026, 11, 29, tzinfo=dt.UTC),
    )
    assert ours in status["conditions"]
