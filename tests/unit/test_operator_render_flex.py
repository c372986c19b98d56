"""``spec.flex``: a Deployment of switchable workers, apart from the fixed pools'
selectors, that start in the role their pod's label names."""

from __future__ import annotations

from typing import Any

import pytest
from manifest_validation import manifest_problems
from render_helpers import BASE, REF, container, objects, parseable, pod
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.render.commands import LABELS_FILE, ROLE_LABEL
from splitserve_operator.render.security import restricted_violations

pytestmark = pytest.mark.unit

FLEX = {"flex": {"replicas": 3, "gpus": 2, "tensorParallelSize": 1, "engine": {"maxNumSeqs": 32}}}


def selector(objs: dict[str, dict[str, Any]], name: str) -> dict[str, str]:
    found: dict[str, str] = objs[name]["spec"]["selector"]["matchLabels"]
    return found


def test_no_flex_pool_renders_nothing_of_it() -> None:
    objs = objects()
    assert not [name for name in objs if name.endswith("demo-flex")]
    policy = objs["NetworkPolicy/demo-workers"]["spec"]["podSelector"]
    assert policy["matchExpressions"][0]["values"] == ["prefill", "decode"]


def test_a_flex_pool_is_a_deployment_of_switchable_workers_of_its_own() -> None:
    objs = objects(FLEX)
    deployment = objs["Deployment/demo-flex"]
    assert deployment["spec"]["replicas"] == 3
    assert manifest_problems(deployment) == []
    assert manifest_problems(objs["PodDisruptionBudget/demo-flex"]) == []
    assert restricted_violations(pod(objs, "flex")) == []
    # its own component: no fixed pool's Deployment, budget or Service selects its pods
    own = selector(objs, "Deployment/demo-flex")
    assert own["app.kubernetes.io/component"] == "flex"
    for pool in ("prefill", "decode"):
        other = selector(objs, f"Deployment/demo-{pool}")
        assert other != own and other.items() - own.items()
    assert selector(objs, "PodDisruptionBudget/demo-flex") == own
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert own.items() <= labels.items() and labels[ROLE_LABEL] == "both"
    # the pool's own settings reach the worker
    resources = container(objs, "flex")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2
    assert "--max-num-seqs" in container(objs, "flex")["args"]


def test_the_flex_worker_reads_its_role_from_its_pods_labels() -> None:
    from splitserve.cli import build_parser

    objs = objects(FLEX)
    parser = build_parser()
    args = parser.parse_args(parseable(parser, container(objs, "flex")["args"]))
    assert args.switchable and args.role == "both"
    assert str(args.role_labels_file) == LABELS_FILE and args.role_label == ROLE_LABEL
    fixed = parser.parse_args(parseable(parser, container(objs, "decode")["args"]))
    assert not fixed.switchable and fixed.role_labels_file is None
    volumes = {v["name"]: v for v in pod(objs, "flex")["volumes"]}
    items = volumes["podinfo"]["downwardAPI"]["items"]
    assert items == [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
    mounts = {m["mountPath"] for m in container(objs, "flex")["volumeMounts"]}
    assert LABELS_FILE.rsplit("/", 1)[0] in mounts


def test_the_network_policy_covers_the_flex_pods_and_lets_them_push_kv() -> None:
    spec = objects(FLEX)["NetworkPolicy/demo-workers"]["spec"]
    assert spec["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode", "flex"]
    peers = spec["ingress"][1]["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert "flex" in peers


def test_a_topology_spread_spreads_the_flex_pods_not_the_decode_pool() -> None:
    spread = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
    objs = objects({"flex": {"podTemplate": {"topologySpreadConstraints": [spread]}}})
    rendered = pod(objs, "flex")["topologySpreadConstraints"][0]["labelSelector"]
    assert rendered == {"matchLabels": selector(objs, "Deployment/demo-flex")}


def test_the_flex_pool_is_checked_like_the_others() -> None:
    with pytest.raises(SpecError, match=r"flex.*tensorParallelSize 3 does not divide gpus 2"):
        parse_spec({**BASE, "flex": {"gpus": 2, "tensorParallelSize": 3}}, name=REF.name)
    # a switchable worker serves decode too, whose ranks each receive their heads, over
    # every KV backend
    for kv in ({}, {"kvTransfer": {"backend": "grpc"}}, {"kvTransfer": {"backend": "nixl"}}):
        flex = parse_spec({**BASE, "flex": {"gpus": 2}, **kv}, name=REF.name).flex
        assert flex is not None and flex.tensor_parallel == 2
    assert parse_spec({**BASE, "flex": {"gpus": 2, "tensorParallelSize": 1}}, name=REF.name).flex
    assert parse_spec(BASE, name=REF.name).flex is None


RICH: dict[str, Any] = {
    "replicas": 2,
    "gpus": 2,
    "tensorParallelSize": 1,
    "acceleratorResource": "amd.com/gpu",
    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "env": [{"name": "A", "value": "1"}],
    "priorityClassName": "serving",
    "runtimeClassName": "nvidia",
    "podTemplate": {
        "labels": {"team": "a"},
        "annotations": {"note": "x"},
        "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
        "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp"}],
    },
    "rollout": {"maxSurge": 1, "maxUnavailable": 0, "progressDeadline": "1h"},
    "rdma": {"resource": "rdma/hca"},
    "engine": {"maxNumSeqs": 16, "gpuMemoryPercent": 80, "kvCacheMemory": "2Gi"},
}


def _as_decode(deployment: dict[str, Any]) -> dict[str, Any]:
    """A flex Deployment's body less what makes it switchable, named as the decode one."""
    body: dict[str, Any] = deployment["spec"]
    template = body["template"]
    template["metadata"]["labels"].pop(ROLE_LABEL)
    template["metadata"]["labels"].pop("app.kubernetes.io/component")
    body.pop("selector")
    pod_spec = template["spec"]
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != "podinfo"]
    box = pod_spec["containers"][0]
    box["volumeMounts"] = [m for m in box["volumeMounts"] if m["name"] != "podinfo"]
    box["name"] = "decode"
    args = box["args"]
    at = args.index("--switchable")
    assert args[at:] == ["--switchable", "--role-labels-file", LABELS_FILE,
                         "--role-label", ROLE_LABEL]  # fmt: skip
    box["args"] = args[:at]
    box["args"][args.index("--role") + 1] = "decode"
    return body


def test_every_pool_field_reaches_the_flex_pods_as_it_reaches_the_decode_pods() -> None:
    """The flex pool has the decode pool's fields (the CRD's field check says so); here
    each of them renders the same way in both, but for what makes a pod switchable."""
    decode = objects({"decode": RICH})["Deployment/demo-decode"]
    flex = objects({"flex": RICH})["Deployment/demo-flex"]
    assert manifest_problems(flex) == []
    expected = decode["spec"]
    expected["template"]["metadata"]["labels"].pop(ROLE_LABEL)
    expected["template"]["metadata"]["labels"].pop("app.kubernetes.io/component")
    expected.pop("selector")
    assert _as_decode(flex) == expected
