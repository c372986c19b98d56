"""Server-side apply against an emulator that does what a real API server does to what
it stores (canonical quantities, Deployment defaults, field ownership): an unchanged
service costs no write, drift is what field ownership says it is, and a field the spec
stops asking for is removed."""

from __future__ import annotations

import pytest
from operator_helpers import all_children, condition, converged, mark_ready, service
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE_PASSES = 60
"""Full resyncs the idle service is held through (each one reconciles every object)."""

GPU_POOLS = {
    "prefill": {
        "replicas": 1,
        "gpus": 1,
        "resources": {"requests": {"cpu": 4, "memory": "16Gi"}, "limits": {"memory": "1024Mi"}},
    },
    "decode": {"replicas": 2, "gpus": 1, "resources": {"requests": {"cpu": "0.5"}}},
}


def _writes_to_deployments(kube, since: int) -> list[tuple[str, str, str]]:
    return [
        (s.method, s.path, s.agent)
        for s in kube.requests()[since:]
        if s.method in ("PATCH", "PUT")
        and "/deployments/" in s.path
        and not s.agent.startswith("splitserve-tests")
    ]


def test_an_idle_gpu_service_costs_no_deployment_write(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """The API server hands quantities back as canonical strings (``1`` -> ``"1"``,
    ``"0.5"`` -> ``"500m"``, ``1024Mi`` -> ``"1Gi"``) and fills in defaults: a drift check
    that compares what it sent with what it reads back patches forever."""
    op = start_operator(resync_seconds=0.1)
    kube_client.create(inference_service(**GPU_POOLS))
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    decode = kube_client.get(DEPLOYMENT, "default", "demo-decode")
    assert decode is not None
    resources = decode["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "500m", "nvidia.com/gpu": "1"}  # as stored
    mark_ready(kube_client)
    wait_for(lambda: condition(service(kube_client), "Ready").get("status") == "True",
             message="Ready")  # fmt: skip
    start = len(kube.requests())
    passes = op.operator.resync.passes
    # Someone else labels a Deployment: a watch event the operator looks at.
    kube_client.patch(
        DEPLOYMENT, "default", "demo-prefill", {"metadata": {"labels": {"team": "a"}}}
    )
    wait_for(
        lambda: op.operator.resync.passes >= passes + IDLE_PASSES,
        timeout=120,
        message=f"{IDLE_PASSES} resyncs",
    )
    assert _writes_to_deployments(kube, start) == []
    assert condition(service(kube_client), "Ready")["status"] == "True"


def test_objects_a_merging_version_made_are_taken_over_and_pruned(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """An operator version before server-side apply created children with POST and merge
    patches (its fields recorded as an Update of "splitserve-operator") and kept their
    manifest in an annotation. The upgrade makes those fields the operator's applied
    ones: the annotation goes, and so does a field the spec no longer asks for."""
    import json

    from render_helpers import inputs
    from splitserve_operator.api.parse import parse_spec
    from splitserve_operator.control.k8s import INFERENCE_SERVICE, KubeClient
    from splitserve_operator.render.manifests import render
    from splitserve_operator.render.names import ServiceRef

    made = kube_client.create(inference_service(decode={"replicas": 1, "gpus": 0}))
    ref = ServiceRef("demo", "default", made["metadata"]["uid"])
    old_spec = parse_spec({**made["spec"], "decode": {"gpus": 0, "nodeSelector": {"old": "1"}}})
    old = KubeClient(kube.configuration(), user_agent="splitserve-operator/0.0.9")
    deployment = next(d for d in render(ref, old_spec, inputs(old_spec)) if d.name == "demo-decode"
                      and d.kind == "Deployment").manifest  # fmt: skip
    annotations = deployment["metadata"].setdefault("annotations", {})
    annotations["splitserve.io/last-applied"] = json.dumps(deployment)
    old.create(deployment)
    old.close()
    # the old version had reconciled it: a status with observedGeneration
    kube_client.patch_status("default", "demo", {"observedGeneration": 1})

    start_operator()

    def upgraded() -> bool:
        d = kube_client.get(DEPLOYMENT, "default", "demo-decode") or {}
        meta = d.get("metadata") or {}
        return "splitserve.io/last-applied" not in (meta.get("annotations") or {}) and (
            "nodeSelector" not in d["spec"]["template"]["spec"]
        )

    wait_for(upgraded, message="the annotation and the dropped nodeSelector gone")
    d = kube_client.get(DEPLOYMENT, "default", "demo-decode")
    assert d is not None
    entries = {(e["manager"], e["operation"]) for e in d["metadata"]["managedFields"]}
    assert ("splitserve-operator", "Apply") in entries
    assert ("splitserve-operator", "Update") not in entries
    assert kube_client.get(INFERENCE_SERVICE, "default", "demo") is not None


SURFACE = {
    "model": {"name": "smollm2-135m", "source": "org/model", "downloadSizeLimit": "1024Mi"},
    "podSecurityContext": {"fsGroup": 10001},
    "prefill": {
        "gpus": 1,
        "acceleratorResource": "amd.com/gpu",
        "rollout": {"maxSurge": 1, "maxUnavailable": 0, "progressDeadline": "50m"},
        "podTemplate": {
            "labels": {"kueue.x-k8s.io/queue-name": "gpu"},
            "annotations": {"sidecar.istio.io/inject": "false"},
            "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
            "volumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca", "readOnly": True}],
        },
    },
    "decode": {"gpus": 1, "rdma": {"resource": "rdma/hca", "count": 1}},
    "router": {
        "httpRoute": {
            "parentRefs": [{"name": "public", "namespace": "gateways"}],
            "hostnames": ["llm.example.com"],
            "requestTimeout": "5m",
        }
    },
}


def _operator_writes(kube, since: int) -> list[tuple[str, str]]:
    return [
        (s.method, s.path)
        for s in kube.requests()[since:]
        if s.method in ("POST", "PATCH", "PUT")
        and s.agent.startswith("splitserve-operator/")
        and "/events" not in s.path
    ]


def test_the_whole_api_surface_is_applied_once_and_pruned_when_dropped(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    """Every field the spec has (pod template overlay, accelerator resource, RDMA, rollout,
    download size, pod security, an HTTPRoute, the status URL) is applied by server-side
    apply and owned by the operator: an idle service costs no write of any kind, whatever
    the server rewrote (``1024Mi`` stored as ``1Gi``); an overlay entry and a route's
    hostnames the spec drops are removed from the live objects."""
    from splitserve_operator.control.k8s import KINDS

    route_kind = KINDS[("gateway.networking.k8s.io/v1", "HTTPRoute")]
    op = start_operator(resync_seconds=0.1)
    kube_client.create(inference_service(**SURFACE))
    wait_for(lambda: all_children(kube) and converged(kube_client), message="all children")
    mark_ready(kube_client)
    wait_for(lambda: condition(service(kube_client), "Ready").get("status") == "True",
             message="Ready")  # fmt: skip
    status = service(kube_client)["status"]
    assert status["url"] == "http://demo-router.default.svc:8000"
    assert "warnings" not in status
    prefill = kube_client.get(DEPLOYMENT, "default", "demo-prefill")
    assert prefill is not None
    pod = prefill["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "1"
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    assert volumes["ca"]["configMap"]["name"] == "corp-ca"
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == "1Gi"  # as stored, sent as 1024Mi
    assert prefill["spec"]["progressDeadlineSeconds"] == 3000
    route = kube_client.get(route_kind, "default", "demo-router")
    assert route is not None and route["spec"]["hostnames"] == ["llm.example.com"]
    managers = {e["manager"] for e in route["metadata"]["managedFields"]}
    assert managers == {"splitserve-operator"}

    start = len(kube.requests())
    passes = op.operator.resync.passes
    wait_for(lambda: op.operator.resync.passes >= passes + 20, timeout=120,
             message="20 resyncs")  # fmt: skip
    assert _operator_writes(kube, start) == []

    # drop the overlay's volume and the route's hostnames: both go from the live objects
    spec = service(kube_client)["spec"]
    spec["prefill"]["podTemplate"] = {"labels": {"kueue.x-k8s.io/queue-name": "gpu"}}
    spec["router"]["httpRoute"] = {"parentRefs": [{"name": "public", "namespace": "gateways"}]}
    kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "demo",
        [{"op": "replace", "path": "/spec", "value": spec}],
        content_type="application/json-patch+json",
    )

    def pruned() -> bool:
        d = kube_client.get(DEPLOYMENT, "default", "demo-prefill") or {}
        template = d["spec"]["template"]
        volumes = [v["name"] for v in template["spec"].get("volumes") or []]
        mounts = [m["name"] for m in template["spec"]["containers"][0].get("volumeMounts") or []]
        annotations = template["metadata"].get("annotations") or {}
        r = kube_client.get(route_kind, "default", "demo-router") or {}
        return (
            "ca" not in volumes
            and "ca" not in mounts
            and "sidecar.istio.io/inject" not in annotations
            and "hostnames" not in r.get("spec", {})
        )

    wait_for(pruned, message="the dropped overlay entries and hostnames removed")
    d = kube_client.get(DEPLOYMENT, "default", "demo-prefill")
    assert d is not None
    assert d["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
