"""Render: the desired objects as a whole: valid for Kubernetes (kubernetes-validate
--strict), "restricted" pods, names, labels, commands, the token, network policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifest_validation import manifest_problems
from render_helpers import (
    BASE,
    REF,
    arg,
    container,
    env,
    objects,
    parseable,
    pod,
    takes_tensor_parallel,
)
from splitserve_operator.api.parse import parse_spec
from splitserve_operator.api.values import Pool
from splitserve_operator.render.commands import (
    ROUTER_HTTP_PORT,
    TOKEN_FILE,
    WORKER_GRPC_PORT,
    WORKER_KV_PORT,
    WORKER_METRICS_PORT,
)
from splitserve_operator.render.manifests import Desired, RenderInputs, render
from splitserve_operator.render.security import restricted_violations

pytestmark = pytest.mark.unit


# -- the objects as a whole ---------------------------------------------------------------


FULL: dict[str, Any] = {
    "model": {"name": "m", "source": "org/m", "dtype": "float16"},
    "image": "img:1",
    "imagePullPolicy": "IfNotPresent",
    "tls": {"secretName": "demo-tls", "serverName": "workers.demo.svc"},
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
    "decode": {
        "replicas": 3,
        "gpus": 2,
        "tensorParallelSize": 1,  # one rank on a pod of several GPUs
        "acceleratorResource": "amd.com/gpu",
        "podTemplate": {
            "labels": {"kueue.x-k8s.io/queue-name": "inference"},
            "annotations": {"sidecar.istio.io/inject": "false"},
            "serviceAccountName": "model-reader",
            "schedulerName": "volcano",
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                }
            ],
            "volumes": [
                {"name": "ca", "configMap": {"name": "corp-ca"}},
                {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "10Gi"}}}}}},
            ],
            "volumeMounts": [
                {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True},
                {"name": "scratch", "mountPath": "/scratch"},
            ],
            "resourceClaims": [{"name": "nic", "resourceClaimTemplateName": "rdma-nic"}],
        },
        "rollout": {"maxUnavailable": "50%", "progressDeadline": "1h"},
        "engine": {"gpuMemoryPercent": 80},
    },
    "router": {
        "replicas": 2,
        "serviceType": "NodePort",
        "resources": {"limits": {"memory": 1}},
        "httpRoute": {
            "parentRefs": [{"name": "public", "namespace": "gateways"}],
            "hostnames": ["llm.example.com"],
            "requestTimeout": "10m",
        },
        "rollout": {"maxSurge": 1},
    },
    "kvTransfer": {"backend": "nixl", "lease": "45s"},
    "podSecurityContext": {"runAsUser": 1000680000, "fsGroup": 1000680000},
    "networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]},
}  # fmt: skip
RDMA: dict[str, Any] = {
    **BASE,
    "kvTransfer": {"backend": "nixl"},
    "model": {"name": "m", "cache": {"claimName": "models"}},
    "prefill": {"rdma": {"resource": "rdma/hca"}},
    "decode": {"rdma": {"resource": "rdma/hca", "count": 2}},
}
EXAMPLES = sorted(
    (Path(__file__).resolve().parents[2] / "charts/splitserve/examples").glob("*.yaml")
)


def _valid(raw: dict[str, Any], name: str = "demo") -> None:
    spec = parse_spec(raw, name=name)
    for desired in render(REF, spec, RenderInputs(replicas={p: 1 for p in Pool}, token="t")):
        assert manifest_problems(desired.manifest) == [], desired.name


@pytest.mark.parametrize("raw", [BASE, FULL, RDMA], ids=["minimal", "full", "rdma"])
def test_rendered_objects_pass_kubernetes_validate_strict(raw: dict[str, Any]) -> None:
    """Built-in kinds by kubernetes-validate --strict, the HTTPRoute (made, or detached)
    by the Gateway API's published schema."""
    _valid(raw)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_valid_objects(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    _valid(doc["spec"], doc["metadata"]["name"])


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
            "WorkerPool/demo-prefill",
            "WorkerPool/demo-decode",
            "Deployment/demo-prefill",
            "Deployment/demo-decode",
            "Deployment/demo-router",
            "PodDisruptionBudget/demo-prefill",
            "PodDisruptionBudget/demo-decode",
            "PodDisruptionBudget/demo-router",
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
            "kvTransfer": {"backend": "grpc", "lease": "30s"},
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
        "--kv-port",
        str(WORKER_KV_PORT),
        "--drain-seconds",
        "50",
        "--device",
        "cuda",
        "--tensor-parallel-size",
        "1",
    ]
    for pool in ("prefill", "decode", "router"):
        assert pod(objs, pool)["terminationGracePeriodSeconds"] == 60
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
        "--lease-seconds",
        "30",
        "--token-file",
        TOKEN_FILE,
        "--metrics-port",
        "9100",
    ]
    assert env(objs, "decode")["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_a_pool_with_gpus_runs_on_cuda_and_one_without_on_the_cpu() -> None:
    """A GPU pod never falls back to the CPU quietly: the worker is told ``--device cuda``
    (and exits at start if no GPU is visible); a CPU pod never takes a GPU the node's
    runtime happens to expose."""
    objs = objects({"prefill": {"gpus": 2}, "decode": {"gpus": 0}})
    assert arg(objs, "prefill", "--device") == "cuda"
    assert arg(objs, "decode", "--device") == "cpu"
    assert container(objs, "prefill")["args"].count("--device") == 1
    assert "--device" not in container(objs, "router")["args"]


TP4: dict[str, Any] = {
    **BASE,
    "prefill": {"gpus": 4},
    "decode": {"gpus": 4, "tensorParallelSize": 1},  # one rank on a pod of several GPUs
}


def test_a_pool_with_four_gpus_runs_one_engine_over_them_with_shared_memory() -> None:
    """``gpus: 4`` is one worker of 4 ranks on CUDA, with a memory-backed ``/dev/shm``
    for NCCL; an explicit ``tensorParallelSize`` wins (one rank, no ``/dev/shm``); and the
    objects pass kubernetes-validate --strict."""
    objs = objects(TP4)
    assert arg(objs, "prefill", "--tensor-parallel-size") == "4"
    assert arg(objs, "prefill", "--device") == "cuda"
    assert arg(objs, "decode", "--tensor-parallel-size") == "1"
    assert container(objs, "prefill")["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container(objs, "decode")["resources"]["limits"]["nvidia.com/gpu"] == 4
    shm = [v for v in pod(objs, "prefill")["volumes"] if v["name"] == "dshm"]
    assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    mounts = {m["mountPath"]: m["name"] for m in container(objs, "prefill")["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm"
    assert "dshm" not in {v["name"] for v in pod(objs, "decode")["volumes"]}
    _valid(TP4)


def test_tensor_parallelism_on_the_cpu_and_none_for_a_plain_cpu_pool() -> None:
    objs = objects({"prefill": {"gpus": 0, "tensorParallelSize": 2}, "decode": {"gpus": 0}})
    assert arg(objs, "prefill", "--tensor-parallel-size") == "2"
    assert arg(objs, "prefill", "--device") == "cpu"
    assert "--tensor-parallel-size" not in container(objs, "decode")["args"]
    assert "--tensor-parallel-size" not in container(objs, "router")["args"]
    assert [v["name"] for v in pod(objs, "prefill")["volumes"]].count("dshm") == 1


def test_worker_pods_carry_the_role_label_the_router_discovers_them_by() -> None:
    objs = objects()
    for pool in ("prefill", "decode"):
        labels = objs[f"Deployment/demo-{pool}"]["spec"]["template"]["metadata"]["labels"]
        assert labels["splitserve.io/role"] == pool
        ports = {p["name"]: p["containerPort"] for p in container(objs, pool)["ports"]}
        assert ports["grpc"] == WORKER_GRPC_PORT and ports["kv-push"] == WORKER_KV_PORT
    router = objs["Deployment/demo-router"]["spec"]["template"]["metadata"]["labels"]
    assert "splitserve.io/role" not in router


def test_the_worker_and_router_commands_accept_the_rendered_arguments() -> None:
    """The one place to align with the worker package: its own parsers read our args."""
    from splitserve.cli import build_parser

    parser = build_parser()
    objs = objects({"kvTransfer": {"backend": "nixl", "lease": "12s"}, "prefill": {"gpus": 2}})
    for pool in ("prefill", "decode", "router"):
        args = parseable(parser, container(objs, pool)["args"])
        parsed = parser.parse_args(args)
        assert parsed.command == args[0]
        assert parsed.token_file == TOKEN_FILE and parsed.kv_backend == "nixl"
        assert parsed.host == "0.0.0.0"
    worker = parser.parse_args(parseable(parser, container(objs, "decode")["args"]))
    assert (worker.role, worker.port, worker.lease_seconds, worker.metrics_port,
            worker.kv_port) == ("decode", WORKER_GRPC_PORT, 12, WORKER_METRICS_PORT,
                                WORKER_KV_PORT)  # fmt: skip
    router = parser.parse_args(container(objs, "router")["args"])
    assert (router.discovery, router.namespace, router.port) == (
        "kubernetes",
        "team-a",
        ROUTER_HTTP_PORT,
    )
    if not takes_tensor_parallel(parser, container(objs, "prefill")["args"]):
        pytest.skip("this worker has no --tensor-parallel-size yet: the rest parsed")
    prefill = parser.parse_args(container(objs, "prefill")["args"])
    assert (prefill.tensor_parallel_size, prefill.device) == (2, "cuda")


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
        # no fsGroup: the file belongs to root, the pod's user reads it as "other"
        assert volume["secret"]["defaultMode"] == 0o444
        assert "secret-token" not in json.dumps(objs[f"Deployment/demo-{pool}"])
    grouped = objects({"podSecurityContext": {"fsGroup": 2000}})
    volume = next(v for v in pod(grouped, "decode")["volumes"] if v["name"] == "token")
    assert volume["secret"]["defaultMode"] == 0o440  # owner and fsGroup only


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
    from splitserve_operator.render.manifests import render_deployment

    spec = parse_spec(FULL, name="demo")
    inputs = RenderInputs(replicas={Pool.PREFILL: 2, Pool.DECODE: 3, Pool.ROUTER: 1}, token="t")
    everything = {d.name: d.manifest for d in render(REF, spec, inputs) if d.kind == "Deployment"}
    for pool in Pool:
        assert render_deployment(REF, spec, inputs, pool) == everything[f"demo-{pool.value}"]


def test_each_pool_has_a_disruption_budget_over_its_own_pods() -> None:
    objs = objects({"decode": {"replicas": 4}})
    for pool in ("prefill", "decode", "router"):
        budget = objs[f"PodDisruptionBudget/demo-{pool}"]
        assert budget["apiVersion"] == "policy/v1"
        assert budget["spec"]["maxUnavailable"] == 1  # a drain never waits on a lone pod
        match = budget["spec"]["selector"]["matchLabels"]
        for other in ("prefill", "decode", "router"):
            labels = objs[f"Deployment/demo-{other}"]["spec"]["template"]["metadata"]["labels"]
            assert (match.items() <= labels.items()) == (other == pool), (pool, other)


def test_no_pod_is_killed_for_being_slow_to_start() -> None:
    """Liveness starts once the startup probe passes: workers load weights (from the hub,
    up to 30 min), the router its tokenizer (up to 10 min)."""
    objs = objects()
    for pool, budget in (("prefill", 1800), ("decode", 1800), ("router", 600)):
        c = container(objs, pool)
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == budget
        assert startup["tcpSocket"] == c["livenessProbe"]["tcpSocket"]
        # nor is its rollout read as stalled while it may still be starting
        deadline = objs[f"Deployment/demo-{pool}"]["spec"]["progressDeadlineSeconds"]
        assert deadline >= budget + 600


def test_a_pod_gone_silent_leaves_rotation_in_15_s_and_is_restarted_after_a_minute() -> None:
    """Readiness (every 5 s, 3 misses) takes a silent pod out of its Service first;
    liveness (every 20 s, 3 misses) restarts it only after a minute, so a pod busy for a
    few seconds is never restarted, and one that hung does not wait for long."""
    objs = objects()
    for pool in ("prefill", "decode", "router"):
        c = container(objs, pool)
        ready, live = c["readinessProbe"], c["livenessProbe"]
        assert ready["periodSeconds"] * ready["failureThreshold"] == 15, pool
        assert live["periodSeconds"] * live["failureThreshold"] == 60, pool
        assert live["periodSeconds"] == 20 and ready["tcpSocket"] == live["tcpSocket"], pool


def test_gpu_pools_roll_without_a_surge_pod() -> None:
    """A surge pod would wait for a spare GPU of the right kind: a GPU pool replaces one
    pod at a time; a CPU pool surges as Kubernetes does by default."""
    objs = objects({"prefill": {"gpus": 0}})
    rolling = {p: objs[f"Deployment/demo-{p}"]["spec"]["strategy"] for p in Pool}
    assert rolling[Pool.DECODE] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    for cpu in (Pool.PREFILL, Pool.ROUTER):
        assert rolling[cpu]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": "25%"}


def test_the_operators_own_names_are_the_ones_the_spec_refuses() -> None:
    """The overlay refuses these names and keys; they must be exactly what render uses."""
    from splitserve_operator.api.values import (
        GROUP,
        RESERVED_LABELS,
        RESERVED_MOUNT_PATHS,
        RESERVED_VOLUMES,
    )

    volumes: set[str] = set()
    mounts: set[str] = set()
    for raw in (BASE, {**BASE, "model": {"name": "m", "source": "pvc://w/m"}}, RDMA, TP4):
        objs = objects(raw)
        for p in ("prefill", "decode", "router"):
            volumes |= {v["name"] for v in pod(objs, p)["volumes"]}
            mounts |= {m["mountPath"] for m in container(objs, p)["volumeMounts"]}
            labels = objs[f"Deployment/demo-{p}"]["spec"]["template"]["metadata"]["labels"]
            assert all(k in RESERVED_LABELS or k.startswith(GROUP + "/") for k in labels)
    assert volumes == RESERVED_VOLUMES
    assert mounts == RESERVED_MOUNT_PATHS - {"/"}


def test_each_worker_pool_gets_a_scalable_worker_pool_object() -> None:
    """The WorkerPool carries the pool's size (its scale subresource's spec.replicas) and
    the spec value it was made from; it is valid against its CRD."""
    from crd_validation import CRD_PATH, load_crd, schema_of
    from jsonschema import Draft202012Validator
    from splitserve_operator.render.pools import worker_pool_status

    objs = objects({"decode": {"replicas": 3}})
    pool = objs["WorkerPool/demo-decode"]
    assert pool["spec"] == {"replicas": 3}
    assert pool["metadata"]["annotations"] == {"splitserve.io/requested-replicas": "3"}
    assert "WorkerPool/demo-router" not in objs  # the router is sized by its spec only
    schema = schema_of(load_crd(CRD_PATH.parent / "workerpools.splitserve.io.yaml"))
    status = worker_pool_status(REF, Pool.DECODE, generation=2, replicas=3, ready=1)
    for doc in (pool, {**pool, "status": status["status"]}):
        assert list(Draft202012Validator(schema).iter_errors(doc)) == []
    assert status["status"]["selector"] == (
        "app.kubernetes.io/component=decode,app.kubernetes.io/instance=demo"
    )
