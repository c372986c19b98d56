"""Render's smaller rules at their edges: a pool sized zero, who writes a pool's size,
the restricted-profile check on pods that break it, the config
document's names and ports, and what render hands around frozen."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from render_helpers import BASE, REF, config, objects, pod
from splitserve_operator.api.parse import parse_spec
from splitserve_operator.api.values import Pool
from splitserve_operator.render.commands import ROUTER_HTTP_PORT, WORKER_GRPC_PORT
from splitserve_operator.render.manifests import Desired, RenderInputs, render
from splitserve_operator.render.names import ServiceRef
from splitserve_operator.render.replicas import deployment_replicas, pool_target
from splitserve_operator.render.security import restricted_violations

pytestmark = pytest.mark.unit

AUTOSCALED: dict[str, Any] = {
    **BASE,
    "slo": {"ttft": "1s", "tpot": "100ms"},
    "autoscaling": {
        "enabled": True,
        "prometheusUrl": "http://p:9090",
        "decode": {"minReplicas": 1, "maxReplicas": 4},
    },
}


def test_a_pool_sized_zero_is_a_size_not_a_missing_one() -> None:
    on, off = parse_spec(AUTOSCALED), parse_spec(BASE)
    # the planner's 0 on the WorkerPool is its decision, clamped to the minimum 1; the
    # spec's seed does not replace it, nor does the operator write the field back
    held = pool_target(on, Pool.DECODE, exists=True, live=0, recorded=1, ours=False)
    assert (held.replicas, held.target) == (None, 0)
    assert deployment_replicas(on, Pool.DECODE, 0) == 1
    # with autoscaling off, a pool scaled to zero from outside stays at zero
    kept = pool_target(off, Pool.DECODE, exists=True, live=0, recorded=1, ours=False)
    assert (kept.replicas, kept.target) == (None, 0)
    assert deployment_replicas(off, Pool.DECODE, 0) == 0
    # a pool with no size yet starts at the spec's
    unset = pool_target(on, Pool.DECODE, exists=True, live=None, recorded=None, ours=False)
    assert (unset.replicas, unset.target) == (1, 1)


def test_who_writes_a_pools_size() -> None:
    on, off = parse_spec(AUTOSCALED), parse_spec(BASE)
    # autoscaling on: the planner's field; the operator keeps its seed only while it
    # still owns it, and a spec edit does not reach the pool
    assert pool_target(on, Pool.DECODE, exists=True, live=3, recorded=1, ours=True).replicas == 3
    taken = pool_target(on, Pool.DECODE, exists=True, live=3, recorded=1, ours=False)
    assert taken.replicas is None and taken.requested == 1
    # autoscaling off: the spec's value while the operator owns the field, or once the
    # spec changes; another writer's size is left alone until then
    assert pool_target(off, Pool.DECODE, exists=True, live=1, recorded=1, ours=True).replicas == 1
    scaled = pool_target(off, Pool.DECODE, exists=True, live=3, recorded=1, ours=False)
    assert (scaled.replicas, scaled.target) == (None, 3)
    edited = pool_target(off, Pool.DECODE, exists=True, live=3, recorded=2, ours=False)
    assert (edited.replicas, edited.target, edited.requested) == (1, 1, 1)
    # the router has no WorkerPool: its spec alone sizes it, autoscaled or not
    for spec in (on, off):
        assert deployment_replicas(spec, Pool.ROUTER, 9) == spec.router.replicas


def _broken(change: Any) -> list[str]:
    """The violations of the rendered decode pod after ``change(pod)``."""
    p = copy.deepcopy(pod(objects(), "decode"))
    assert restricted_violations(p) == []
    change(p)
    return restricted_violations(p)


def _ctx(p: dict[str, Any]) -> dict[str, Any]:
    ctx: dict[str, Any] = p["containers"][0]["securityContext"]
    return ctx


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda p: p.update(hostNetwork=True), "hostNetwork must not be set"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
         "volume h: type ['hostPath'] is not allowed"),
        (lambda p: _ctx(p).update(runAsNonRoot=False), "runAsNonRoot must be true"),
        (lambda p: _ctx(p).update(runAsUser=0), "runAsUser must not be 0"),
        (lambda p: (p["securityContext"].pop("seccompProfile", None),
                    _ctx(p).pop("seccompProfile", None)), "seccompProfile must be"),
        (lambda p: p["containers"][0].setdefault("ports", []).append(
            {"containerPort": 80, "hostPort": 80}), "hostPort must not be set"),
        (lambda p: p.setdefault("initContainers", []).append(
            {"name": "init", "securityContext": {}}), "init: privileged"),
    ],
)  # fmt: skip
def test_the_restricted_check_names_what_a_pod_breaks(change: Any, said: str) -> None:
    found = _broken(change)
    if said == "init: privileged":  # an init container with no security context at all
        assert any(v.startswith("init: ") for v in found), found
        return
    assert any(said in v for v in found), found


def test_seccomp_set_on_the_pod_covers_its_containers() -> None:
    def pod_level_only(p: dict[str, Any]) -> None:
        p["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
        _ctx(p).pop("seccompProfile", None)

    assert _broken(pod_level_only) == []


def test_the_config_document_keeps_the_specs_names_and_each_services_port() -> None:
    doc = config(objects({"kvTransfer": {"backend": "grpc", "leaseSeconds": 7}}))
    assert doc["kvTransfer"]["leaseSeconds"] == 7  # the CRD's camelCase, not lease_seconds
    assert "lease_seconds" not in doc["kvTransfer"]
    assert all("_" not in key for key in doc["model"]), doc["model"]
    ports = {pool: s["port"] for pool, s in doc["services"].items()}
    assert ports == {"router": ROUTER_HTTP_PORT, "prefill": WORKER_GRPC_PORT,
                     "decode": WORKER_GRPC_PORT}  # fmt: skip


def test_workers_of_several_ranks_get_shared_memory_and_no_pod_gets_service_links() -> None:
    objs = objects({"prefill": {"gpus": 2}})
    for pool in ("prefill", "decode", "router"):
        p = pod(objs, pool)
        assert p["enableServiceLinks"] is False, pool
        shm = [v for v in p["volumes"] if v["name"] == "dshm"]
        if pool == "prefill":  # two ranks: NCCL's buffers, 1Gi each
            assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
        else:  # one rank (decode, gpus 1) or the router: no collectives, no /dev/shm
            assert shm == [], pool
    sa = objs["ServiceAccount/demo-router"]
    assert sa["automountServiceAccountToken"] is False  # the pod asks for the token itself


def test_desired_objects_name_themselves_from_their_manifest() -> None:
    spec = parse_spec(BASE)
    out = render(REF, spec, RenderInputs(replicas={p: 1 for p in Pool}, token="t"))
    for d in out:
        meta = d.manifest["metadata"]
        assert (d.api_version, d.kind, d.name, d.namespace) == (
            d.manifest["apiVersion"], d.manifest["kind"], meta["name"], meta["namespace"]
        )  # fmt: skip
    assert {d.namespace for d in out} == {REF.namespace}


def test_what_render_hands_around_is_frozen() -> None:
    for cls in (Desired, RenderInputs, ServiceRef):
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        REF.name = "other"  # type: ignore[misc]


def test_worker_services_are_headless_grpc_and_the_routers_serves_http() -> None:
    objs = objects()
    for pool in ("prefill", "decode"):
        s = objs[f"Service/demo-{pool}"]["spec"]
        assert s["clusterIP"] == "None", pool  # the router finds each worker pod
        first = s["ports"][0]
        assert (first["name"], first["port"]) == ("grpc", WORKER_GRPC_PORT)
    router = objs["Service/demo-router"]["spec"]
    assert "clusterIP" not in router and router["type"] == "ClusterIP"
    first = router["ports"][0]
    assert (first["name"], first["port"]) == ("http", ROUTER_HTTP_PORT)
