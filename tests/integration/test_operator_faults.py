"""The operator under abuse: many kinds of invalid InferenceService (as a cluster with
an old or missing CRD schema would let through), garbage status, RBAC coverage."""

from __future__ import annotations

import copy
import os
from typing import Any

import helm_chart as chart
import pytest
from operator_helpers import mark_ready
from splitserve_operator.control.config import LeaseConfig
from splitserve_operator.control.k8s import INFERENCE_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VALID: dict[str, Any] = {
    "model": {"name": "smollm2-135m"},
    "image": "splitserve/worker:0.1.0",
    "prefill": {"gpus": 0},
    "decode": {"gpus": 0},
}


def _spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(VALID)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DROP:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


_DROP = object()

# (name, spec, a fragment the Degraded message must contain)
INVALID: list[tuple[str, Any, str]] = [
    ("no-spec", None, "spec: must be an object"),
    ("spec-is-text", "serve llama please", "spec: must be an object"),
    ("no-model", _spec(model=_DROP), "spec.model: Field required"),
    ("empty-model-name", _spec(model__name=""), "spec.model.name"),
    ("bad-dtype", _spec(model__dtype="int3"), "spec.model.dtype"),
    ("no-image", _spec(image=_DROP), "spec.image"),
    ("image-with-spaces", _spec(image="not an image"), "spec.image"),
    ("negative-replicas", _spec(decode__replicas=-1), "spec.decode.replicas"),
    ("replicas-as-text", _spec(prefill__replicas="two"), "spec.prefill.replicas"),
    ("too-many-replicas", _spec(prefill__replicas=100000), "spec.prefill.replicas"),
    ("fractional-gpus", _spec(decode__gpus=0.5), "spec.decode.gpus"),
    ("gpu-in-resources", _spec(decode__resources={"limits": {"nvidia.com/gpu": 2}}), "gpus field"),
    ("bad-quantity", _spec(prefill__resources={"requests": {"memory": "lots"}}), "not a quantity"),
    ("unknown-backend", _spec(kvTransfer={"backend": "carrier-pigeon"}), "spec.kvTransfer.backend"),
    ("zero-lease", _spec(kvTransfer={"leaseSeconds": 0}), "spec.kvTransfer.leaseSeconds"),
    ("percentile-of-a-hundred", _spec(slo={"percentile": 100}), "spec.slo.percentile"),
    ("ttft-without-unit", _spec(slo={"ttft": "500"}), "is not a duration such as 500ms"),
    ("ttft-in-two-forms", _spec(slo={"ttft": "1s", "ttftSeconds": 1}), "not both"),
    (
        "operator-label",
        _spec(decode__podTemplate={"labels": {"app.kubernetes.io/component": "x"}}),
        "the operator's own",
    ),
    (
        "autoscaling-without-prometheus",
        _spec(autoscaling={"enabled": True}, slo={"ttft": "1s", "tpot": "100ms"}),
        "prometheusUrl is required",
    ),
    (
        "autoscaling-without-slo",
        _spec(autoscaling={"enabled": True, "prometheusUrl": "http://p:9090"}),
        "slo.ttft",
    ),
    (
        "min-above-max",
        _spec(autoscaling={"prefill": {"minReplicas": 5, "maxReplicas": 2}}),
        "must not exceed maxReplicas",
    ),
    (
        "duplicate-env",
        _spec(router={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "listed twice",
    ),
    (
        "env-value-and-from",
        _spec(decode__env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]),
        "not both",
    ),
    (
        "bad-toleration",
        _spec(prefill__tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
        "must not set value",
    ),
    ("bad-node-selector", _spec(prefill__nodeSelector={"zone": 3}), "spec.prefill.nodeSelector"),
    ("affinity-as-list", _spec(decode__affinity=[{"nodeAffinity": {}}]), "spec.decode.affinity"),
    ("unknown-field", _spec(turbo=True), "spec.turbo: Extra inputs are not permitted"),
    ("Bad.Name", copy.deepcopy(VALID), "metadata.name"),
    ("x" * 60, copy.deepcopy(VALID), "at most 48 characters"),
]


def _degraded(kube_client, name: str) -> dict[str, Any]:
    body = kube_client.get(INFERENCE_SERVICE, "faults", name) or {}
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == "Degraded":
            return c
    return {}


def test_every_kind_of_invalid_service_is_reported_and_nothing_crashes(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    assert len(INVALID) >= 15
    op = start_operator()
    for name, spec, _ in INVALID:
        body = inference_service(name, "faults")
        body["spec"] = spec
        if spec is None:
            del body["spec"]
        kube_client.create(body)
    for name, _, fragment in INVALID:
        condition = wait_for(
            lambda name=name: (
                _degraded(kube_client, name).get("status") == "True"
                and _degraded(kube_client, name)
            ),
            message=name,
        )
        assert condition["reason"] == "InvalidSpec", name
        assert fragment in condition["message"], (name, condition["message"])
    assert kube.objects("apps/v1/deployments", "faults") == []
    assert op.running
    # The operator still serves a valid one.
    kube_client.create(inference_service("fine", "faults"))
    wait_for(lambda: len(kube.objects("apps/v1/deployments", "faults")) == 3)


def test_garbage_status_is_replaced(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: len(kube.objects("apps/v1/deployments", "default")) == 3)
    kube_client.patch_status("default", "demo", "garbage")  # type: ignore[arg-type]
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"decode": {"replicas": 2}}})

    def repaired() -> bool:
        status = (kube_client.get(INFERENCE_SERVICE, "default", "demo") or {}).get("status")
        return isinstance(status, dict) and status.get("observedGeneration") == 2

    wait_for(repaired, message="a status again")


def test_the_charts_rbac_covers_every_call_the_operator_makes(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """Replays create, update, drift repair, invalid spec, restart and delete, then checks
    each API call against the ClusterRole the chart installs, and the finalizers update
    that owner-reference enforcement asks for each child with blockOwnerDeletion."""
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI: run bash .ci/install-tools.sh .venv")
        pytest.skip("helm is not installed (bash .ci/install-tools.sh .venv)")
    lease = LeaseConfig(namespace="splitserve-system", name="splitserve", identity="replay",
                        duration_s=3, renew_deadline_s=2, retry_period_s=0.2)  # fmt: skip
    op = start_operator(resync_seconds=0.3, leader_election=lease)
    route = {"parentRefs": [{"name": "public"}]}
    kube_client.create(inference_service(router={"httpRoute": route}))
    wait_for(lambda: len(kube.objects("apps/v1/deployments", "default")) == 3)
    wait_for(lambda: kube.objects("gateway.networking.k8s.io/v1/httproutes", "default"))
    mark_ready(kube_client)  # the pools report their pods: a WorkerPool status write
    from splitserve_operator.control.k8s import KINDS

    children = [
        obj
        for kind in KINDS.values()
        if kind.kind not in ("InferenceService", "Event", "Lease")
        for obj in kube.objects(f"{kind.api_version}/{kind.plural}", "default")
    ]
    assert len(children) >= 15, "every child the operator made (the Secret, the pools included)"
    owner_calls = {
        (*call, "default", None)
        for call in chart.owner_reference_calls(children, {"InferenceService": "inferenceservices"})
    }
    finalizers = ("splitserve.io", "inferenceservices/finalizers", "update", "default", None)
    assert owner_calls == {finalizers}
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"decode": {"replicas": 2}}})

    def decode_replicas() -> object:
        # the Deployments exist before the first status is written: none yet is not 2
        status = (kube_client.get(INFERENCE_SERVICE, "default", "demo") or {}).get("status") or {}
        return ((status.get("pools") or {}).get("decode") or {}).get("replicas")

    wait_for(lambda: decode_replicas() == 2, message="decode at 2 replicas in the status")
    from splitserve_operator.control.k8s import DEPLOYMENT

    kube_client.delete(DEPLOYMENT, "default", "demo-router")
    wait_for(lambda: len(kube.objects("apps/v1/deployments", "default")) == 3)
    bad = inference_service("bad")
    bad["spec"]["image"] = ""
    kube_client.create(bad)
    wait_for(lambda: (kube_client.get(INFERENCE_SERVICE, "default", "bad") or {}).get("status"))
    # scaled through the WorkerPool, as kubectl scale or an HPA would
    pool = "/apis/splitserve.io/v1alpha1/namespaces/default/workerpools/demo-decode/scale"
    kube_client.request("PATCH", pool, body={"spec": {"replicas": 3}},
                        content_type="application/merge-patch+json")  # fmt: skip
    wait_for(lambda: decode_replicas() == 3, message="decode scaled to 3 through its pool")
    op.stop()
    start_operator(leader_election=lease)
    kube_client.delete(INFERENCE_SERVICE, "default", "demo")
    wait_for(lambda: not kube.objects("apps/v1/deployments", "default"))

    operator_calls = [
        (s.method, s.path, s.watch)
        for s in kube.requests()
        if s.agent.startswith(("splitserve-operator/", "kopf/"))
    ]
    calls = set(chart.api_calls(operator_calls)) | owner_calls
    assert ("gateway.networking.k8s.io", "httproutes", "patch") in {c[:3] for c in calls}
    documents = chart.template()
    operator_rules = chart.rules(documents, "splitserve")
    lease_rules = chart.rules(documents, "splitserve-leader-election", kind="Role")

    def allowed(
        group: str, resource: str, verb: str, namespace: str | None, name: str | None
    ) -> bool:
        if chart.allows(operator_rules, group, resource, verb):
            return True
        # the Role is bound in the release namespace only
        return namespace == "splitserve-system" and chart.allows(lease_rules, group, resource,
                                                                 verb, name)  # fmt: skip

    missing = [c for c in sorted(calls, key=str) if not allowed(*c)]
    assert calls, "no API calls recorded"
    assert not missing, f"the chart's RBAC lacks: {missing}"
    assert any(c[:3] == ("coordination.k8s.io", "leases", "patch") for c in calls)
    assert any(c[:3] == ("splitserve.io", "workerpools/status", "patch") for c in calls)
    assert chart.allows(
        operator_rules, "rbac.authorization.k8s.io", "clusterroles", "bind", "splitserve-router"
    )


def test_the_worker_token_is_never_logged_or_copied(
    kube, kube_client, start_operator, inference_service, wait_for, caplog
) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    start_operator()
    kube_client.create(inference_service())
    wait_for(lambda: len(kube.objects("apps/v1/deployments", "default")) == 3)
    (secret,) = kube.objects("v1/secrets", "default")
    token = secret["stringData"]["token"]
    assert len(token) >= 32
    assert token not in caplog.text
    assert "splitserve.io/last-applied" not in (secret["metadata"].get("annotations") or {})
    for resource in (
        "apps/v1/deployments",
        "v1/configmaps",
        "v1/events",
        "splitserve.io/v1alpha1/inferenceservices",
    ):
        for obj in kube.objects(resource, "default"):
            assert token not in str(obj), resource
