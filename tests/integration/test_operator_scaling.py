"""Scaling a pool through its WorkerPool's scale subresource, as ``kubectl scale``, a
HorizontalPodAutoscaler or KEDA do, against the emulator's ``/scale``: the Deployment
follows and no resync reverts it; with the planner on, an outside scale is reported in
the ScalingActive condition and left alone."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import all_children, condition, converged, mark_ready, replicas, service
from prom_fixture import free_port
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.k8s import (
    APPLY_PATCH,
    INFERENCE_SERVICE,
    MERGE_PATCH,
    WORKER_POOL,
    KubeClient,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESYNCS = 20
"""Full resyncs a scaled pool must survive."""


def _scale_path(name: str) -> str:
    return WORKER_POOL.path("default", name, "scale")


@pytest.fixture
def kubectl(kube: Any) -> Any:
    """A client that identifies as kubectl (its field manager is "kubectl")."""
    client = KubeClient(kube.configuration(), timeout=10, user_agent="kubectl/v1.35.2 (linux)")
    yield client
    client.close()


def _pool(kube_client: KubeClient, name: str = "demo-decode") -> dict[str, Any]:
    body = kube_client.get(WORKER_POOL, "default", name)
    assert body is not None, name
    return body


def test_a_pool_scaled_through_its_scale_subresource_stays_scaled(
    kube, kube_client, kubectl, start_operator, inference_service, wait_for
) -> None:
    op = start_operator(resync_seconds=0.1)
    kube_client.create(inference_service(decode={"replicas": 1, "gpus": 0}))
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    pool = _pool(kube_client)
    assert pool["spec"] == {"replicas": 1}
    mark_ready(kube_client)  # the Deployment controller reports: the pool reports too
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"

    def scale_with_selector() -> dict[str, Any] | None:
        scale = kubectl.request("GET", _scale_path("demo-decode"))
        return scale if scale.get("status", {}).get("selector") else None

    scale = wait_for(scale_with_selector, message="the pool's selector")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 1}
    assert scale["status"]["selector"] == (
        "app.kubernetes.io/component=decode,app.kubernetes.io/instance=demo"
    )
    kubectl.request(
        "PATCH",
        _scale_path("demo-decode"),
        body={"spec": {"replicas": 3}},
        content_type=MERGE_PATCH,
    )
    wait_for(lambda: replicas(kube_client, "demo-decode") == 3, message="the Deployment at 3")
    passes = op.operator.resync.passes
    wait_for(lambda: op.operator.resync.passes >= passes + RESYNCS, timeout=60,
             message=f"{RESYNCS} resyncs")  # fmt: skip
    assert replicas(kube_client, "demo-decode") == 3
    assert _pool(kube_client)["spec"]["replicas"] == 3
    wait_for(lambda: service(kube_client)["status"]["pools"]["decode"]["desiredReplicas"] == 3,
             message="the target observed in the status")  # fmt: skip
    assert replicas(kube_client, "demo-prefill") == 1  # the other pool is its own
    # An edit of spec.decode.replicas is a new request: it wins over the earlier scale.
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"decode": {"replicas": 2}}})
    wait_for(lambda: replicas(kube_client, "demo-decode") == 2, message="the spec's 2")
    assert _pool(kube_client)["spec"]["replicas"] == 2
    # ...and a scale after it is kept again.
    kubectl.request("PUT", _scale_path("demo-decode"),
                    body={**scale, "metadata": {"name": "demo-decode", "namespace": "default"},
                          "spec": {"replicas": 4}})  # fmt: skip
    wait_for(lambda: replicas(kube_client, "demo-decode") == 4, message="PUT of the scale to 4")
    passes = op.operator.resync.passes
    wait_for(lambda: op.operator.resync.passes >= passes + 5, timeout=60, message="resyncs")
    assert replicas(kube_client, "demo-decode") == 4


def _autoscaled(inference_service: Any, url: str, **decode: Any) -> dict[str, Any]:
    return inference_service(
        decode={"replicas": 2, "gpus": 0},
        slo={"ttft": "1s", "tpot": "100ms"},
        autoscaling={
            "enabled": True,
            "prometheusUrl": url,
            "interval": "5s",
            "decode": {"minReplicas": 1, "maxReplicas": 5, **decode},
        },
    )


def test_planner_decisions_reach_the_deployment_clamped_and_a_spec_edit_does_not_fight(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """(Moved here from test_operator_resilience.py, where the planner's target was a
    status field: now it is the WorkerPool's spec.replicas, written as the planner.)"""
    start_operator()
    kube_client.create(_autoscaled(inference_service, "http://prometheus:9090"))
    wait_for(lambda: all_children(kube) and converged(kube_client))
    assert replicas(kube_client, "demo-decode") == 2

    def plan(n: int) -> None:  # what the planner does, under its own field manager
        manifest = {"apiVersion": "splitserve.io/v1alpha1", "kind": "WorkerPool",
                    "metadata": {"name": "demo-decode", "namespace": "default"},
                    "spec": {"replicas": n}}  # fmt: skip
        query = [("fieldManager", "splitserve-planner"), ("force", "true")]
        path = WORKER_POOL.path("default", "demo-decode")
        kube_client.request("PATCH", path, body=manifest, content_type=APPLY_PATCH, query=query)

    plan(4)
    wait_for(lambda: replicas(kube_client, "demo-decode") == 4, message="planner's 4 applied")
    kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "demo",
        {"spec": {"decode": {"replicas": 1}, "image": "splitserve/worker:0.2.0"}},
    )
    wait_for(lambda: converged(kube_client))
    assert replicas(kube_client, "demo-decode") == 4
    plan(50)
    wait_for(lambda: replicas(kube_client, "demo-decode") == 5, message="clamped to max 5")
    wait_for(lambda: service(kube_client)["status"]["pools"]["decode"]["desiredReplicas"] == 50)


