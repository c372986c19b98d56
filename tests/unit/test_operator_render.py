"""Render: every spec field of the CRD has a check of its effect on the desired objects."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from crd_validation import load_crd, schema_of
from render_helpers import BASE, arg, config, container, env, existing_only, objects, pod
from render_settings import (
    DEPRECATED_SECTION_FIELDS,
    ENGINE_SETTINGS,
    ROUTER_SECTIONS,
    ROUTER_SETTINGS,
    engine_setting,
    router_config,
    router_section,
    router_setting,
)
from splitserve_operator.api.durations import format_duration
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.values import Pool
from splitserve_operator.render.commands import (
    WORKER_METRICS_PORT,
)
from splitserve_operator.render.replicas import deployment_replicas, pool_target, seed_replicas
from splitserve_operator.render.security import restricted_violations

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


def _one_rank(pool: str) -> dict[str, int]:
    """A decode pool of several GPUs at one rank (its other GPUs idle)."""
    return {"tensorParallelSize": 1} if pool == "decode" else {}


def _pool_check(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        if field == "replicas":
            objs = objects({pool: {"replicas": 3}})
            assert objs[f"Deployment/demo-{pool}"]["spec"]["replicas"] == 3
            others = [p for p in ("prefill", "decode", "router") if p != pool]
            assert all(objs[f"Deployment/demo-{p}"]["spec"]["replicas"] == 1 for p in others)
        elif field == "gpus":
            objs = objects({pool: {"gpus": 2, **_one_rank(pool)}})
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
        elif field == "acceleratorResource":
            objs = objects(
                {pool: {"gpus": 2, "acceleratorResource": "amd.com/gpu", **_one_rank(pool)}}
            )
            res = container(objs, pool)["resources"]
            assert res["requests"] == res["limits"] == {"amd.com/gpu": 2}
            assert "nvidia.com/gpu" not in json.dumps(objs[f"Deployment/demo-{pool}"])
        elif field == "podAnnotations":  # deprecated: read as podTemplate.annotations
            mine = {"sidecar.istio.io/inject": "false"}
            assert objects({pool: {"podAnnotations": mine}}) == objects(
                {pool: {"podTemplate": {"annotations": mine}}}
            )
        else:  # pragma: no cover
            raise AssertionError(field)

    return check


def _template(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return dict(objs[f"Deployment/demo-{pool}"]["spec"]["template"])


def _others_unchanged(objs: dict[str, dict[str, Any]], pool: str) -> None:
    base = objects()
    for other in ("prefill", "decode", "router"):
        if other != pool:
            assert objs[f"Deployment/demo-{other}"] == base[f"Deployment/demo-{other}"], other


def _overlay_check(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        if field == "labels":
            objs = objects({pool: {"podTemplate": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}}})
            labels = _template(objs, pool)["metadata"]["labels"]
            assert labels["kueue.x-k8s.io/queue-name"] == "q"
            assert labels["app.kubernetes.io/instance"] == "demo"  # ours stay
            selector = objs[f"Deployment/demo-{pool}"]["spec"]["selector"]["matchLabels"]
            assert "kueue.x-k8s.io/queue-name" not in selector  # the selector never changes
        elif field == "annotations":
            mine: dict[str, Any] = {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"}
            objs = objects({pool: {"podTemplate": {"annotations": mine}}})
            got = _template(objs, pool)["metadata"]["annotations"]
            assert got["sidecar.istio.io/inject"] == "false"
            assert "splitserve.io/config-hash" in got
            if pool != "router":  # the operator's scrape hints are not overridden
                assert got["prometheus.io/port"] == str(WORKER_METRICS_PORT)
        elif field == "serviceAccountName":
            objs = objects({pool: {"podTemplate": {"serviceAccountName": "model-reader"}}})
            assert pod(objs, pool)["serviceAccountName"] == "model-reader"
            assert pod(objs, pool)["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in pod(objects(), pool)
        elif field == "schedulerName":
            objs = objects({pool: {"podTemplate": {"schedulerName": "volcano"}}})
            assert pod(objs, pool)["schedulerName"] == "volcano"
        elif field == "topologySpreadConstraints":
            zone: dict[str, Any] = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                    "whenUnsatisfiable": "DoNotSchedule"}  # fmt: skip
            mine = {**zone, "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app": "x"}}}  # fmt: skip
            objs = objects({pool: {"podTemplate": {"topologySpreadConstraints": [zone, mine]}}})
            spread = pod(objs, pool)["topologySpreadConstraints"]
            own = {"app.kubernetes.io/instance": "demo", "app.kubernetes.io/component": pool}
            assert spread == [{**zone, "labelSelector": {"matchLabels": own}}, mine]
        elif field == "volumes":
            volume = {"name": "ca", "configMap": {"name": "corp-ca"}}
            objs = objects({pool: {"podTemplate": {"volumes": [volume]}}})
            volumes = pod(objs, pool)["volumes"]
            assert (
                volumes[-1] == volume and len(volumes) == len(pod(objects(), pool)["volumes"]) + 1
            )
        elif field == "volumeMounts":
            overlay: dict[str, Any] = {
                "volumes": [{"name": "ca", "secret": {"secretName": "corp-ca"}}],
                "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
            }
            objs = objects({pool: {"podTemplate": overlay}})
            assert container(objs, pool)["volumeMounts"][-1] == overlay["volumeMounts"][0]
        elif field == "resourceClaims":
            claims = [{"name": "gpu", "resourceClaimTemplateName": "one-h100"},
                      {"name": "nic", "resourceClaimName": "shared-nic"}]  # fmt: skip
            objs = objects({pool: {"gpus": 0, "podTemplate": {"resourceClaims": claims}}})
            assert pod(objs, pool)["resourceClaims"] == claims
            assert container(objs, pool)["resources"]["claims"] == [
                {"name": "gpu"},
                {"name": "nic"},
            ]
        else:  # pragma: no cover
            raise AssertionError(field)
        _others_unchanged(objs, pool)

    return check


def _router_account() -> None:
    """Refused on the router: it runs as the account the operator binds to discovery."""

    with pytest.raises(SpecError, match="prefill and decode pools only"):
        parse_spec({**BASE, "router": {"podTemplate": {"serviceAccountName": "x"}}})
    assert pod(objects(), "router")["serviceAccountName"] == "demo-router"


def _rollout_check(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        deployment = f"Deployment/demo-{pool}"
        if field == "progressDeadline":
            objs = objects({pool: {"rollout": {"progressDeadline": "1h30m"}}})
            assert objs[deployment]["spec"]["progressDeadlineSeconds"] == 5400
        else:
            value = {"maxSurge": 2, "maxUnavailable": "50%"}[field]
            objs = objects({pool: {"rollout": {field: value}}})
            rolling = objs[deployment]["spec"]["strategy"]["rollingUpdate"]
            assert rolling[field] == value
            other = "maxUnavailable" if field == "maxSurge" else "maxSurge"
            default = objects()[deployment]["spec"]["strategy"]["rollingUpdate"]
            assert rolling[other] == default[other]  # the other keeps the pool's default
        _others_unchanged(objs, pool)

    return check


def _rdma_check(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        rdma: dict[str, Any] = {"resource": "rdma/hca"}
        if field == "resource":
            objs = objects({pool: {"rdma": rdma}})
            res = container(objs, pool)["resources"]
            assert res["requests"]["rdma/hca"] == res["limits"]["rdma/hca"] == 1
            assert res["limits"]["nvidia.com/gpu"] == 1  # beside the GPU
        elif field == "count":
            objs = objects({pool: {"rdma": {**rdma, "count": 4}}})
            assert container(objs, pool)["resources"]["limits"]["rdma/hca"] == 4
        else:
            objs = objects({pool: {"rdma": rdma}})
            caps = container(objs, pool)["securityContext"]["capabilities"]
            assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
            # the one way the pool leaves the restricted profile, and it says so
            assert restricted_violations(pod(objs, pool)) == [
                f"{pool}: capabilities may only add NET_BIND_SERVICE"
            ]
            off = objects({pool: {"rdma": {**rdma, "ipcLock": False}}})
            assert container(off, pool)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        _others_unchanged(objs, pool)

    return check


def _model_cache() -> None:
    objs = objects({"model": {"name": "org/m", "cache": {"claimName": "models"}}})
    for pool in ("prefill", "decode", "router"):
        volumes = {v["name"]: v for v in pod(objs, pool)["volumes"]}
        assert volumes["cache"] == {
            "name": "cache",
            "persistentVolumeClaim": {"claimName": "models"},
        }
    for pool in ("prefill", "decode"):
        (fetch,) = pod(objs, pool)["initContainers"]
        worker = container(objs, pool)
        assert fetch["args"] == ["model", "org/m"] and fetch["image"] == worker["image"]
        assert {"name": "cache", "mountPath": "/cache"} in fetch["volumeMounts"]
        assert fetch["env"] == worker["env"]  # HF_TOKEN and HF_HOME as the worker has them
        assert "resources" not in fetch  # no GPU held by the download
    assert "initContainers" not in pod(objs, "router")  # the router reads the tokenizer only
    assert "initContainers" not in pod(objects(), "decode")
    # the fetch runs what the worker image's own CLI takes
    import argparse

    from splitserve_worker.commands import model as model_cmd

    parser = argparse.ArgumentParser()
    model_cmd.add_arguments(parser)
    assert parser.parse_args(pod(objs, "decode")["initContainers"][0]["args"][1:]).name == "org/m"


def _decode_tensor_parallel() -> None:
    """A decode pool over several ranks renders them (over every KV backend), and
    ``tensorParallelSize: 1`` on a pod of four GPUs renders one rank."""
    tp2 = {"gpus": 4, "tensorParallelSize": 2}
    for backend in ("grpc", "nixl"):
        over = objects({"decode": tp2, "kvTransfer": {"backend": backend}})
        assert arg(over, "decode", "--tensor-parallel-size") == "2"
        assert arg(over, "decode", "--kv-backend") == backend
    two = objects({"decode": tp2})
    assert arg(two, "decode", "--tensor-parallel-size") == "2"
    assert "dshm" in {v["name"] for v in pod(two, "decode")["volumes"]}
    one = objects({"decode": {"gpus": 4, "tensorParallelSize": 1}})
    assert arg(one, "decode", "--tensor-parallel-size") == "1"
    assert "dshm" not in {v["name"] for v in pod(one, "decode")["volumes"]}
    assert arg(one, "prefill", "--tensor-parallel-size") == "1"  # gpus 1 by default


def _tensor_parallel(pool: str) -> Callable[[], None]:
    def check() -> None:
        objs = objects({pool: {"gpus": 4, "tensorParallelSize": 2}})
        assert arg(objs, pool, "--tensor-parallel-size") == "2"
        volumes = {v["name"]: v for v in pod(objs, pool)["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
        one = objects({pool: {"gpus": 4, "tensorParallelSize": 1}})
        assert arg(one, pool, "--tensor-parallel-size") == "1"
        assert "dshm" not in {v["name"] for v in pod(one, pool)["volumes"]}
        other = "decode" if pool == "prefill" else "prefill"
        assert arg(objs, other, "--tensor-parallel-size") == "1"  # gpus 1 by default

    return check


def _model_download_size_limit() -> None:
    objs = objects({"model": {"name": "m", "downloadSizeLimit": "200Gi"}})
    for pool in ("prefill", "decode", "router"):
        volumes = {v["name"]: v for v in pod(objs, pool)["volumes"]}
        assert volumes["cache"]["emptyDir"] == {"sizeLimit": "200Gi"}
        assert {v["name"]: v for v in pod(objects(), pool)["volumes"]}["cache"]["emptyDir"] == {}


def _pod_ids(field: str) -> Callable[[], None]:
    def check() -> None:
        value: Any = {"fsGroupChangePolicy": "OnRootMismatch", "supplementalGroups": [5, 6]}.get(
            field, 1000680000
        )
        objs = objects({"podSecurityContext": {field: value}})
        for pool in ("prefill", "decode", "router"):
            context = pod(objs, pool)["securityContext"]
            assert context[field] == value and context["runAsNonRoot"] is True
            assert field not in pod(objects(), pool)["securityContext"]
            assert restricted_violations(pod(objs, pool)) == []

    return check


def _http_route(field: str) -> Callable[[], None]:
    def check() -> None:
        route: dict[str, Any] = {"parentRefs": [{"name": "public", "namespace": "gateways"}]}
        if field == "hostnames":
            route["hostnames"] = ["llm.example.com"]
        if field == "requestTimeout":
            route["requestTimeout"] = "10m"
        objs = objects({"router": {"httpRoute": route}})
        made = objs["HTTPRoute/demo-router"]
        assert made["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert made["metadata"]["ownerReferences"][0]["uid"] == "0000-uid"
        spec = made["spec"]
        (rule,) = spec["rules"]
        assert rule["backendRefs"] == [{"name": "demo-router", "port": 8000}]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
        if field == "parentRefs":
            assert spec["parentRefs"] == route["parentRefs"] and "hostnames" not in spec
            # without one, none; one made before is detached from every Gateway
            assert "HTTPRoute/demo-router" not in objects()
            (detached,) = [d for n, d in existing_only().items() if n == "HTTPRoute/demo-router"]
            assert detached["spec"]["parentRefs"] == []
        elif field == "hostnames":
            assert spec["hostnames"] == ["llm.example.com"]
        else:
            assert rule["timeouts"] == {"request": "10m"}
        # the router itself does not change
        assert objs["Deployment/demo-router"] == objects()["Deployment/demo-router"]

    return check


def _deprecated(old: dict[str, Any], new: dict[str, Any]) -> Callable[[], None]:
    """A deprecated field is read as its new form: the same objects, and the spec parses
    to the same model (the planner reads the SLO and interval from it)."""

    def check() -> None:
        assert objects(old) == objects(new)
        assert parse_spec({**BASE, **old}) == parse_spec({**BASE, **new})

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
    objs = objects({"kvTransfer": {"lease": "12s"}})
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


TLS = {"tls": {"secretName": "demo-tls"}}


def _parsed(objs: Any, pool: str) -> Any:
    """The pod's arguments read by the real ``splitserve worker`` / ``router`` parser."""
    import argparse

    from splitserve_worker.commands import router, worker

    parser = argparse.ArgumentParser()
    (router if pool == "router" else worker).add_arguments(parser)
    return parser.parse_args(container(objs, pool)["args"][1:])


