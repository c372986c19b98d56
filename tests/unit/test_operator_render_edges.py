"""Render's smaller rules at their edges: the planner's zero, the owner of
``desiredReplicas``, the restricted-profile check on pods that break it, the config
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
from splitserve_operator.render.replicas import owns_desired_replicas, plan_replicas
from splitserve_operator.render.security import restricted_violations

pytestmark = pytest.mark.unit

AUTOSCALED: dict[str, Any] = {
    **BASE,
    "slo": {"ttftSeconds": 1, "tpotSeconds": 0.1},
    "autoscaling": {
        "enabled": True,
        "prometheusUrl": "http://p:9090",
        "decode": {"minReplicas": 1, "maxReplicas": 4},
    },
}


def test_the_planners_zero_is_a_decision_and_a_negative_one_is_ignored() -> None:
    spec = parse_spec(AUTOSCALED)
    # 0 is the planner's number (clamped to the minimum 1), not a missing one: the live 3
    # does not win; -1 is no number, so the live size stands
    assert plan_replicas(spec, Pool.DECODE, live=3, planned=0) == 1
    assert plan_replicas(spec, Pool.DECODE, live=3, planned=-1) == 3
    assert plan_replicas(spec, Pool.DECODE, live=-2, planned=-1) == 1  # the spec's 1


def test_the_planner_owns_desired_replicas_of_scaled_pools_only() -> None:
    on, off = parse_spec(AUTOSCALED), parse_spec(BASE)
    assert not owns_desired_replicas(on, Pool.DECODE)
    assert not owns_desired_replicas(on, Pool.PREFILL)
    assert owns_desired_replicas(on, Pool.ROUTER)
    for pool in Pool:
        assert owns_desired_replicas(off, pool), pool


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


def test_workers_get_shared_memory_and_no_pod_gets_service_links() -> None:
    objs = objects()
    for pool in ("prefill", "decode", "router"):
        p = pod(objs, pool)
        assert p["enableServiceLinks"] is False, pool
        shm = [v for v in p["volumes"] if v["name"] == "dshm"]
        if pool == "router":
            assert shm == []
        else:
            assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}], pool
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
