"""Deployments and Services of the three pools."""

from __future__ import annotations

from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec, PoolSpec
from splitserve_operator.api.values import GPU_RESOURCE, MODEL_MOUNT, Pool
from splitserve_operator.render import commands, security
from splitserve_operator.render.names import ANNOTATION_CONFIG_HASH, LABEL_INSTANCE, ServiceRef

TOKEN_FILE_MODE = 0o440
"""Owner and group (fsGroup) may read the token; nobody else."""


def _resources(pool_spec: PoolSpec) -> dict[str, Any]:
    requests: dict[str, Any] = (
        dict(pool_spec.resources.requests or {}) if pool_spec.resources else {}
    )
    limits: dict[str, Any] = dict(pool_spec.resources.limits or {}) if pool_spec.resources else {}
    if pool_spec.gpus > 0:
        requests[GPU_RESOURCE] = pool_spec.gpus
        limits[GPU_RESOURCE] = pool_spec.gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(pool_spec: PoolSpec) -> list[dict[str, Any]]:
    """The operator's variables, then the user's; a user variable replaces ours by name."""
    user = [var.manifest() for var in pool_spec.env or []]
    names = {var["name"] for var in user}
    return [var for var in commands.base_env() if var["name"] not in names] + user


def _volumes(
    ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": ref.config_map}},
        {
            "name": "token",
            "secret": {
                "secretName": ref.token_secret,
                "defaultMode": TOKEN_FILE_MODE,
                "items": [{"key": commands.TOKEN_KEY, "path": commands.TOKEN_KEY}],
            },
        },
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": commands.CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": commands.TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": commands.TMP_DIR},
        {"name": "cache", "mountPath": commands.CACHE_DIR},
    ]
    if spec.model.claim is not None:  # the checkpoint (the router reads its tokenizer)
        claim = {"claimName": spec.model.claim[0], "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if pool != Pool.ROUTER:
        # torch's DataLoader and NCCL use shared memory; the default 64 MiB is too small.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": commands.SHM_DIR})
    return volumes, mounts


def _container(
    ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    pool_spec = spec.pool(pool)
    if pool == Pool.ROUTER:
        args = commands.router_args(spec, ref.namespace, f"{LABEL_INSTANCE}={ref.name}")
        ports = commands.router_ports()
        probes = commands.router_probes()
    else:
        args = commands.worker_args(spec, pool)
        ports = commands.worker_ports()
        probes = commands.worker_probes()
    container: dict[str, Any] = {
        "name": pool.value,
        "image": spec.image,
        "command": [commands.EXECUTABLE],
        "args": args,
        "ports": ports,
        "env": _env(pool_spec),
        "volumeMounts": mounts,
        "securityContext": security.container_security_context(),
        **probes,
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy.value
    resources = _resources(pool_spec)
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool) -> dict[str, Any]:
    pool_spec = spec.pool(pool)
    volumes, mounts = _volumes(ref, spec, pool)
    pod: dict[str, Any] = {
        "securityContext": security.pod_security_context(),
        "enableServiceLinks": False,
        "containers": [_container(ref, spec, pool, mounts)],
        "volumes": volumes,
        # a stopping pod's streams get this long to end (the router's HTTP streams
        # too: it stops taking connections and serves the open ones until then)
        "terminationGracePeriodSeconds": commands.POD_GRACE_SECONDS,
    }
    if pool == Pool.ROUTER:
        pod["serviceAccountName"] = ref.router_service_account
        pod["automountServiceAccountToken"] = True
    else:
        # Workers never call the Kubernetes API: no token in their pods.
        pod["automountServiceAccountToken"] = False
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [dict(ref_) for ref_ in spec.image_pull_secrets]
    if pool_spec.node_selector:
        pod["nodeSelector"] = dict(pool_spec.node_selector)
    if pool_spec.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True, mode="json")
            for t in pool_spec.tolerations
        ]
    if pool_spec.affinity is not None:
        affinity = pool_spec.affinity.model_dump(by_alias=True, exclude_none=True, mode="json")
        if affinity:
            pod["affinity"] = affinity
    if pool_spec.priority_class_name:
        pod["priorityClassName"] = pool_spec.priority_class_name
    if pool_spec.runtime_class_name:
        pod["runtimeClassName"] = pool_spec.runtime_class_name
    return pod


def deployment(
    ref: ServiceRef,
    spec: InferenceServiceSpec,
    pool: Pool,
    *,
    replicas: int,
    config_hash: str,
) -> dict[str, Any]:
    labels = ref.labels(pool.value)
    # the user's first, so that ours (the config hash, the scrape hints) win
    annotations = {**(spec.pool(pool).pod_annotations or {}), ANNOTATION_CONFIG_HASH: config_hash}
    if pool != Pool.ROUTER:
        labels[commands.ROLE_LABEL] = pool.value
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(commands.WORKER_METRICS_PORT),
                "prometheus.io/path": "/metrics",
            }
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ref.metadata(ref.deployment(pool), pool.value),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": ref.selector(pool)},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": _pod_spec(ref, spec, pool),
            },
        },
    }


def service(ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool) -> dict[str, Any]:
    body: dict[str, Any]
    if pool == Pool.ROUTER:
        body = {
            "type": spec.router.service_type.value,
            "selector": ref.selector(pool),
            "ports": [
                {
                    "name": "http",
                    "port": commands.ROUTER_HTTP_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                },
                {
                    "name": "metrics",
                    "port": commands.ROUTER_METRICS_SERVICE_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                },
            ],
        }
    else:
        # Headless: the router and peers address individual workers.
        body = {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": ref.selector(pool),
            "ports": [
                {
                    "name": "grpc",
                    "port": commands.WORKER_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                },
                {
                    "name": "metrics",
                    "port": commands.WORKER_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ref.metadata(ref.service(pool), pool.value),
        "spec": body,
    }


def disruption_budget(ref: ServiceRef, pool: Pool) -> dict[str, Any]:
    """At most one pod of the pool evicted at a time by a voluntary disruption (a node
    drain, a cluster upgrade): streams on an evicted decode worker move elsewhere, but a
    drain that took every worker of a pool at once would leave none to move to. With
    one replica the drain still proceeds."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": ref.metadata(ref.deployment(pool), pool.value),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": ref.selector(pool)}},
    }
