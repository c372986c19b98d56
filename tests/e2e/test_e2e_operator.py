"""The operator on a real API server (runs only when KUBECONFIG is set): the GPU example's
objects with a fake GPU resource and no write once it has settled, scaling through a
WorkerPool's scale subresource, the leader's handover, and deletion with the operator
stopped. The chart is installed by tests/e2e/conftest.py (two replicas, leader election,
a resync every 30 s). See README.md here for kind."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_kit import condition, get, items, kubectl, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "charts" / "splitserve" / "examples"
GPU = "nvidia.com/gpu"
POOLS = ("prefill", "decode", "router")
RESYNC_S = 30
"""The chart's operator.resyncSeconds in conftest.py."""

if not os.environ.get("KUBECONFIG"):
    pytest.skip(
        "e2e tests need a real cluster: set KUBECONFIG to run them", allow_module_level=True
    )


def _example(file: str, name: str) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / file).read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["image"] = os.environ.get("SPLITSERVE_WORKER_IMAGE", doc["spec"]["image"])
    return dict(doc)


def _apply(doc: dict[str, Any], namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input_=yaml.safe_dump(doc))


def _deployments(name: str, namespace: str) -> dict[str, dict[str, Any]]:
    out = {}
    for pool in POOLS:
        found = get("deployment", f"{name}-{pool}", namespace)
        if found is not None:
            out[pool] = found
    return out


def _settled(name: str, namespace: str) -> bool:
    body = get("inferenceservice", name, namespace) or {}
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return bool(meta) and status.get("observedGeneration") == meta.get("generation")


def _operator_apply_times(obj: dict[str, Any]) -> list[str]:
    return [
        str(e.get("time"))
        for e in obj["metadata"].get("managedFields") or []
        if e.get("manager") == "splitserve-operator" and e.get("operation") == "Apply"
    ]


@pytest.fixture(scope="module")
def fake_gpu_node() -> str:
    """A node that advertises 8 of the GPU resource (and the GPU example's product label);
    kubelet keeps an extended resource patched into the node's status."""
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
    node = nodes[0]["metadata"]["name"]
    ops = [
        {"op": "add", "path": f"/status/{field}/nvidia.com~1gpu", "value": "8"}
        for field in ("capacity", "allocatable")
    ]
    kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(ops))
    kubectl("label", "node", node, "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3", "--overwrite")
    return str(node)