def _tls_secret_name() -> None:
    from splitserve_operator.render.commands import TLS_DIR

    objs = objects(TLS)
    for pool in ("prefill", "decode", "router"):
        (volume,) = [v for v in pod(objs, pool)["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "demo-tls"
        assert [i["key"] for i in volume["secret"]["items"]] == ["tls.crt", "tls.key", "ca.crt"]
        mount = {m["name"]: m for m in container(objs, pool)["volumeMounts"]}["tls"]
        assert mount == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
        args = _parsed(objs, pool)
        files = (args.tls_cert, args.tls_key, args.tls_ca)
        assert files == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
        plain = _parsed(objects(), pool)
        assert (plain.tls_cert, plain.tls_ca) == (None, None)
        assert "tls" not in {v["name"] for v in pod(objects(), pool)["volumes"]}


def _tls_mutual() -> None:
    for pool in ("prefill", "decode"):
        assert _parsed(objects(TLS), pool).tls_mutual  # on by default
        off = objects({"tls": {"secretName": "demo-tls", "mutual": False}})
        assert not _parsed(off, pool).tls_mutual
        assert _parsed(off, pool).tls_ca is not None  # still TLS, one way
    assert not hasattr(_parsed(objects(TLS), "router"), "tls_mutual")  # a worker setting


def _tls_server_name() -> None:
    for pool in ("prefill", "decode", "router"):
        assert _parsed(objects(TLS), pool).tls_server_name == "splitserve-worker"
        named = objects({"tls": {"secretName": "demo-tls", "serverName": "w.demo.svc"}})
        assert _parsed(named, pool).tls_server_name == "w.demo.svc"


def _planner_only() -> None:
    """SLO and Prometheus settings are the planner's (it reads the spec): tuning them must
    not change (and so restart) any workload."""
    base = objects({"slo": {"ttft": "1s", "tpot": "100ms"}})
    tuned = objects(
        {
            "slo": {"ttft": "200ms", "tpot": "10ms", "percentile": 99},
            "autoscaling": {
                "enabled": False,
                "prometheusUrl": "http://other:9090",
                "interval": "5m",
            },
        }
    )
    assert base == tuned
    spec = parse_spec(
        {**BASE, "slo": {"ttft": "200ms", "percentile": 99}, "autoscaling": {"interval": "5m"}}
    )
    assert (spec.slo.ttft, spec.slo.quantile, spec.autoscaling.interval) == (0.2, 0.99, 300)


def _autoscaling_enabled() -> None:
    spec = parse_spec(
        {
            **BASE,
            "decode": {"replicas": 3},
            "slo": {"ttft": "1s", "tpot": "100ms"},
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
                "slo": {"ttft": "1s", "tpot": "100ms"},
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
    opened = existing_only({"networkPolicy": {"enabled": False}})["NetworkPolicy/demo-workers"]
    assert opened["metadata"]["name"] == "demo-workers" and opened["spec"]["ingress"] == [{}]
    assert "NetworkPolicy/demo-workers" not in existing_only()


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
    "model.cache.claimName": _model_cache,
    "model.downloadSizeLimit": _model_download_size_limit,
    **{
        f"podSecurityContext.{field}": _pod_ids(field)
        for field in (
            "runAsUser",
            "runAsGroup",
            "fsGroup",
            "fsGroupChangePolicy",
            "supplementalGroups",
        )
    },
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
            "acceleratorResource",
        )
    },
    **{
        f"{pool}.podTemplate.{field}": _overlay_check(pool, field)
        for pool in ("prefill", "decode", "router")
        for field in (
            "labels",
            "annotations",
            "serviceAccountName",
            "schedulerName",
            "topologySpreadConstraints",
            "volumes",
            "volumeMounts",
            "resourceClaims",
        )
        if (pool, field) != ("router", "serviceAccountName")
    },
    "router.podTemplate.serviceAccountName": _router_account,
    **{
        f"{pool}.rollout.{field}": _rollout_check(pool, field)
        for pool in ("prefill", "decode", "router")
        for field in ("maxSurge", "maxUnavailable", "progressDeadline")
    },
    **{
        f"{pool}.rdma.{field}": _rdma_check(pool, field)
        for pool in ("prefill", "decode")
        for field in ("resource", "count", "ipcLock")
    },
    "prefill.tensorParallelSize": _tensor_parallel("prefill"),
    "decode.tensorParallelSize": _decode_tensor_parallel,
    **{
        f"{pool}.engine.gpuMemoryFraction": _deprecated(
            {pool: {"engine": {"gpuMemoryFraction": 0.85}}},
            {pool: {"engine": {"gpuMemoryPercent": 85}}},
        )
        for pool in ("prefill", "decode")
    },
    **{
        f"router.httpRoute.{field}": _http_route(field)
        for field in ("parentRefs", "hostnames", "requestTimeout")
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
    **{
        f"router.settings.{section}.{field}": _deprecated(
            {"router": {"settings": {section: {field: value}}}},
            {"router": {"settings": {section: {new: format_duration(value)}}}},
        )
        for section, fields in DEPRECATED_SECTION_FIELDS.items()
        for field, (value, new) in fields.items()
    },
    "kvTransfer.backend": _kv_backend,
    "kvTransfer.lease": _kv_lease,
    "kvTransfer.leaseSeconds": _deprecated(
        {"kvTransfer": {"leaseSeconds": 12}}, {"kvTransfer": {"lease": "12s"}}
    ),
    "kvTransfer.checksums": _kv_checksums,
    "kvTransfer.streams": _kv_streams,
    "tls.secretName": _tls_secret_name,
    "tls.mutual": _tls_mutual,
    "tls.serverName": _tls_server_name,
    "slo.ttft": _planner_only,
    "slo.tpot": _planner_only,
    "slo.percentile": _planner_only,
    "slo.ttftSeconds": _deprecated({"slo": {"ttftSeconds": 0.2}}, {"slo": {"ttft": "200ms"}}),
    "slo.tpotSeconds": _deprecated({"slo": {"tpotSeconds": 0.01}}, {"slo": {"tpot": "10ms"}}),
    "autoscaling.enabled": _autoscaling_enabled,
    "autoscaling.prometheusUrl": _planner_only,
    "autoscaling.interval": _planner_only,
    "autoscaling.intervalSeconds": _deprecated(
        {"autoscaling": {"intervalSeconds": 300}}, {"autoscaling": {"interval": "5m"}}
    ),
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
    """``flex`` has the decode pool's fields, and render gives them the same effect (its
    own check: ``test_operator_render_flex``)."""
    fields = _crd_spec_fields()
    flex = {f.removeprefix("flex.") for f in fields if f.startswith("flex.")}
    assert flex == {f.removeprefix("decode.") for f in fields if f.startswith("decode.")}
    assert set(FIELD_CHECKS) == {f for f in fields if not f.startswith("flex.")}


@pytest.mark.parametrize("field", sorted(FIELD_CHECKS))
def test_field_effect(field: str) -> None:
    FIELD_CHECKS[field]()