def _scaling(kube_client: KubeClient) -> dict[str, Any]:
    return condition(service(kube_client), "ScalingActive")


def test_with_the_planner_on_an_outside_scale_is_reported_not_fought(
    kube, kube_client, kubectl, start_operator, inference_service, wait_for
) -> None:
    start_operator(autoscale=AutoscaleConfig(resolution_s=0.2, window_s=10, fast_window_s=5))
    url = f"http://127.0.0.1:{free_port()}"  # no Prometheus: the planner holds, and ticks
    kube_client.create(_autoscaled(inference_service, url))
    wait_for(lambda: _scaling(kube_client).get("reason") == "MetricsUnavailable", timeout=30,
             message="a first planner tick")  # fmt: skip
    kubectl.request(
        "PATCH",
        _scale_path("demo-decode"),
        body={"spec": {"replicas": 3}},
        content_type=MERGE_PATCH,
    )
    wait_for(lambda: replicas(kube_client, "demo-decode") == 3, message="the outside 3 applied")
    cond = wait_for(lambda: (c := _scaling(kube_client)).get("reason") == "ScaledOutside" and c,
                    timeout=30, message="ScaledOutside")  # fmt: skip
    assert cond["status"] == "False"
    assert (
        "scaled by kubectl" in cond["message"]
        and "--field-manager=splitserve-planner" in (cond["message"])
    )
    # the Event is posted after the status write: wait for it, then count
    warnings = wait_for(
        lambda: [e for e in kube.objects("v1/events", "default") if e["reason"] == "ScaledOutside"],
        timeout=30,
        message="the ScaledOutside event",
    )
    assert len(warnings) == 1
    assert _pool(kube_client)["spec"]["replicas"] == 3  # not fought
    # Handed back as the message says: the planner plans that pool again.
    kube_client.request(
        "PATCH",
        WORKER_POOL.path("default", "demo-decode"),
        body={"spec": {"replicas": 2}},
        content_type=MERGE_PATCH,
        query=[("fieldManager", "splitserve-planner")],
    )
    wait_for(lambda: _scaling(kube_client).get("reason") == "MetricsUnavailable", timeout=30,
             message="the planner in charge again")  # fmt: skip
    wait_for(lambda: replicas(kube_client, "demo-decode") == 2)
