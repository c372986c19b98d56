"""The operator against the API emulator over HTTP, when things go wrong: invalid specs,
restarts (also mid-reconcile), API errors, foreign objects, other writers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import kmock
import pytest
from operator_helpers import (
    all_children,
    condition,
    converged,
    deployment,
    names,
    replicas,
    service,
)
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_invalid_spec_is_reported_and_other_services_are_served(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    bad = inference_service("broken", decode={"replicas": -2, "gpus": 0})
    bad["spec"]["kvTransfer"] = {"backend": "carrier-pigeon"}
    kube_client.create(bad)
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    wait_for(
        lambda: condition(service(kube_client, "broken"), "Degraded").get("status") == "True",
        message="broken is Degraded",
    )
    degraded = condition(service(kube_client, "broken"), "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.decode.replicas" in degraded["message"]
    assert "spec.kvTransfer.backend" in degraded["message"]
    assert condition(service(kube_client, "broken"), "Ready")["status"] == "False"
    assert deployment(kube_client, "broken-decode") is None
    # the Warning Event is recorded after the status that says Degraded: wait for it
    wait_for(
        lambda: any(e["type"] == "Warning" and e["reason"] == "InvalidSpec"
                    for e in kube.objects("v1/events", "default")),
        message="the InvalidSpec Warning Event",
    )  # fmt: skip
    # Fixing it converges.
    kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "broken",
        {"spec": {"decode": {"replicas": 2}, "kvTransfer": {"backend": "grpc"}}},
    )
    wait_for(lambda: replicas(kube_client, "broken-decode") == 2, message="fixed and applied")
    wait_for(lambda: condition(service(kube_client, "broken"), "Degraded").get("status") == "False")


def test_restart_converges_without_duplicates(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    first = start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    secret = kube.objects("v1/secrets", "default")[0]
    first.stop()
    # While no operator runs: a Deployment is deleted and the spec changes.
    kube_client.delete(DEPLOYMENT, "default", "demo-router")
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"prefill": {"replicas": 2}}})
    served_before = len(kube.requests())
    start_operator()
    wait_for(
        lambda: (
            all_children(kube)
            and converged(kube_client)
            and replicas(kube_client, "demo-prefill") == 2
        ),
        message="converged after restart",
    )
    assert all_children(kube)  # every object exactly once, by name
    # The token Secret is the same object: the operator may try to create it (it has no
    # right to read Secrets), but the API refuses the duplicate.
    assert kube.objects("v1/secrets", "default") == [secret]
    writes = Counter(
        s.path.rsplit("/", 1)[-1]
        for s in kube.requests()[served_before:]
        if s.method == "PATCH" and "/deployments/" in s.path
    )
    # the router made again, prefill resized, decode untouched
    assert writes == {"demo-router": 1, "demo-prefill": 1}, writes


def test_restart_in_the_middle_of_a_reconcile(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    def refuse_router(request: Any) -> kmock.KubernetesError | None:
        if request.url.path.endswith("/deployments/demo-router"):
            return kmock.KubernetesError(
                status=503, reason="ServiceUnavailable", message="injected", details={}
            )
        return None

    kube.add_fault(refuse_router)
    first = start_operator(retry_base_seconds=2)
    kube_client.create(inference_service())
    wait_for(
        lambda: names(kube, "apps/v1/deployments") == ["demo-decode", "demo-prefill"],
        message="a half-done reconcile",
    )
    first.stop()  # dies while kopf waits to retry (kopf keeps that delay in an annotation)
    kube.clear_faults()
    start_operator()
    wait_for(lambda: all_children(kube) and converged(kube_client), timeout=20, message="converged")
    tokens = {s["stringData"]["token"] for s in kube.objects("v1/secrets", "default")}
    assert len(tokens) == 1


def test_transient_api_errors_are_retried(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    failures = {"left": 3}

    def flaky(request: Any) -> kmock.KubernetesError | None:
        if request.url.path.endswith("/configmaps/demo-config") and failures["left"] > 0:
            failures["left"] -= 1
            return kmock.KubernetesError(
                status=500, reason="InternalError", message="flaky", details={}
            )
        return None

    kube.add_fault(flaky)
    start_operator(retry_base_seconds=0.2)
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    assert failures["left"] == 0


def test_an_object_the_api_rejects_is_reported(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    def reject_decode(request: Any) -> kmock.KubernetesError | None:
        data = request.data if isinstance(request.data, dict) else {}
        if data.get("kind") == "Deployment" and data["metadata"].get("name") == "demo-decode":
            return kmock.KubernetesError(
                status=422,
                reason="Invalid",
                details={},
                message=(
                    'Deployment.apps "demo-decode" is invalid: spec.template.spec.affinity: '
                    "Invalid value"
                ),
            )
        return None

    kube.add_fault(reject_decode)
    start_operator()
    kube_client.create(inference_service())
    wait_for(
        lambda: condition(service(kube_client), "Degraded").get("status") == "True",
        message="Degraded",
    )
    degraded = condition(service(kube_client), "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert "Deployment/demo-decode" in degraded["message"] and "affinity" in degraded["message"]
    assert set(names(kube, "apps/v1/deployments")) == {"demo-prefill", "demo-router"}


def test_a_foreign_object_with_our_name_is_left_alone(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "demo-prefill", "namespace": "default"},
        "spec": {"replicas": 9},
    }
    kube_client.create(foreign)
    start_operator()
    kube_client.create(inference_service())
    wait_for(
        lambda: condition(service(kube_client), "Degraded").get("reason") == "NameConflict",
        message="NameConflict",
    )
    assert replicas(kube_client, "demo-prefill") == 9
    assert "delete or rename it" in condition(service(kube_client), "Degraded")["message"]


def test_conditions_of_others_are_kept(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    conditions = service(kube_client)["status"]["conditions"] + [
        {"type": "ScalingActive", "status": "True", "reason": "Planner", "message": "x"}
    ]
    kube_client.patch_status("default", "demo", {"conditions": conditions})
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"decode": {"replicas": 2}}})
    wait_for(lambda: converged(kube_client) and replicas(kube_client, "demo-decode") == 2)
    assert condition(service(kube_client), "ScalingActive")["reason"] == "Planner"
