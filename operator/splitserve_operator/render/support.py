"""The objects around the pools: config, token, router identity, network policy."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import FLEX_COMPONENT, WORKER_POOLS, Pool
from splitserve_operator.render import commands
from splitserve_operator.render.names import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    ServiceRef,
)


def config_document(ref: ServiceRef, spec: InferenceServiceSpec) -> dict[str, Any]:
    """What workers and router can read from ``$SPLITSERVE_CONFIG``.

    Only what they need to start: a change here rolls their pods (the config hash on
    the pod template). The SLO and autoscaling fields are the planner's and stay out,
    so tuning the planner never restarts a worker."""
    return {
        "instance": ref.name,
        "namespace": ref.namespace,
        # written as before the API took durations, so that an upgrade of the operator
        # alone does not change the config (and roll every pod)
        "model": {
            "name": spec.model.name,
            "source": spec.model.source,
            "dtype": spec.model.dtype.value,
        },
        "kvTransfer": {
            "backend": spec.kv_transfer.backend.value,
            "leaseSeconds": _seconds(spec.kv_transfer.lease),
            "checksums": spec.kv_transfer.checksums,
            "streams": spec.kv_transfer.streams,
        },
        "services": {
            pool.value: {
                "host": f"{ref.service(pool)}.{ref.namespace}.svc",
                "port": commands.ROUTER_HTTP_PORT
                if pool == Pool.ROUTER
                else commands.WORKER_GRPC_PORT,
            }
            for pool in Pool
        },
        "tokenFile": commands.TOKEN_FILE,
    }


def _seconds(value: float) -> int | float:
    return int(value) if value.is_integer() else value


def config_map(ref: ServiceRef, spec: InferenceServiceSpec) -> dict[str, Any]:
    text = json.dumps(config_document(ref, spec), sort_keys=True, indent=2) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ref.metadata(ref.config_map, "config"),
        "data": {commands.CONFIG_FILE: text},
    }


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(config.get("data", {}), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def token_secret(ref: ServiceRef, token: str) -> dict[str, Any]:
    """The shared token workers and router authenticate with. Created once, never
    patched: ``token`` is only used when the Secret does not exist yet."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": ref.metadata(ref.token_secret, "auth"),
        "type": "Opaque",
        "stringData": {commands.TOKEN_KEY: token},
    }


def router_service_account(ref: ServiceRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": ref.metadata(ref.router_service_account, "router"),
        "automountServiceAccountToken": False,
    }


def router_role_binding(ref: ServiceRef, cluster_role: str) -> dict[str, Any]:
    """Binds the chart's read-only discovery ClusterRole in this namespace only."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": ref.metadata(ref.router_role_binding, "router"),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": cluster_role,
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": ref.router_service_account,
                "namespace": ref.namespace,
            }
        ],
    }


def _pods(ref: ServiceRef, pools: tuple[Pool, ...], *more: str) -> dict[str, Any]:
    components = [p.value for p in pools] + list(more)
    return {
        "podSelector": {
            "matchLabels": {LABEL_INSTANCE: ref.name},
            "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": components}],
        }
    }


def network_policy(ref: ServiceRef, spec: InferenceServiceSpec) -> dict[str, Any]:
    """Only the instance's router (gRPC port) and peer workers (any port: NIXL/UCX
    picks its own) reach the workers; the metrics port is open to
    ``networkPolicy.metricsFrom`` (default: any pod in the cluster). Turned off, the
    policy admits everything (what a policy made before is patched to)."""
    flex = (FLEX_COMPONENT,) if spec.flex is not None else ()
    selector = _pods(ref, WORKER_POOLS, *flex)["podSelector"]
    meta = ref.metadata(ref.network_policy, "network-policy")
    if not spec.network_policy.enabled:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta,
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": [{}]},
        }
    ingress: list[dict[str, Any]] = [
        {
            "from": [_pods(ref, (Pool.ROUTER,))],
            "ports": [{"protocol": "TCP", "port": commands.WORKER_GRPC_PORT}],
        },
        {"from": [_pods(ref, WORKER_POOLS, *flex)]},
    ]
    metrics_from = spec.network_policy.metrics_from
    if metrics_from is None:
        metrics_from = [{"namespaceSelector": {}}]
    if metrics_from:
        ingress.append(
            {
                "from": [dict(peer) for peer in metrics_from],
                "ports": [{"protocol": "TCP", "port": commands.WORKER_METRICS_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }
