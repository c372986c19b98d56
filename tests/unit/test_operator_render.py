"""Render: every spec field's effect on the desired objects, checked one by one, and every
rendered object valid for Kubernetes (kubernetes-validate --strict) and "restricted"."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from splitserve_operator.crd_validation import load_crd, schema_of
from splitserve_operator.render import Desired, RenderInputs, ServiceRef, plan_replicas, render
from splitserve_operator.render.commands import (
    ROUTER_HTTP_PORT,
    TOKEN_FILE,
    WORKER_GRPC_PORT,
    WORKER_METRICS_PORT,
)
from splitserve_operator.render.security import restricted_violations
from splitserve_operator.spec import Pool, parse_spec

pytestmark = pytest.mark.unit

K8S_VERSION = "1.32"
REF = ServiceRef(name="demo", namespace="team-a", uid="0000-uid")
BASE: dict[str, Any] = {"model": {"name": "smollm2-135m"}, "image": "splitserve/worker:0.1.0"}


def objects(
    changes: dict[str, Any] | None = None,
    replicas: dict[Pool, int] | None = None,
) -> dict[str, dict[str, Any]]:
    raw = copy.deepcopy(BASE)
    for key, value in (changes or {}).items():
        raw[key] = value
    spec = parse_spec(raw, name=REF.name)
    plan = replicas or {pool: plan_replicas(spec, pool) for pool in Pool}
    out = render(REF, spec, RenderInputs(replicas=plan, token="secret-token"))
    return {f"{d.kind}/{d.name}": d.manifest for d in out}


def pod(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return objs[f"Deployment/demo-{pool}"]["spec"]["template"]["spec"]


def container(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return pod(objs, pool)["containers"][0]


def arg(objs: dict[str, dict[str, Any]], pool: str, flag: str) -> str:
    args = container(objs, pool)["args"]
    return str(args[args.index(flag) + 1])


def env(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objs, pool)["env"]}


def config(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return json.loads(objs["ConfigMap/demo-config"]["data"]["splitserve.json"])


# -- one check per spec field --------------------------------------------------------------


def _model_name() -> None:
    objs = objects({"model": {"name": "served-name"}})
    assert config(objs)["model"]["name"] == "served-name"
    assert arg(objs, "prefill", "--model") == "served-name"  # no source: the name is loaded


def _model_source() -> None:
    objs = objects({"model": {"name": "m", "source": "org/weights"}})
    for pool in ("prefill", "decode"):
        assert arg(objs, pool, "--model") == "org/weights"
    assert config(objs)["model"]["source"] == "org/weights"


def _model_dtype() -> None:
    objs = objects({"model": {"name": "m", "dtype": "bfloat16"}})
    assert arg(objs, "prefill", "--dtype") == arg(objs, "decode", "--dtype") == "bfloat16"


def _image() -> None:
    objs = objects({"image": "registry.example/splitserve:9"})
    assert {container(objs, p)["image"] for p in ("prefill", "decode", "router")} == {
        "registry.example/splitserve:9"
    }


def _image_pull_policy() -> None:
    assert "imagePullPolicy" not in container(objects(), "decode")
    objs = objects({"imagePullPolicy": "Always"})
    assert {container(objs, p)["imagePullPolicy"] for p in ("prefill", "decode", "router")} == {
        "Always"
    }


def _image_pull_secrets() -> None:
    objs = objects({"imagePullSecrets": [{"name": "regcred"}]})
    assert all(
        pod(objs, p)["imagePullSecrets"] == [{"name": "regcred"}]
        for p in ("prefill", "decode", "router")
    )


def _pool_check(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        if field == "replicas":
            objs = objects({pool: {"replicas": 3}})
            assert objs[f"Deployment/demo-{pool}"]["spec"]["replicas"] == 3
            others = [p for p in ("prefill", "decode", "router") if p != pool]
            assert all(objs[f"Deployment/demo-{p}"]["spec"]["replicas"] == 1 for p in others)
        elif field == "gpus":
            objs = objects({pool: {"gpus": 2}})
            res = container(objs, pool)["resources"]
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 2
            cpu = objects({pool: {"gpus": 0}})
            assert "nvidia.com/gpu" not in json.dumps(container(cpu, pool))
        elif field == "resources":
            objs = objects(
                {
                    pool: {
                        "gpus": 1,
                        "resources": {
                            "requests": {"cpu": "2", "memory": "8Gi"},
                            "limits": {"memory": "12Gi"},
                        },
                    }
                }
            )
            res = container(objs, pool)["resources"]
            assert res["requests"] == {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": 1}
            assert res["limits"] == {"memory": "12Gi", "nvidia.com/gpu": 1}
        elif field == "nodeSelector":
            objs = objects({pool: {"nodeSelector": {"gpu": "h100"}}})
            assert pod(objs, pool)["nodeSelector"] == {"gpu": "h100"}
            assert "nodeSelector" not in pod(objects(), pool)
        elif field == "tolerations":
            tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            objs = objects({pool: {"tolerations": tol}})
            assert pod(objs, pool)["tolerations"] == tol
        elif field == "affinity":
            aff = {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
                    ]
                }
            }
            objs = objects({pool: {"affinity": aff}})
            assert pod(objs, pool)["affinity"] == aff
        elif field == "env":
            objs = objects(
                {
                    pool: {
                        "env": [
                            {"name": "LOG", "value": "debug"},
                            {"name": "HOME", "value": "/scratch"},
                            {
                                "name": "TOKEN",
                                "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
                            },
                        ]
                    }
                }
            )
            values = env(objs, pool)
            assert values["LOG"] == "debug"
            assert values["HOME"] == "/scratch"  # the user's value replaces ours
            assert values["TOKEN"] == {"secretKeyRef": {"name": "s", "key": "k"}}
            names = [e["name"] for e in container(objs, pool)["env"]]
            assert len(names) == len(set(names))
        else:  # pragma: no cover
            raise AssertionError(field)

    return check


def _router_service_type() -> None:
    objs = objects({"router": {"serviceType": "LoadBalancer"}})
    assert objs["Service/demo-router"]["spec"]["type"] == "LoadBalancer"
    assert objects()["Service/demo-router"]["spec"]["type"] == "ClusterIP"


def _kv_backend() -> None:
    objs = objects({"kvTransfer": {"backend": "nixl"}})
    assert arg(objs, "prefill", "--kv-backend") == arg(objs, "decode", "--kv-backend") == "nixl"
    assert config(objs)["kvTransfer"]["backend"] == "nixl"


def _kv_lease() -> None:
    objs = objects({"kvTransfer": {"leaseSeconds": 12}})
    assert arg(objs, "decode", "--lease-seconds") == "12"


def _planner_only() -> None:
    """SLO and Prometheus settings are the planner's (it reads the spec): tuning them must
    not change (and so restart) any workload."""
    base = objects({"slo": {"ttftSeconds": 1, "tpotSeconds": 0.1}})
    tuned = objects(
        {
            "slo": {"ttftSeconds": 0.2, "tpotSeconds": 0.01, "percentile": 0.99},
            "autoscaling": {
                "enabled": False,
                "prometheusUrl": "http://other:9090",
                "intervalSeconds": 300,
            },
        }
    )
    assert base == tuned


def _autoscaling_enabled() -> None:
    spec = parse_spec(
        {
            **BASE,
            "decode": {"replicas": 3},
            "slo": {"ttftSeconds": 1, "tpotSeconds": 0.1},
            "autoscaling": {"enabled": True, "prometheusUrl": "http://p:9090"},
        }
    )
    # On: the planner's number (status.pools.decode.desiredReplicas), else the live one.
    assert plan_replicas(spec, Pool.DECODE, live=2, planned=5) == 5
    assert plan_replicas(spec, Pool.DECODE, live=2) == 2
    assert plan_replicas(spec, Pool.DECODE) == 3
    assert plan_replicas(spec, Pool.ROUTER, live=4, planned=9) == 1  # the router is not scaled
    off = parse_spec({**BASE, "decode": {"replicas": 3}})
    assert plan_replicas(off, Pool.DECODE, live=2, planned=5) == 3


def _bounds(pool: Pool, field: str) -> Callable[[], None]:
    def check() -> None:
        bounds = {"minReplicas": 2, "maxReplicas": 4}
        spec = parse_spec(
            {
                **BASE,
                "slo": {"ttftSeconds": 1, "tpotSeconds": 0.1},
                "autoscaling": {
                    "enabled": True,
                    "prometheusUrl": "http://p:9090",
                    pool.value: bounds,
                },
            }
        )
        if field == "minReplicas":
            assert plan_replicas(spec, pool, planned=0) == 2
        else:
            assert plan_replicas(spec, pool, planned=50) == 4
        assert plan_replicas(spec, pool, planned=3) == 3

    return check


def _network_policy_enabled() -> None:
    assert "NetworkPolicy/demo-workers" in objects()
    assert "NetworkPolicy/demo-workers" not in objects({"networkPolicy": {"enabled": False}})


def _network_policy_metrics_from() -> None:
    default = objects()["NetworkPolicy/demo-workers"]["spec"]["ingress"]
    assert default[2] == {
        "from": [{"namespaceSelector": {}}],
        "ports": [{"protocol": "TCP", "port": WORKER_METRICS_PORT}],
    }
    peers = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    custom = objects({"networkPolicy": {"metricsFrom": peers}})["NetworkPolicy/demo-workers"]
    assert custom["spec"]["ingress"][2]["from"] == peers
    closed = objects({"networkPolicy": {"metricsFrom": []}})["NetworkPolicy/demo-workers"]
    assert len(closed["spec"]["ingress"]) == 2


FIELD_CHECKS: dict[str, Callable[[], None]] = {
    "model.name": _model_name,
    "model.source": _model_source,
    "model.dtype": _model_dtype,
    "image": _image,
    "imagePullPolicy": _image_pull_policy,
    "imagePullSecrets": _image_pull_secrets,
    **{
        f"{pool}.{field}": _pool_check(pool, field)
        for pool in ("prefill", "decode", "router")
        for field in (
            "replicas",
            "gpus",
            "resources",
            "nodeSelector",
            "tolerations",
            "affinity",
            "env",
        )
    },
    "router.serviceType": _router_service_type,
    "kvTransfer.backend": _kv_backend,
    "kvTransfer.leaseSeconds": _kv_lease,
    "slo.ttftSeconds": _planner_only,
    "slo.tpotSeconds": _planner_only,
    "slo.percentile": _planner_only,
    "autoscaling.enabled": _autoscaling_enabled,
    "autoscaling.prometheusUrl": _planner_only,
    "autoscaling.intervalSeconds": _planner_only,
    **{
        f"autoscaling.{pool.value}.{field}": _bounds(pool, field)
        for pool in (Pool.PREFILL, Pool.DECODE)
        for field in ("minReplicas", "maxReplicas")
    },
    "networkPolicy.enabled": _network_policy_enabled,
    "networkPolicy.metricsFrom": _network_policy_metrics_from,
}


def _crd_spec_fields() -> set[str]:
    """Every field of the CRD's spec, down to the fields render treats as one value."""
    atomic = {
        "resources",
        "nodeSelector",
        "tolerations",
        "affinity",
        "env",
        "imagePullSecrets",
        "metricsFrom",
    }

    def walk(schema: dict[str, Any], prefix: str) -> set[str]:
        out: set[str] = set()
        for name, sub in (schema.get("properties") or {}).items():
            path = f"{prefix}{name}"
            if sub.get("type") == "object" and sub.get("properties") and name not in atomic:
                out |= walk(sub, path + ".")
            else:
                out.add(path)
        return out

    return walk(schema_of(load_crd())["properties"]["spec"], "")


