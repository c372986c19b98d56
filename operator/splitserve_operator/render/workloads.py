"""Deployments and Services of the three pools."""

from __future__ import annotations

import math
from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec, PoolSpec
from splitserve_operator.api.pods import PodTemplateOverlay, Rollout
from splitserve_operator.api.values import FLEX_COMPONENT, MODEL_MOUNT, Pool
from splitserve_operator.render import commands, security
from splitserve_operator.render.names import (
    ANNOTATION_CONFIG_HASH,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    ServiceRef,
)

TOKEN_FILE_MODE = 0o440
"""With an ``fsGroup``: owner and group may read the token, nobody else."""
TOKEN_FILE_MODE_NO_GROUP = 0o444
"""Without one the files belong to root: the pod's user reads them as "others" (the
volume is the pod's own; no other pod sees it)."""


def _resources(pool_spec: PoolSpec) -> dict[str, Any]:
    requests: dict[str, Any] = (
        dict(pool_spec.resources.requests or {}) if pool_spec.resources else {}
    )
    limits: dict[str, Any] = dict(pool_spec.resources.limits or {}) if pool_spec.resources else {}
    if pool_spec.gpus > 0:
        requests[pool_spec.accelerator_resource] = pool_spec.gpus
        limits[pool_spec.accelerator_resource] = pool_spec.gpus
    rdma = getattr(pool_spec, "rdma", None)
    if rdma is not None:
        requests[rdma.resource] = rdma.count
        limits[rdma.resource] = rdma.count
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    overlay = pool_spec.pod_template
    if overlay is not None and overlay.resource_claims:
        out["claims"] = [{"name": claim.name} for claim in overlay.resource_claims]
    return out


def _fetch_resources(pool_spec: PoolSpec) -> dict[str, Any]:
    """The model fetch's resources: the pool's CPU and memory, no devices."""
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        held = getattr(pool_spec.resources, kind, None) or {}
        plain = {k: v for k, v in held.items() if k in ("cpu", "memory", "ephemeral-storage")}
        if plain:
            out[kind] = plain
    return out


def _env(pool_spec: PoolSpec) -> list[dict[str, Any]]:
    """The operator's variables, then the user's; a user variable replaces ours by name."""
    user = [var.manifest() for var in pool_spec.env or []]
    names = {var["name"] for var in user}
    return [var for var in commands.base_env() if var["name"] not in names] + user


def _download_folder(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The ``cache`` volume the model downloads into: the shared claim, or the pod's own
    ``emptyDir`` (bounded by ``downloadSizeLimit``)."""
    if spec.model.cache is not None:
        return {"persistentVolumeClaim": {"claimName": spec.model.cache.claim_name}}
    limit = spec.model.download_size_limit
    return {"emptyDir": {} if limit is None else {"sizeLimit": limit}}


def _volumes(
    ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    own_group = spec.pod_security_context is not None and (
        spec.pod_security_context.fs_group is not None
    )
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": ref.config_map}},
        {
            "name": "token",
            "secret": {
                "secretName": ref.token_secret,
                "defaultMode": TOKEN_FILE_MODE if own_group else TOKEN_FILE_MODE_NO_GROUP,
                "items": [{"key": commands.TOKEN_KEY, "path": commands.TOKEN_KEY}],
            },
        },
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", **_download_folder(spec)},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": commands.CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": commands.TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": commands.TMP_DIR},
        {"name": "cache", "mountPath": commands.CACHE_DIR},
    ]
    if spec.tls is not None:  # the same certificate and CA in every pod
        volumes.append({"name": "tls", "secret": {
            "secretName": spec.tls.secret_name,
            "defaultMode": TOKEN_FILE_MODE if own_group else TOKEN_FILE_MODE_NO_GROUP,
            "items": [{"key": k, "path": k} for k in commands.TLS_KEYS]}})  # fmt: skip
        mounts.append({"name": "tls", "mountPath": commands.TLS_DIR, "readOnly": True})
    if spec.model.claim is not None:  # the checkpoint (the router reads its tokenizer)
        claim = {"claimName": spec.model.claim[0], "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    ranks = spec.worker_pool(pool).tensor_parallel if pool != Pool.ROUTER else 1
    if ranks > 1:
        # the ranks' collectives (NCCL, or gloo on the CPU) go through shared memory
        limit = commands.shared_memory_limit(ranks)
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": limit}})
        mounts.append({"name": "dshm", "mountPath": commands.SHM_DIR})
    overlay = spec.pool(pool).pod_template
    if overlay is not None:
        volumes += [
            v.model_dump(by_alias=True, exclude_none=True, mode="json")
            for v in overlay.volumes or []
        ]
        mounts += [
            m.model_dump(by_alias=True, exclude_none=True, mode="json")
            for m in overlay.volume_mounts or []
        ]
    return volumes, mounts


def _container(
    ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    pool_spec = spec.pool(pool)
    if pool == Pool.ROUTER:
        args = commands.router_args(spec, ref.namespace, f"{LABEL_INSTANCE}={ref.name}")
        ports = commands.router_ports()
        probes = commands.router_probes()
        ipc_lock = False
    else:
        args = commands.worker_args(spec, pool)
        ports = commands.worker_ports()
        probes = commands.worker_probes()
        rdma = spec.worker_pool(pool).rdma
        ipc_lock = rdma is not None and rdma.ipc_lock
    container: dict[str, Any] = {
        "name": pool.value,
        "image": spec.image,
        "command": [commands.EXECUTABLE],
        "args": args,
        "ports": ports,
        "env": _env(pool_spec),
        "volumeMounts": mounts,
        "securityContext": security.container_security_context(ipc_lock=ipc_lock),
        **probes,
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy.value
    resources = _resources(pool_spec)
    if resources:
        container["resources"] = resources
    return container


def _fetch_model(
    spec: InferenceServiceSpec, pool: Pool, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The init container that fills the shared cache before the worker starts: a download
    that takes long runs here, outside the worker's startup probe. Pods that start
    together share the hub client's per-file locks in the cache; later pods find the
    files there and fetch nothing."""
    pool_spec = spec.pool(pool)
    container: dict[str, Any] = {
        "name": "fetch-model",
        "image": spec.image,
        "command": [commands.EXECUTABLE],
        "args": commands.fetch_model_args(spec),
        "env": _env(pool_spec),
        "volumeMounts": [m for m in mounts if m["name"] not in ("dshm", "tls")],
        "securityContext": security.container_security_context(),
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy.value
    resources = _fetch_resources(pool_spec)
    if resources:
        container["resources"] = resources
    return container


def _spread(ref: ServiceRef, pool: Pool, overlay: PodTemplateOverlay) -> list[dict[str, Any]]:
    """The pool's topology spread, each without a selector spreading this pool's pods."""
    out = []
    for entry in overlay.topology_spread_constraints or []:
        rendered = entry.model_dump(by_alias=True, exclude_none=True, mode="json")
        rendered.setdefault("labelSelector", {"matchLabels": ref.selector(pool)})
        out.append(rendered)
    return out


def _pod_spec(ref: ServiceRef, spec: InferenceServiceSpec, pool: Pool) -> dict[str, Any]:
    pool_spec = spec.pool(pool)
    volumes, mounts = _volumes(ref, spec, pool)
    pod: dict[str, Any] = {
        "securityContext": security.pod_security_context(spec.pod_security_context),
        "enableServiceLinks": False,
        "containers": [_container(ref, spec, pool, mounts)],
        "volumes": volumes,
        # a stopping pod's streams get this long to end (the router's HTTP streams
        # too: it stops taking connections and serves the open ones until then)
        "terminationGracePeriodSeconds": commands.POD_GRACE_SECONDS,
    }
    if spec.model.cache is not None and pool != Pool.ROUTER:
        pod["initContainers"] = [_fetch_model(spec, pool, mounts)]
    overlay = pool_spec.pod_template
    if pool == Pool.ROUTER:
        pod["serviceAccountName"] = ref.router_service_account
        pod["automountServiceAccountToken"] = True
    else:
        if overlay is not None and overlay.service_account_name:
            # workload identity for the model download (its token comes projected by the
            # platform's webhook, not as the API token)
            pod["serviceAccountName"] = overlay.service_account_name
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
    if overlay is not None:
        if overlay.scheduler_name:
            pod["schedulerName"] = overlay.scheduler_name
        if overlay.topology_spread_constraints:
            pod["topologySpreadConstraints"] = _spread(ref, pool, overlay)
        if overlay.resource_claims:
            pod["resourceClaims"] = [
                c.model_dump(by_alias=True, exclude_none=True, mode="json")
                for c in overlay.resource_claims
            ]
    return pod


def strategy(pool_spec: PoolSpec) -> dict[str, Any]:
    """The rolling update: a GPU pool replaces a pod before it adds one (a surge pod would
    wait for a spare GPU of the right kind), a CPU pool surges as Kubernetes does by
    default; ``rollout`` overrides either number."""
    surge, unavailable = (pool_spec.rollout or Rollout()).effective(pool_spec.gpus)
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
    }


def progress_deadline(pool_spec: PoolSpec, pool: Pool) -> int:
    """Seconds without progress before the Deployment counts as stalled: never shorter than
    a pod may take to start (its startup budget), unless ``rollout`` says so."""
    rollout = pool_spec.rollout
    if rollout is not None and rollout.progress_deadline is not None:
        return math.ceil(rollout.progress_deadline)
    return commands.startup_seconds(pool) + commands.ROLLOUT_SLACK_SECONDS


def deployment(
    ref: ServiceRef,
    spec: InferenceServiceSpec,
    pool: Pool,
    *,
    replicas: int,
    config_hash: str,
) -> dict[str, Any]:
    pool_spec = spec.pool(pool)
    overlay = pool_spec.pod_template
    # the user's first, so that ours (the selector labels, the config hash, the scrape
    # hints) win; the spec refuses the operator's own keys anyway
    labels = {**((overlay.labels if overlay else None) or {}), **ref.labels(pool.value)}
    annotations = {
        **((overlay.annotations if overlay else None) or {}),
        ANNOTATION_CONFIG_HASH: config_hash,
    }
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
            "strategy": strategy(pool_spec),
            "progressDeadlineSeconds": progress_deadline(pool_spec, pool),
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": _pod_spec(ref, spec, pool),
            },
        },
    }