def test_the_gpu_example_is_applied_and_then_left_alone(
    installed: dict[str, str], fake_gpu_node: str
) -> None:
    ns = installed["app"]
    doc = _example("inferenceservice.yaml", "gpu")
    for pool in ("prefill", "decode", "router"):  # small enough for a kind node
        spec = doc["spec"].setdefault(pool, {})
        spec["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
        spec["replicas"] = 1
    doc["spec"]["autoscaling"] = {"enabled": False}
    _apply(doc, ns)

    def all_three() -> dict[str, dict[str, Any]] | None:
        found = _deployments("gpu", ns)
        return found if len(found) == 3 else None

    deployments = wait_until("the three Deployments", 120, all_three)
    for pool in ("prefill", "decode"):
        container = deployments[pool]["spec"]["template"]["spec"]["containers"][0]
        # the API server's canonical form, which the operator must not read as drift
        assert container["resources"]["requests"][GPU] == "1"
        assert container["resources"]["limits"][GPU] == "1"
        pool_obj = get("workerpool", f"gpu-{pool}", ns)
        assert pool_obj is not None and pool_obj["spec"]["replicas"] == 1
    wait_until("the first reconcile", 120, lambda: _settled("gpu", ns))

    def scheduled() -> bool:
        pods = items(
            "pods", ns, "app.kubernetes.io/instance=gpu,app.kubernetes.io/component=decode"
        )
        return bool(pods) and all(
            c.get("status") == "True"
            for p in pods
            for c in p.get("status", {}).get("conditions", [])
            if c.get("type") == "PodScheduled"
        )

    wait_until("decode pods scheduled on the fake GPU", 180, scheduled)
    # Idle: more than a resync later, no apply has touched any Deployment.
    before = {p: (d["metadata"]["generation"], _operator_apply_times(d))
              for p, d in _deployments("gpu", ns).items()}  # fmt: skip
    time.sleep(RESYNC_S + 15)
    after = {p: (d["metadata"]["generation"], _operator_apply_times(d))
             for p, d in _deployments("gpu", ns).items()}  # fmt: skip
    assert after == before
    kubectl("delete", "inferenceservice", "gpu", "-n", ns, "--wait=true", "--timeout=120s")


def test_a_pool_scaled_through_its_scale_subresource_stays_scaled(
    installed: dict[str, str],
) -> None:
    ns = installed["app"]
    _apply(_example("inferenceservice-cpu.yaml", "scaled"), ns)
    wait_until("the decode pool", 120, lambda: get("workerpool", "scaled-decode", ns))
    wait_until("the first reconcile", 120, lambda: _settled("scaled", ns))
    kubectl("scale", "workerpool", "scaled-decode", "-n", ns, "--replicas=2")
    wait_until(
        "the Deployment at 2",
        60,
        lambda: (get("deployment", "scaled-decode", ns) or {}).get("spec", {}).get("replicas") == 2,
    )
    time.sleep(RESYNC_S + 15)  # a resync later
    assert (get("deployment", "scaled-decode", ns) or {})["spec"]["replicas"] == 2
    scale = json.loads(
        kubectl(
            "get",
            "--raw",
            f"/apis/splitserve.io/v1alpha1/namespaces/{ns}/workerpools/scaled-decode/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"] == (
        "app.kubernetes.io/component=decode,app.kubernetes.io/instance=scaled"
    )
    kubectl("delete", "inferenceservice", "scaled", "-n", ns, "--wait=true", "--timeout=120s")


def _lease(installed: dict[str, str]) -> dict[str, Any]:
    leases = items("leases", installed["system"])
    mine = [x for x in leases if x["metadata"]["name"].startswith(installed["release"])]
    assert len(mine) == 1, [x["metadata"]["name"] for x in leases]
    return mine[0]


def test_the_standby_takes_over_a_reconcile_the_leader_did_not_finish(
    installed: dict[str, str],
) -> None:
    ns, system = installed["app"], installed["system"]
    leader = wait_until("a leader", 120, lambda: _lease(installed)["spec"].get("holderIdentity"))
    pods = {p["metadata"]["name"] for p in items("pods", system)}
    assert leader in pods and len(pods) == 2
    doc = _example("inferenceservice-cpu.yaml", "handover")
    _apply(doc, ns)
    # killed at once, as a node loss would: no chance to finish or hand the lease back
    kubectl("delete", "pod", leader, "-n", system, "--grace-period=0", "--force", "--wait=false")
    new = wait_until(
        "a new leader",
        120,
        lambda: (h := _lease(installed)["spec"].get("holderIdentity")) not in (None, leader) and h,
    )
    assert new in pods
    wait_until("all three Deployments", 180, lambda: len(_deployments("handover", ns)) == 3)
    wait_until("reconciled", 180, lambda: _settled("handover", ns))
    for kind in ("workerpool", "service", "poddisruptionbudget"):
        names = [
            o["metadata"]["name"] for o in items(kind, ns, "app.kubernetes.io/instance=handover")
        ]
        assert len(names) == len(set(names)), (kind, names)
    secrets = [s for s in items("secrets", ns) if s["metadata"]["name"] == "handover-worker-token"]
    assert len(secrets) == 1
    kubectl("delete", "inferenceservice", "handover", "-n", ns, "--wait=true", "--timeout=120s")


def test_an_autoscaled_service_is_deleted_while_the_operator_is_stopped(
    installed: dict[str, str],
) -> None:
    ns, system, release = installed["app"], installed["system"], installed["release"]
    doc = copy.deepcopy(_example("inferenceservice-cpu.yaml", "gone"))
    doc["spec"]["slo"] = {"ttft": "2s", "tpot": "200ms"}
    doc["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": "http://prometheus.invalid:9090",
    }
    _apply(doc, ns)
    wait_until("reconciled", 180, lambda: _settled("gone", ns))
    wait_until("a planner tick", 120,
               lambda: condition(get("inferenceservice", "gone", ns), "ScalingActive"))  # fmt: skip
    assert not (get("inferenceservice", "gone", ns) or {})["metadata"].get("finalizers")
    operator = [d["metadata"]["name"] for d in items("deployments", system)
                if d["metadata"]["name"].startswith(release)]  # fmt: skip
    kubectl("scale", "deployment", operator[0], "-n", system, "--replicas=0")
    try:
        wait_until("the operator stopped", 120, lambda: not items("pods", system))
        kubectl("delete", "inferenceservice", "gone", "-n", ns, "--wait=true", "--timeout=60s")
        assert get("inferenceservice", "gone", ns) is None
        wait_until("its children collected", 180, lambda: not _deployments("gone", ns)
                   and not items("workerpools", ns, "app.kubernetes.io/instance=gone"))  # fmt: skip
    finally:
        kubectl("scale", "deployment", operator[0], "-n", system, "--replicas=2")
