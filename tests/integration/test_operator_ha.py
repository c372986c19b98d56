"""Two operators, one Lease: only the leader acts; killed in the middle of a reconcile,
its standby takes the lease once it expires and finishes the job on the same objects.
And the Deployment watch asks the API server for the operator's own Deployments only."""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from operator_helpers import CHILDREN, all_children, converged, names
from splitserve_operator.control.config import DEPLOYMENT_SELECTOR, LeaseConfig
from splitserve_operator.control.k8s import DEPLOYMENT, LEASE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/splitserve-system/leases/splitserve"


def _lease(identity: str, duration_s: float = 1.5) -> LeaseConfig:
    return LeaseConfig(
        namespace="splitserve-system",
        name="splitserve",
        identity=identity,
        duration_s=duration_s,
        renew_deadline_s=duration_s * 2 / 3,
        retry_period_s=0.1,
    )


def _by(kube: Any, identity: str) -> list[Any]:
    return [s for s in kube.requests() if s.agent.endswith(f"({identity})")]


def test_the_standby_finishes_what_a_leader_killed_mid_reconcile_began(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    a = start_operator(leader_election=_lease("a"))
    assert a.leading
    b = start_operator(leader_election=_lease("b"), wait_for_lead=False)
    wait_for(lambda: [s for s in _by(kube, "b") if s.path == LEASE_PATH], message="b waits")

    def hold_a(request: Any) -> kmock.KubernetesError | None:
        """The leader's writes of the router's Deployment fail: its reconcile stops half-way."""
        agent = str(request.headers.get("User-Agent", ""))
        if agent.endswith("(a)") and request.url.path.endswith("/deployments/demo-router"):
            return kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                         message="held", details={})  # fmt: skip
        return None

    kube.add_fault(hold_a)
    made = kube_client.create(inference_service())
    wait_for(lambda: names(kube, "apps/v1/deployments") == ["demo-decode", "demo-prefill"],
             message="a half-done reconcile")  # fmt: skip
    first = {
        d["metadata"]["name"]: d["metadata"]["uid"] for d in kube.objects("apps/v1/deployments")
    }
    (token,) = kube.objects("v1/secrets", "default")
    assert not b.leading
    killed_at = len(kube.requests())
    a.kill()  # as a crash: the lease is not handed back
    kube.clear_faults()

    wait_for(lambda: b.leading, timeout=20, message="b takes the lease")
    wait_for(lambda: all_children(kube) and converged(kube_client), timeout=30, message="done")
    # The same objects, each once: what a made is kept, b made only what was missing.
    assert all_children(kube)
    after = {
        d["metadata"]["name"]: d["metadata"]["uid"] for d in kube.objects("apps/v1/deployments")
    }
    assert {n: after[n] for n in first} == first
    assert kube.objects("v1/secrets", "default") == [token]
    for resource in CHILDREN:
        for obj in kube.objects(resource, "default"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == made["metadata"]["uid"]
    # Before it led, b only read the lease.
    took = next(i for i, s in enumerate(kube.requests()) if s.agent.endswith("(b)")
                and s.method == "PATCH" and s.path == LEASE_PATH)  # fmt: skip
    assert took > killed_at
    early = {(s.method, s.path) for s in kube.requests()[:took] if s.agent.endswith("(b)")}
    assert early == {("GET", LEASE_PATH)}
    lease = kube_client.get(LEASE, "splitserve-system", "splitserve")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1


def test_a_clean_stop_hands_the_lease_over_at_once(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """A lease of 60 s: b leads within seconds only because a released it."""
    a = start_operator(leader_election=_lease("a", duration_s=60))
    b = start_operator(leader_election=_lease("b", duration_s=60), wait_for_lead=False)
    wait_for(lambda: [s for s in _by(kube, "b") if s.path == LEASE_PATH], message="b waits")
    a.stop()
    wait_for(lambda: b.leading, timeout=10, message="b leads")
    lease = kube_client.get(LEASE, "splitserve-system", "splitserve")
    assert lease is not None and lease["spec"]["holderIdentity"] == "b"
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client), message="b reconciles")


def test_the_deployment_watch_carries_a_label_selector(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    for i in range(3):  # others' Deployments: the API server must not send them
        kube_client.create({"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": f"other-{i}", "namespace": "elsewhere"},
                            "spec": {"replicas": 1}})  # fmt: skip
    op = start_operator()
    seen: list[str] = []
    triage = op.controller.triage_deployment

    def spy(event_type: Any, deployment: Any) -> Any:
        seen.append(deployment["metadata"]["name"])
        return triage(event_type, deployment)

    op.controller.triage_deployment = spy  # type: ignore[method-assign]
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    kube_client.patch(DEPLOYMENT, "elsewhere", "other-0", {"spec": {"replicas": 2}})
    kube_client.patch(DEPLOYMENT, "default", "demo-router", {"metadata": {"labels": {"x": "1"}}})
    wait_for(lambda: "demo-router" in seen, message="an event on our own Deployment")
    deployment_reads = [
        s for s in kube.requests()
        if s.agent.startswith("kopf/") and s.path.endswith("/deployments") and s.method == "GET"
    ]  # fmt: skip
    assert deployment_reads and all(
        s.query.get("labelSelector") == DEPLOYMENT_SELECTOR for s in deployment_reads
    )
    assert not [n for n in seen if n.startswith("other-")]