def flex_deployment(
    ref: ServiceRef, spec: InferenceServiceSpec, *, config_hash: str
) -> dict[str, Any] | None:
    """The Deployment ``<name>-flex`` of ``spec.flex``'s switchable workers (``None``
    without one): a worker pod as a decode pool of the same settings would have it, with
    its own component (no fixed pool's selector, Service or budget takes its pods),
    ``--switchable``, the pod's labels mounted from the downward API, and the role label
    of the template at :data:`commands.FLEX_START_ROLE`. The planner relabels a pod to
    switch it; the template's label only names the role a new pod starts in."""
    flex = spec.flex
    if flex is None:
        return None
    own = spec.model_copy(update={"decode": flex})
    out = deployment(ref, own, Pool.DECODE, replicas=flex.replicas, config_hash=config_hash)
    name = f"{ref.name}-{FLEX_COMPONENT}"
    selector = {LABEL_INSTANCE: ref.name, LABEL_COMPONENT: FLEX_COMPONENT}
    out["metadata"] = ref.metadata(name, FLEX_COMPONENT)
    body = out["spec"]
    body["selector"] = {"matchLabels": selector}
    template = body["template"]
    template["metadata"]["labels"].update(
        {**selector, commands.ROLE_LABEL: commands.FLEX_START_ROLE}
    )
    pod = template["spec"]
    for spread in pod.get("topologySpreadConstraints", []):
        if spread.get("labelSelector") == {"matchLabels": ref.selector(Pool.DECODE)}:
            spread["labelSelector"] = {"matchLabels": selector}
    container = pod["containers"][0]
    container["name"] = FLEX_COMPONENT
    container["args"] = commands.flex_args(container["args"])
    # beside the operator's own mounts, before the user's (as render orders them)
    mounts, volumes = container["volumeMounts"], pod["volumes"]
    mounts.insert(
        [m["name"] for m in mounts].index("cache") + 1,
        {"name": "podinfo", "mountPath": commands.PODINFO_DIR, "readOnly": True},
    )
    labels = {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}
    volumes.insert(
        [v["name"] for v in volumes].index("cache") + 1,
        {"name": "podinfo", "downwardAPI": {"items": [labels]}},
    )
    return out


def flex_disruption_budget(ref: ServiceRef, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """At most one switchable pod evicted at a time, as for the fixed pools."""
    if spec.flex is None:
        return None
    selector = {LABEL_INSTANCE: ref.name, LABEL_COMPONENT: FLEX_COMPONENT}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": ref.metadata(f"{ref.name}-{FLEX_COMPONENT}", FLEX_COMPONENT),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
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
                    "port": commands.ROUTER_METRICS_PORT,
                    "targetPort": "metrics",
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