def test_every_crd_spec_field_has_a_render_check() -> None:
    assert set(FIELD_CHECKS) == _crd_spec_fields()


@pytest.mark.parametrize("field", sorted(FIELD_CHECKS))
def test_field_effect(field: str) -> None:
    FIELD_CHECKS[field]()


# -- the objects as a whole ---------------------------------------------------------------


FULL: dict[str, Any] = {
    "model": {"name": "m", "source": "org/m", "dtype": "float16"},
    "image": "img:1",
    "imagePullPolicy": "IfNotPresent",
    "imagePullSecrets": [{"name": "regcred"}],
    "prefill": {
        "replicas": 2,
        "gpus": 1,
        "resources": {"requests": {"cpu": "4"}},
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                    ]
                }
            }
        },
        "env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    },
    "decode": {"replicas": 3, "gpus": 2},
    "router": {"replicas": 2, "serviceType": "NodePort", "resources": {"limits": {"memory": 1}}},
    "kvTransfer": {"backend": "nixl", "leaseSeconds": 45},
    "networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]},
}


@pytest.mark.parametrize("raw", [BASE, FULL], ids=["minimal", "full"])
def test_rendered_objects_pass_kubernetes_validate_strict(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw, name="demo")
    for desired in render(REF, spec, RenderInputs(replicas={p: 1 for p in Pool}, token="t")):
        kubernetes_validate.validate(desired.manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("raw", [BASE, FULL], ids=["minimal", "full"])
def test_every_pod_meets_the_restricted_profile(raw: dict[str, Any]) -> None:
    objs = objects(raw)
    for pool in ("prefill", "decode", "router"):
        assert restricted_violations(pod(objs, pool)) == [], pool


def test_names_labels_and_owner_references() -> None:
    objs = objects()
    assert sorted(objs) == sorted(
        [
            "ConfigMap/demo-config",
            "Secret/demo-worker-token",
            "ServiceAccount/demo-router",
            "RoleBinding/demo-router",
            "NetworkPolicy/demo-workers",
            "Service/demo-prefill",
            "Service/demo-decode",
            "Service/demo-router",
            "Deployment/demo-prefill",
            "Deployment/demo-decode",
            "Deployment/demo-router",
        ]
    )
    for manifest in objs.values():
        meta = manifest["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"]["app.kubernetes.io/instance"] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "splitserve-operator"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "splitserve.io/v1alpha1",
                "kind": "InferenceService",
                "name": "demo",
                "uid": "0000-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    for pool in ("prefill", "decode", "router"):
        deployment = objs[f"Deployment/demo-{pool}"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector == {
            "app.kubernetes.io/instance": "demo",
            "app.kubernetes.io/component": pool,
        }
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert objs[f"Service/demo-{pool}"]["spec"]["selector"] == selector


def test_command_lines() -> None:
    objs = objects(
        {
            "model": {"name": "served", "source": "org/weights"},
            "kvTransfer": {"backend": "grpc", "leaseSeconds": 30},
        }
    )
    assert container(objs, "prefill")["command"] == ["splitserve"]
    assert container(objs, "prefill")["args"] == [
        "worker",
        "--role",
        "prefill",
        "--model",
        "org/weights",
        "--dtype",
        "auto",
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_GRPC_PORT),
        "--advertise-address",
        f"$(POD_IP):{WORKER_GRPC_PORT}",
        "--kv-backend",
        "grpc",
        "--lease-seconds",
        "30",
        "--token-file",
        TOKEN_FILE,
        "--metrics-port",
        str(WORKER_METRICS_PORT),
    ]
    assert arg(objs, "decode", "--role") == "decode"
    assert container(objs, "router")["args"] == [
        "router",
        "--model",
        "org/weights",
        "--served-model-name",
        "served",
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_HTTP_PORT),
        "--discovery",
        "kubernetes",
        "--namespace",
        "team-a",
        "--selector",
        "app.kubernetes.io/instance=demo",
        "--role-label",
        "splitserve.io/role",
        "--kv-backend",
        "grpc",
        "--token-file",
        TOKEN_FILE,
    ]
    assert env(objs, "decode")["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_worker_pods_carry_the_role_label_the_router_discovers_them_by() -> None:
    objs = objects()
    for pool in ("prefill", "decode"):
        labels = objs[f"Deployment/demo-{pool}"]["spec"]["template"]["metadata"]["labels"]
        assert labels["splitserve.io/role"] == pool
        ports = {p["name"]: p["containerPort"] for p in container(objs, pool)["ports"]}
        assert ports["grpc"] == WORKER_GRPC_PORT
    router = objs["Deployment/demo-router"]["spec"]["template"]["metadata"]["labels"]
    assert "splitserve.io/role" not in router


def test_the_worker_and_router_commands_accept_the_rendered_arguments() -> None:
    """The one place to align with the worker package: its own parsers read our args."""
    from splitserve_worker.cli import build_parser

    parser = build_parser()
    objs = objects({"kvTransfer": {"backend": "nixl", "leaseSeconds": 12}})
    for pool in ("prefill", "decode", "router"):
        args = container(objs, pool)["args"]
        parsed = parser.parse_args(args)
        assert parsed.command == args[0]
        assert parsed.token_file == TOKEN_FILE and parsed.kv_backend == "nixl"
        assert parsed.host == "0.0.0.0"
    worker = parser.parse_args(container(objs, "decode")["args"])
    assert (worker.role, worker.port, worker.lease_seconds, worker.metrics_port) == (
        "decode",
        WORKER_GRPC_PORT,
        12,
        WORKER_METRICS_PORT,
    )
    router = parser.parse_args(container(objs, "router")["args"])
    assert (router.discovery, router.namespace, router.port) == (
        "kubernetes",
        "team-a",
        ROUTER_HTTP_PORT,
    )


def test_the_token_is_a_mounted_file_and_created_once() -> None:
    spec = parse_spec(BASE, name="demo")
    desired = render(REF, spec, RenderInputs(replicas={p: 1 for p in Pool}, token="abc"))
    secret = next(d for d in desired if d.kind == "Secret")
    assert isinstance(secret, Desired) and secret.create_only
    assert secret.manifest["stringData"] == {"token": "abc"}
    assert all(not d.create_only for d in desired if d.kind != "Secret")
    objs = objects()
    for pool in ("prefill", "decode", "router"):
        mounts = {m["name"]: m for m in container(objs, pool)["volumeMounts"]}
        assert mounts["token"]["readOnly"] is True
        volume = next(v for v in pod(objs, pool)["volumes"] if v["name"] == "token")
        assert volume["secret"]["secretName"] == "demo-worker-token"
        assert volume["secret"]["defaultMode"] == 0o440
        assert "secret-token" not in json.dumps(objs[f"Deployment/demo-{pool}"])


def test_only_the_router_talks_to_the_api() -> None:
    objs = objects()
    assert pod(objs, "router")["serviceAccountName"] == "demo-router"
    assert pod(objs, "router")["automountServiceAccountToken"] is True
    for pool in ("prefill", "decode"):
        assert pod(objs, pool)["automountServiceAccountToken"] is False
    binding = objs["RoleBinding/demo-router"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "splitserve-router",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-router", "namespace": "team-a"}
    ]


def test_network_policy_admits_only_the_router_and_peer_workers() -> None:
    policy = objects()["NetworkPolicy/demo-workers"]["spec"]
    workers = {
        "matchLabels": {"app.kubernetes.io/instance": "demo"},
        "matchExpressions": [
            {
                "key": "app.kubernetes.io/component",
                "operator": "In",
                "values": ["prefill", "decode"],
            }
        ],
    }
    assert policy["podSelector"] == workers and policy["policyTypes"] == ["Ingress"]
    router_rule, peer_rule = policy["ingress"][:2]
    assert router_rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["router"]
    assert router_rule["ports"] == [{"protocol": "TCP", "port": WORKER_GRPC_PORT}]
    assert peer_rule == {"from": [{"podSelector": workers}]}  # NIXL/UCX picks its own ports
    for rule in policy["ingress"]:
        assert rule.get("from"), "every rule names who may connect"


def test_a_config_change_rolls_the_pods_and_a_replica_change_does_not() -> None:
    def pod_hash(objs: dict[str, dict[str, Any]]) -> str:
        meta = objs["Deployment/demo-decode"]["spec"]["template"]["metadata"]
        return str(meta["annotations"]["splitserve.io/config-hash"])

    base = pod_hash(objects())
    assert pod_hash(objects({"kvTransfer": {"backend": "nixl"}})) != base
    assert pod_hash(objects({"decode": {"replicas": 5}})) == base


def test_render_is_deterministic() -> None:
    assert objects(FULL) == objects(FULL)


def test_render_deployment_is_the_same_deployment_render_makes() -> None:
    from splitserve_operator.render import render_deployment

    spec = parse_spec(FULL, name="demo")
    inputs = RenderInputs(replicas={Pool.PREFILL: 2, Pool.DECODE: 3, Pool.ROUTER: 1}, token="t")
    everything = {d.name: d.manifest for d in render(REF, spec, inputs) if d.kind == "Deployment"}
    for pool in Pool:
        assert render_deployment(REF, spec, inputs, pool) == everything[f"demo-{pool.value}"]
