"""The autoscaling loop with a fake cluster, a fake metrics source and a fake clock:
what it writes to status, which events it records, what its metrics say."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from splitserve_operator.api.status import KV_INTEGRITY
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.autoscaling.metrics import OperatorMetrics
from splitserve_operator.control.autoscaling.status import CONDITION
from splitserve_operator.control.k8s import FIELD_MANAGER, PLANNER, Applied
from splitserve_operator.control.prometheus import MetricsUnavailable, Target
from splitserve_operator.planner.model import Observation

pytestmark = pytest.mark.unit

CALM = dict(
    ttft_s=0.2, tpot_s=0.04, request_rate=20.0, prompt_token_rate=10240.0,
    generation_token_rate=2560.0, prefill_queue=0.0, decode_queue=0.0, kv_utilization=0.5,
)  # fmt: skip


class FakeCluster:
    """Deployments and WorkerPools by name; records what the loop applies."""

    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pools: dict[str, dict[str, Any]] = {}
        self.pool_applies: list[tuple[str, int, str]] = []
        self.status_applies: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    def deployment(self, name: str, replicas: int, ready: int, scaler: str = FIELD_MANAGER) -> None:
        self.deployments[name] = {
            "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready},
        }
        self.scale(name, replicas, scaler)

    def scale(self, name: str, replicas: int, scaler: str) -> None:
        """The pool at ``replicas``, its spec.replicas last written by ``scaler``."""
        self.pools[name] = {
            "metadata": {
                "name": name,
                "managedFields": [
                    {
                        "manager": scaler,
                        "operation": "Update",
                        "fieldsV1": {"f:spec": {"f:replicas": {}}},
                    }
                ],
            },
            "spec": {"replicas": replicas},
        }

    def get(self, kind: Any, namespace: str, name: str) -> dict[str, Any] | None:
        return (self.pools if kind.kind == "WorkerPool" else self.deployments).get(name)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        raise AssertionError("the autoscaling loop creates nothing")

    def patch(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("the autoscaling loop writes with server-side apply only")

    def apply(
        self,
        manifest: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = True,
        subresource: str | None = None,
    ) -> Applied:
        assert field_manager == PLANNER
        if subresource == "status":
            assert manifest["kind"] == "InferenceService"
            self.status_applies.append(dict(manifest["status"]))
        else:
            assert manifest["kind"] == "WorkerPool" and subresource is None
            name, replicas = manifest["metadata"]["name"], manifest["spec"]["replicas"]
            self.pool_applies.append((name, replicas, field_manager))
            self.scale(name, replicas, field_manager)
        return Applied(dict(manifest), created=False)

    def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


class FakeSource:
    def __init__(self) -> None:
        self.obs: Observation | Exception = Observation(**CALM)  # type: ignore[arg-type]
        self.targets: list[Target] = []
        self.mismatches: float | Exception | None = 0.0
        self.windows: list[float] = []

    def kv_mismatches(self, target: Target, window_s: float) -> float | None:
        self.windows.append(window_s)
        if isinstance(self.mismatches, Exception):
            raise self.mismatches
        return self.mismatches

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
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
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
    # ceil(2 x min(1.5, 2)) = 3, applied to the pool's WorkerPool as the planner
    assert cluster.pool_applies == [("chat-decode", 3, PLANNER)]
    patch = cluster.status_applies[-1]
    decode = patch["autoscaling"]["pools"]["decode"]
    assert decode["reason"] == "SLOBreach" and decode["desiredReplicas"] == 3
    assert decode["sloRatio"] == 1.5 and decode["lastScaleTime"] == "2026-11-29T10:00:00Z"
    assert patch["autoscaling"]["metricsAvailable"] is True
    # its own conditions only: the server merges them with the reconciler's by type
    assert {c["type"] for c in patch["conditions"]} == {CONDITION, KV_INTEGRITY}
    (cond,) = [c for c in patch["conditions"] if c["type"] == CONDITION]
    assert (cond["type"], cond["status"], cond["reason"]) == (CONDITION, "True", "MetricsAvailable")
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
    patch = cluster.status_applies[-1]
    assert cluster.pool_applies == []  # 2 and 2 stay as they are
    (cond,) = [c for c in patch["conditions"] if c["type"] == CONDITION]
    assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
    assert "unreachable" in cond["message"]
    assert patch["autoscaling"]["pools"]["decode"]["reason"] == "MetricsUnavailable"
    assert [e[:2] for e in cluster.events] == [("Warning", "MetricsUnavailable")]
    assert (
        _sample(scaler, "splitserve_planner_metrics_available", namespace="prod", service="chat")
        == 0
    )
    # still down on the next tick: no second warning, and the condition has not flipped
    body = service()
    body["status"]["conditions"] = patch["conditions"]
    clock.t += 30
    scaler.tick(body)
    assert len(cluster.events) == 1
    assert (
        cluster.status_applies[-1]["conditions"][0]["lastTransitionTime"]
        == (cond["lastTransitionTime"])
    )
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
    assert cluster.pool_applies == []


def test_nothing_before_the_deployments_exist_or_when_disabled(rig: Any) -> None:
    scaler, cluster, _, _ = rig
    assert scaler.tick(service(enabled=False)) is None
    del cluster.deployments["chat-decode"]
    assert scaler.tick(service()) is None
    assert cluster.status_applies == [] and cluster.pool_applies == []


def test_a_pool_someone_else_scales_is_reported_not_fought(rig: Any) -> None:
    scaler, cluster, source, clock = rig
    cluster.deployment("chat-decode", 4, 4, scaler="kubectl")  # and its 4 pods ready
    source.obs = Observation(**{**CALM, "tpot_s": 0.075})  # a breach: it would scale up
    result = scaler.tick(service())
    assert result is not None
    assert cluster.pool_applies == []  # kubectl's 4 stays
    (cond,) = [c for c in cluster.status_applies[-1]["conditions"] if c["type"] == CONDITION]
    assert (cond["status"], cond["reason"]) == ("False", "ScaledOutside")
    assert "scaled by kubectl" in cond["message"] and "chat-decode" in cond["message"]
    assert cluster.status_applies[-1]["autoscaling"]["pools"]["decode"]["reason"] == (
        "ScaledOutside"
    )
    assert [e[:2] for e in cluster.events] == [("Warning", "ScaledOutside")]
    clock.t += 30
    scaler.tick(service())
    assert [e[1] for e in cluster.events] == ["ScaledOutside"]  # said once
    # handed back under the planner's field manager: planned again
    cluster.scale("chat-decode", 4, PLANNER)
    clock.t += 30
    scaler.tick(service())
    assert cluster.pool_applies and cluster.pool_applies[-1][0] == "chat-decode"


def _integrity(cluster: FakeCluster) -> dict[str, Any]:
    (cond,) = [c for c in cluster.status_applies[-1]["conditions"] if c["type"] == KV_INTEGRITY]
    return dict(cond)


def test_kv_integrity_follows_the_guards_mismatches(rig: Any) -> None:
    scaler, cluster, source, clock = rig
    scaler.tick(service())
    first = _integrity(cluster)
    assert (first["status"], first["reason"]) == ("True", "NoMismatch")
    assert "600s" in first["message"] and source.windows == [600.0]
    assert first["observedGeneration"] == 3
    source.mismatches = 2.0
    clock.t += 30
    scaler.tick(service())
    bad = _integrity(cluster)
    assert (bad["status"], bad["reason"]) == ("False", "GuardMismatch")
    assert "saw 2 disaggregated request(s) in the last 600s" in bad["message"]
    assert "correctness guard: request" in bad["message"]  # where to look
    # the mismatches age out of the window: True again
    source.mismatches = 0.0
    clock.t += 30
    scaler.tick(service())
    assert _integrity(cluster)["status"] == "True"


def test_kv_integrity_is_unknown_without_prometheus_or_the_guards_series(rig: Any) -> None:
    scaler, cluster, source, clock = rig
    source.mismatches = None  # the router's guard series are not scraped
    scaler.tick(service())
    cond = _integrity(cluster)
    assert (cond["status"], cond["reason"]) == ("Unknown", "MetricsUnavailable")
    assert "no correctness guard series" in cond["message"]
    source.mismatches = MetricsUnavailable("Prometheus at http://prom:9090 unreachable: refused")
    source.obs = MetricsUnavailable("Prometheus at http://prom:9090 unreachable: refused")
    clock.t += 30
    scaler.tick(service())
    cond = _integrity(cluster)
    assert cond["status"] == "Unknown" and "unreachable" in cond["message"]


def test_kv_integrity_keeps_its_transition_time_while_it_holds() -> None:
    from splitserve_operator.api.status import kv_integrity_condition

    t0 = dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.UTC)
    first = kv_integrity_condition(1.0, "10m", None, generation=1, now=t0)
    later = kv_integrity_condition(
        3.0, "10m", None, generation=1, now=t0 + dt.timedelta(minutes=1), previous=[first]
    )
    assert later["lastTransitionTime"] == first["lastTransitionTime"] == "2026-11-29T10:00:00Z"
    flipped = kv_integrity_condition(
        0.0, "10m", None, generation=1, now=t0 + dt.timedelta(minutes=2), previous=[later]
    )
    assert flipped["status"] == "True" and flipped["lastTransitionTime"] == "2026-11-29T10:02:00Z"
