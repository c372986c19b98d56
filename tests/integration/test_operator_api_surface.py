"""What a platform team reads and asks for, end to end against the API emulator: the
status (URL, conditions with every field, deprecation warnings and their Event) and
the HTTPRoute, made, detached, or reported where the cluster has no Gateway API."""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from crd_validation import problems
from operator_helpers import all_children, condition, converged, service
from splitserve_operator.control.k8s import INFERENCE_SERVICE, KINDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HTTP_ROUTE = KINDS[("gateway.networking.k8s.io/v1", "HTTPRoute")]
ROUTE = {
    "parentRefs": [{"name": "public", "namespace": "gateways"}],
    "hostnames": ["llm.example.com"],
}


def _events(kube, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.objects("v1/events", "default") if e["reason"] == reason]


def test_status_carries_the_url_and_full_conditions(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    body = service(kube_client)
    assert body["status"]["url"] == "http://demo-router.default.svc:8000"
    assert "warnings" not in body["status"]
    # what the operator wrote is what the CRD's status schema accepts (every condition
    # field required, as a real API server would enforce)
    assert problems(body) == []
    for type_ in ("Ready", "Progressing", "Degraded"):
        assert condition(body, type_)["observedGeneration"] == 1


def test_deprecated_fields_are_served_warned_of_once_and_cleared(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator(resync_seconds=0.3)
    kube_client.create(inference_service(slo={"ttftSeconds": 0.5}, kvTransfer={"leaseSeconds": 12}))
    wait_for(lambda: all_children(kube) and converged(kube_client), message="served")
    warnings = service(kube_client)["status"]["warnings"]
    assert warnings == [
        'spec.slo.ttftSeconds is deprecated: write spec.slo.ttft: "500ms" instead',
        'spec.kvTransfer.leaseSeconds is deprecated: write spec.kvTransfer.lease: "12s" instead',
    ]
    (decode,) = [
        d
        for d in kube.objects("apps/v1/deployments", "default")
        if d["metadata"]["name"] == "demo-decode"
    ]
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--lease-seconds") + 1] == "12"  # read as the new form
    wait_for(lambda: _events(kube, "DeprecatedFields"), message="the Warning Event")
    resyncs = len(kube.requests())
    wait_for(lambda: len(kube.requests()) > resyncs + 20, message="a few resyncs")
    (event,) = _events(kube, "DeprecatedFields")  # announced once, not on every resync
    assert event["type"] == "Warning" and "ttftSeconds" in event["message"]
    kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "demo",
        {
            "spec": {
                "slo": {"ttftSeconds": None, "ttft": "500ms"},
                "kvTransfer": {"leaseSeconds": None, "lease": "12s"},
            }
        },
    )
    wait_for(lambda: converged(kube_client) and "warnings" not in service(kube_client)["status"],
             message="warnings cleared")  # fmt: skip


def test_an_http_route_is_made_and_detached_when_dropped(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    made = kube_client.create(inference_service(router={"httpRoute": ROUTE}))
    wait_for(lambda: kube_client.get(HTTP_ROUTE, "default", "demo-router"), message="the route")
    wait_for(lambda: converged(kube_client))
    route = kube_client.get(HTTP_ROUTE, "default", "demo-router")
    assert route is not None
    assert route["metadata"]["ownerReferences"][0]["uid"] == made["metadata"]["uid"]
    assert route["spec"]["parentRefs"] == ROUTE["parentRefs"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "demo-router", "port": 8000}]
    assert condition(service(kube_client), "Degraded")["status"] == "False"
    kube_client.patch(
        INFERENCE_SERVICE, "default", "demo", {"spec": {"router": {"httpRoute": None}}}
    )

    def parents() -> object:
        route = kube_client.get(HTTP_ROUTE, "default", "demo-router") or {}
        return route.get("spec", {}).get("parentRefs")

    wait_for(lambda: parents() == [], message="the route detached")


def test_a_cluster_without_the_gateway_api_is_told_what_to_do(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    kube.add_fault(
        lambda request: (
            kmock.KubernetesError(
                status=404,
                reason="NotFound",
                message="the server could not find the requested resource",
            )
            if "/httproutes" in str(request.url.path)
            else None
        )
    )
    start_operator()
    kube_client.create(inference_service(router={"httpRoute": ROUTE}))

    def degraded() -> dict[str, Any]:
        found = condition(service(kube_client), "Degraded")
        return found if found.get("status") == "True" else {}

    reported = wait_for(degraded, message="Degraded")
    assert reported["reason"] == "ApplyFailed"
    assert "does not serve HTTPRoute (gateway.networking.k8s.io/v1)" in reported["message"]
    assert "install its CRDs" in reported["message"]
    wait_for(lambda: all_children(kube), message="everything else is served")
