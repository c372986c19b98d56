"""The operator, kopf and the official client unchanged, against the API emulator over
HTTP: create, status, update, drift repair, delete."""

from __future__ import annotations

import copy

import pytest
from operator_helpers import (
    CHILDREN,
    CONFIGMAP,
    SERVICE,
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


def test_create_makes_every_object_owned_and_reports_status(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    made = kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    uid = made["metadata"]["uid"]
    for resource in CHILDREN:
        for obj in kube.objects(resource, "default"):
            refs = obj["metadata"]["ownerReferences"]
            assert refs == [
                {
                    "apiVersion": "splitserve.io/v1alpha1",
                    "kind": "InferenceService",
                    "name": "demo",
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], resource
    body = service(kube_client)
    status = body["status"]
    assert status["observedGeneration"] == 1
    assert status["pools"]["decode"] == {
        "replicas": 1,
        "readyReplicas": 0,
        "updatedReplicas": 0,
        "desiredReplicas": 1,
    }
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "Ready")["reason"] == "PoolsNotReady"
    assert condition(body, "Progressing")["status"] == "True"
    assert condition(body, "Degraded")["status"] == "False"
    events = kube.objects("v1/events", "default")
    assert any(e["reason"] == "Created" and e["involvedObject"]["uid"] == uid for e in events)


def test_ready_when_every_pool_reports_ready(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service(decode={"replicas": 2, "gpus": 0}))
    wait_for(lambda: all_children(kube) and converged(kube_client))
    for pool, n in (("prefill", 1), ("decode", 2), ("router", 1)):
        d = deployment(kube_client, f"demo-{pool}")
        assert d is not None
        kube_client.patch(
            DEPLOYMENT,
            "default",
            f"demo-{pool}",
            {
                "status": {
                    "observedGeneration": d["metadata"]["generation"],
                    "replicas": n,
                    "readyReplicas": n,
                    "updatedReplicas": n,
                    "availableReplicas": n,
                }
            },
            subresource="status",
        )
    wait_for(
        lambda: condition(service(kube_client), "Ready").get("status") == "True",
        message="Ready=True",
    )
    body = service(kube_client)
    assert condition(body, "Ready")["reason"] == "AllPoolsReady"
    assert condition(body, "Progressing")["status"] == "False"
    assert body["status"]["pools"]["decode"]["readyReplicas"] == 2


def test_replica_change_reaches_the_deployment(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "demo",
        {"spec": {"decode": {"replicas": 3}, "image": "splitserve/worker:0.2.0"}},
    )
    wait_for(lambda: replicas(kube_client, "demo-decode") == 3, message="decode scaled to 3")
    wait_for(lambda: converged(kube_client))
    body = service(kube_client)
    assert body["status"]["observedGeneration"] == 2
    assert body["status"]["pools"]["decode"]["desiredReplicas"] == 3
    for pool in ("prefill", "decode", "router"):
        d = deployment(kube_client, f"demo-{pool}")
        assert d is not None
        assert d["spec"]["template"]["spec"]["containers"][0]["image"] == "splitserve/worker:0.2.0"


def test_a_network_policy_turned_off_is_opened(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """The operator deletes nothing: turned off, the policy it made admits everyone."""
    from splitserve_operator.control.k8s import KINDS

    policy = KINDS[("networking.k8s.io/v1", "NetworkPolicy")]
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    closed = kube_client.get(policy, "default", "demo-workers")
    assert closed is not None and len(closed["spec"]["ingress"]) == 3
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"networkPolicy": {
        "enabled": False}}})  # fmt: skip
    wait_for(lambda: (kube_client.get(policy, "default", "demo-workers") or {}).get("spec", {})
             .get("ingress") == [{}], message="the policy opened")  # fmt: skip
    wait_for(lambda: converged(kube_client))


def test_an_edited_deployment_is_restored(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    before = deployment(kube_client, "demo-decode")
    assert before is not None
    tampered = copy.deepcopy(before["spec"]["template"]["spec"]["containers"])
    tampered[0]["image"] = "evil:latest"
    kube_client.patch(
        DEPLOYMENT,
        "default",
        "demo-decode",
        {
            "metadata": {"labels": {"team": "kept"}},
            "spec": {"replicas": 7, "template": {"spec": {"containers": tampered}}},
        },
    )

    def restored() -> bool:
        d = deployment(kube_client, "demo-decode")
        return (
            d is not None
            and d["spec"]["replicas"] == 1
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == "splitserve/worker:0.1.0"
        )

    wait_for(restored, message="the Deployment restored")
    after = deployment(kube_client, "demo-decode")
    assert after is not None
    assert after["metadata"]["labels"]["team"] == "kept"  # others' labels are left alone
    # the Event follows the apply that restored the Deployment
    wait_for(
        lambda: any(
            e["reason"] == "Updated" and "Deployment/demo-decode" in e["message"]
            for e in kube.objects("v1/events", "default")
        ),
        message="an Updated Event for the restored Deployment",
    )


def test_a_deleted_deployment_is_recreated(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    old_uid = deployment(kube_client, "demo-prefill")["metadata"]["uid"]  # type: ignore[index]
    kube_client.delete(DEPLOYMENT, "default", "demo-prefill")
    wait_for(
        lambda: (
            (deployment(kube_client, "demo-prefill") or {}).get("metadata", {}).get("uid")
            not in (None, old_uid)
        ),
        message="prefill recreated",
    )


def test_drift_in_unwatched_objects_is_repaired_by_the_resync(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator(resync_seconds=0.5)
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    kube_client.patch(SERVICE, "default", "demo-router", {"spec": {"type": "NodePort"}})
    kube_client.delete(CONFIGMAP, "default", "demo-config")
    wait_for(
        lambda: kube_client.get(CONFIGMAP, "default", "demo-config") is not None,
        message="ConfigMap recreated",
    )
    wait_for(
        lambda: kube_client.get(SERVICE, "default", "demo-router")["spec"]["type"] == "ClusterIP",
        message="Service type restored",
    )


def test_delete_takes_everything_and_nothing_comes_back(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    op = start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    kube_client.delete(INFERENCE_SERVICE, "default", "demo")
    wait_for(lambda: not any(names(kube, r) for r in CHILDREN), message="children gone")
    # Give the operator every chance to resurrect something, then look again.
    wait_for(lambda: op.controller.cache.get(("default", "demo")) is None)
    op.controller.resync_all()
    left = {r: names(kube, r) for r in CHILDREN if names(kube, r)}
    assert not left, left
    assert op.running


def test_a_reconcile_of_a_body_deleted_meanwhile_brings_nothing_back(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """A reconcile can start from a body read before the delete (a change handler's
    snapshot, or one more run of a coalesced trigger): it must not recreate what the
    garbage collector took. A new object of the same name is reconciled as usual."""
    op = start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client))
    stale = kube_client.get(INFERENCE_SERVICE, "default", "demo")
    kube_client.delete(INFERENCE_SERVICE, "default", "demo")
    wait_for(lambda: not any(names(kube, r) for r in CHILDREN), message="children gone")
    wait_for(lambda: op.controller.cache.get(("default", "demo")) is None)
    outcome = op.controller.reconcile(stale)
    assert outcome.skipped and not outcome.created
    left = {r: names(kube, r) for r in CHILDREN if names(kube, r)}
    assert not left, left
    kube_client.create(inference_service())
    wait_for(lambda: all_children(kube) and converged(kube_client), message="a new namesake")
