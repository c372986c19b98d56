"""Deleting an InferenceService never waits for the operator: it carries no finalizer
(the autoscaling loop is one operator-wide task, not a kopf timer per object), so it goes
with the operator stopped, its children with it; a finalizer an older version left is
removed."""

from __future__ import annotations

import pytest
from operator_helpers import CHILDREN, all_children, condition, converged, names, service
from prom_fixture import free_port
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.k8s import INFERENCE_SERVICE, WORKER_POOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
FAST = AutoscaleConfig(resolution_s=0.2, window_s=10, fast_window_s=5)


def _autoscaled(inference_service, **metadata):
    body = inference_service(
        slo={"ttft": "1s", "tpot": "100ms"},
        autoscaling={
            "enabled": True,
            "prometheusUrl": f"http://127.0.0.1:{free_port()}",
            "interval": "5s",
        },
    )
    body["metadata"].update(metadata)
    return body


def _gone(kube) -> bool:
    pools = kube.objects("splitserve.io/v1alpha1/workerpools", "default")
    return not pools and not any(names(kube, r) for r in CHILDREN)


def test_an_autoscaled_service_deleted_while_the_operator_is_stopped_goes_away(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    op = start_operator(autoscale=FAST)
    kube_client.create(_autoscaled(inference_service))
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    wait_for(lambda: condition(service(kube_client), "ScalingActive"), timeout=30,
             message="the planner ticked")  # fmt: skip
    assert kube_client.get(WORKER_POOL, "default", "demo-decode") is not None
    assert not service(kube_client)["metadata"].get("finalizers")
    op.stop()
    kube_client.delete(INFERENCE_SERVICE, "default", "demo")
    assert kube_client.get(INFERENCE_SERVICE, "default", "demo") is None
    wait_for(lambda: _gone(kube), message="children collected")


def test_a_finalizer_an_older_version_left_is_removed(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    kube_client.create(_autoscaled(inference_service, finalizers=[KOPF_FINALIZER]))
    op = start_operator(autoscale=FAST)
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    wait_for(lambda: not service(kube_client)["metadata"].get("finalizers"),
             message="kopf's finalizer removed")  # fmt: skip
    op.stop()
    kube_client.delete(INFERENCE_SERVICE, "default", "demo")
    assert kube_client.get(INFERENCE_SERVICE, "default", "demo") is None
    wait_for(lambda: _gone(kube), message="children collected")
