"""Render: every spec field of the CRD has a check of its effect on the desired objects."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from crd_validation import load_crd, schema_of
from render_helpers import BASE, arg, config, container, env, existing_only, objects, pod
from render_settings import (
    ENGINE_SETTINGS,
    ROUTER_SECTIONS,
    ROUTER_SETTINGS,
    engine_setting,
    router_config,
    router_section,
    router_setting,
)
from splitserve_operator.api.parse import parse_spec
from splitserve_operator.api.values import Pool
from splitserve_operator.render.commands import (
    WORKER_METRICS_PORT,
)
from splitserve_operator.render.replicas import deployment_replicas, pool_target, seed_replicas

pytestmark = pytest.mark.unit


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
    assert "model" not in [v["name"] for v in pod(objs, "decode")["volumes"]]
    # a folder on a claim: mounted read-only in every pod, loaded from where it is mounted
    objs = objects({"model": {"name": "m", "source": "pvc://weights/llama/8b"}})
    for pool in ("prefill", "decode", "router"):
        assert arg(objs, pool, "--model") == "/models/llama/8b"
        volumes = {v["name"]: v for v in pod(objs, pool)["volumes"]}
        claim = {"claimName": "weights", "readOnly": True}
        assert volumes["model"]["persistentVolumeClaim"] == claim
        mount = {"name": "model", "mountPath": "/models", "readOnly": True}
        assert mount in container(objs, pool)["volumeMounts"]


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
        elif field in ("priorityClassName", "runtimeClassName"):
            objs = objects({pool: {field: "serving.high"}})
            assert pod(objs, pool)[field] == "serving.high"
            others = [p for p in ("prefill", "decode", "router") if p != pool]
            assert all(field not in pod(objs, p) for p in others)
        elif field == "podAnnotations":
            mine = {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"}
            objs = objects({pool: {"podAnnotations": mine}})
            got = objs[f"Deployment/demo-{pool}"]["spec"]["template"]["metadata"]["annotations"]
            assert got["sidecar.istio.io/inject"] == "false"
            assert "splitserve.io/config-hash" in got
            if pool != "router":  # the operator's scrape hints are not overridden
                assert got["prometheus.io/port"] == str(WORKER_METRICS_PORT)
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
    # the router asks that lease in its Reserve calls (a lease it names wins the worker's)
    assert router_config(objs)[1].timeouts.lease_s == 12


def _kv_checksums() -> None:
    objs = objects({"kvTransfer": {"checksums": True}})
    for pool in ("prefill", "decode"):
        assert "--checksums" in container(objs, pool)["args"]
        assert "--checksums" not in container(objects(), pool)["args"]


def _kv_streams() -> None:
    from splitserve_operator.api.values import MAX_KV_STREAMS
    from splitserve_worker.kv.transport import MAX_STREAMS

    assert MAX_KV_STREAMS == MAX_STREAMS
    objs = objects({"kvTransfer": {"streams": 4}})
    assert arg(objs, "prefill", "--kv-streams") == "4"
    assert "--kv-streams" not in container(objects(), "prefill")["args"]  # by the pod's cores


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
    # On: the pool's target (its WorkerPool's spec.replicas) clamped to the bounds; a new
    # pool starts at spec.decode.replicas.
    assert deployment_replicas(spec, Pool.DECODE, 5) == 5
    assert deployment_replicas(spec, Pool.DECODE, 50) == 8  # maxReplicas' default
    assert deployment_replicas(spec, Pool.DECODE, None) == 3
    assert deployment_replicas(spec, Pool.ROUTER, 9) == 1  # the router is not scaled
    # ...and the planner owns the pool's size: a spec edit does not reach an existing pool.
    held = pool_target(spec, Pool.DECODE, exists=True, live=5, recorded=2, ours=False)
    assert (held.replicas, held.target) == (None, 5)
    off = parse_spec({**BASE, "decode": {"replicas": 3}})
    assert deployment_replicas(off, Pool.DECODE, 50) == 50  # off: no bounds
    edited = pool_target(off, Pool.DECODE, exists=True, live=5, recorded=2, ours=False)
    assert (edited.replicas, edited.target) == (3, 3)  # off: a spec edit is a new request


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
            assert deployment_replicas(spec, pool, 0) == 2
            assert seed_replicas(spec, pool) == 2  # spec's 1, raised to the minimum
        else:
            assert deployment_replicas(spec, pool, 50) == 4
        assert deployment_replicas(spec, pool, 3) == 3

    return check


def _network_policy_enabled() -> None:
    assert "NetworkPolicy/demo-workers" in objects()
    assert "NetworkPolicy/demo-workers" not in objects({"networkPolicy": {"enabled": False}})
    # turned off after it was made, the policy is opened to everyone, not left closed
    (opened,) = existing_only({"networkPolicy": {"enabled": False}}).values()
    assert opened["metadata"]["name"] == "demo-workers" and opened["spec"]["ingress"] == [{}]
    assert existing_only() == {}


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
            "priorityClassName",
            "runtimeClassName",
            "podAnnotations",
        )
    },
    **{
        f"{pool}.engine.{field}": engine_setting(pool, field)
        for pool in ("prefill", "decode")
        for field in ENGINE_SETTINGS
    },
    "router.serviceType": _router_service_type,
    **{f"router.settings.{field}": router_setting(field) for field in ROUTER_SETTINGS},
    **{
        f"router.settings.{section}.{field}": router_section(section, field)
        for section, fields in ROUTER_SECTIONS.items()
        for field in fields
    },
    "kvTransfer.backend": _kv_backend,
    "kvTransfer.leaseSeconds": _kv_lease,
    "kvTransfer.checksums": _kv_checksums,
    "kvTransfer.streams": _kv_streams,
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
