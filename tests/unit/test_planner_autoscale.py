"""The autoscaling loop with a fake cluster, a fake metrics source and a fake clock:
what it writes to status, which events it records, what its metrics say."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from splitserve.role_balance import BalanceConfig
from splitserve_operator.api.status import KV_INTEGRITY
from splitserve_operator.control.autoscaling.config import AutoscaleConfig, FlexConfig
from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.autoscaling.metrics import OperatorMetrics
from splitserve_operator.control.autoscaling.status import CONDITION
from splitserve_operator.control.k8s import FIELD_MANAGER, PLANNER, ApiError, Applied
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
        self.pods: dict[str, dict[str, Any]] = {}
        self.label_applies: list[tuple[str, dict[str, str], str]] = []
        self.refuse_pods: ApiError | None = None

    def pod(self, name: str, role: str, ready: bool = True) -> None:
        """A pod of the service's flex Deployment with that role label."""
        self.pods[name] = {
            "metadata": {"name": name, "labels": {"splitserve.io/role": role}},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
        }

    def roles(self) -> dict[str, str]:
        return {n: p["metadata"]["labels"]["splitserve.io/role"] for n, p in self.pods.items()}

    def list(
        self, kind: Any, namespace: str | None = None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        assert kind.kind == "Pod" and namespace == "prod"
        assert label_selector == "app.kubernetes.io/instance=chat,app.kubernetes.io/component=flex"
        return [dict(p) for p in self.pods.values()]

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
        if manifest["kind"] == "Pod":
            # only the role label: the planner owns nothing else of a pod
            meta = manifest["metadata"]
            assert set(meta) == {"name", "namespace", "labels"} and set(manifest) == {
                "apiVersion", "kind", "metadata"}  # fmt: skip
            if self.refuse_pods is not None:
                raise self.refuse_pods
            self.label_applies.append((meta["name"], dict(meta["labels"]), field_manager))
            self.pods[meta["name"]]["metadata"]["labels"].update(meta["labels"])
            return Applied(dict(manifest), created=False)
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


# -- switchable workers (spec.flex) ----------------------------------------------------

FLEX = FlexConfig(balance=BalanceConfig(min_dwell_s=60, sustain_s=0), drain_s=5,
                  prefix_hit_ratio=0.0, cold_start_s=300)  # fmt: skip


def flex_service(status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = service()
    body["spec"]["flex"] = {"replicas": 2}
    if status is not None:
        body["status"] = status
    return body


@pytest.fixture
def flex_rig(rig: Any) -> tuple[Autoscaler, FakeCluster, FakeSource, Clock]:
    _, cluster, source, clock = rig
    cluster.pod("chat-flex-a", "both")
    cluster.pod("chat-flex-b", "both")
    scaler = Autoscaler(
        cluster,
        AutoscaleConfig(window_s=60, fast_window_s=30, flex=FLEX),
        source_factory=lambda url: source,
        metrics=OperatorMetrics(CollectorRegistry()),
        clock=clock,
        wall_clock=lambda: (
            dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=clock.t - 1000.0)
        ),
    )
    return scaler, cluster, source, clock


def test_a_ttft_breach_relabels_a_flex_pod_instead_of_growing_prefill(flex_rig: Any) -> None:
    scaler, cluster, source, clock = flex_rig
    source.obs = Observation(**{**CALM, "ttft_s": 2.0, "tpot_s": 0.02})  # TTFT 2x, TPOT 0.4x
    result = scaler.tick(flex_service())
    assert result is not None and result.flex is not None
    # the first pod by name gives up decode: both -> prefill, its label applied as the planner
    assert cluster.label_applies == [("chat-flex-a", {"splitserve.io/role": "prefill"}, PLANNER)]
    assert cluster.pool_applies == []  # the prefill pool did not grow: the switch serves it
    flex = cluster.status_applies[-1]["flex"]
    assert (flex["prefill"], flex["decode"], flex["both"], flex["switching"]) == (1, 0, 1, 0)
    assert flex["reason"] == "switch"
    assert flex["lastSwitch"] == {"time": "2026-11-29T10:00:00Z", "pod": "chat-flex-a",
                                  "from": "both", "to": "prefill"}  # fmt: skip
    prefill = cluster.status_applies[-1]["autoscaling"]["pools"]["prefill"]
    assert "switches instead" in prefill["message"] and prefill["desiredReplicas"] == 2
    assert [e[:2] for e in cluster.events] == [("Normal", "RoleSwitched")]
    assert "pod chat-flex-a both -> prefill" in cluster.events[0][2]
    # still breached 30 s later: the dwell (60 s) holds the next switch
    clock.t += 30
    scaler.tick(flex_service())
    assert len(cluster.label_applies) == 1
    assert cluster.status_applies[-1]["flex"]["reason"] == "dwell"
    assert cluster.status_applies[-1]["flex"]["prefill"] == 1  # read back from the label
    # past the dwell, a colocated pod gives up decode too (2 fixed decode pods remain)
    clock.t += 30
    scaler.tick(flex_service())
    assert cluster.roles() == {"chat-flex-a": "prefill", "chat-flex-b": "prefill"}
    assert len([e for e in cluster.events if e[1] == "RoleSwitched"]) == 2


def test_a_pod_not_ready_holds_every_switch(flex_rig: Any) -> None:
    scaler, cluster, source, _ = flex_rig
    cluster.pod("chat-flex-b", "both", ready=False)  # starting, or draining into a switch
    source.obs = Observation(**{**CALM, "ttft_s": 2.0, "tpot_s": 0.02})
    scaler.tick(flex_service())
    assert cluster.label_applies == []
    flex = cluster.status_applies[-1]["flex"]
    assert (flex["both"], flex["switching"], flex["reason"]) == (1, 1, "switch_under_way")


def test_a_refused_relabel_switches_nothing_and_is_retried(flex_rig: Any) -> None:
    scaler, cluster, source, clock = flex_rig
    cluster.refuse_pods = ApiError(403, "Forbidden", "pods is forbidden")
    source.obs = Observation(**{**CALM, "ttft_s": 2.0, "tpot_s": 0.02})
    scaler.tick(flex_service())
    assert cluster.roles() == {"chat-flex-a": "both", "chat-flex-b": "both"}
    assert not [e for e in cluster.events if e[1] == "RoleSwitched"]
    assert "lastSwitch" not in cluster.status_applies[-1]["flex"]
    assert cluster.pool_applies == [("chat-prefill", 4, PLANNER)]  # it scales instead
    # the next tick (no dwell started, since nothing switched) switches
    cluster.refuse_pods = None
    clock.t += 30
    scaler.tick(flex_service())
    assert cluster.roles()["chat-flex-a"] == "prefill"


def test_a_new_operator_knows_which_side_the_last_switch_gave_a_worker(flex_rig: Any) -> None:
    """Both pools at their maximum (no pod to add), TTFT 6x its SLO and TPOT 1.5x: the
    policy would take a decode role from a colocated pod. The last switch (100 s ago,
    read back from status.flex) gave decode that worker: taking it back waits three
    dwells, across the restart too."""
    scaler, cluster, source, clock = flex_rig
    source.obs = Observation(**{**CALM, "ttft_s": 6.0, "tpot_s": 0.075})
    full = service(prefill={"minReplicas": 1, "maxReplicas": 2},
                   decode={"minReplicas": 1, "maxReplicas": 2})  # fmt: skip
    full["spec"]["flex"] = {"replicas": 2}
    last = {"time": "2026-11-29T09:58:20Z", "pod": "chat-flex-b", "from": "prefill",
            "to": "both"}  # fmt: skip
    full["status"] = {"flex": {"lastSwitch": last}}
    scaler.tick(full)
    assert cluster.label_applies == []
    flex = cluster.status_applies[-1]["flex"]
    assert flex["reason"] == "dwell" and "take back" in flex["message"], flex
    clock.t += 80  # 180 s after that switch
    scaler.tick(full)
    assert cluster.label_applies == [("chat-flex-a", {"splitserve.io/role": "prefill"}, PLANNER)]


def test_the_dwell_holds_across_an_operator_restart(flex_rig: Any) -> None:
    """A new operator reads the last switch from status.flex: 20 s ago is inside 60 s."""
    scaler, cluster, source, clock = flex_rig
    source.obs = Observation(**{**CALM, "ttft_s": 2.0, "tpot_s": 0.02})
    last = {"time": "2026-11-29T09:59:40Z", "pod": "chat-flex-b", "from": "prefill",
            "to": "both"}  # fmt: skip
    scaler.tick(flex_service({"flex": {"lastSwitch": last}}))
    assert cluster.label_applies == []
    flex = cluster.status_applies[-1]["flex"]
    assert flex["reason"] == "dwell" and flex["lastSwitch"] == last
    clock.t += 40  # 60 s after that switch
    scaler.tick(flex_service({"flex": {"lastSwitch": last}}))
    assert len(cluster.label_applies) == 1
