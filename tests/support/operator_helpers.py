"""Reading an InferenceService's children back from the API emulator, for operator tests."""

from __future__ import annotations

from typing import Any

from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE, KINDS

SERVICE = KINDS[("v1", "Service")]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
CHILDREN = {
    "v1/configmaps": {"demo-config"},
    "v1/secrets": {"demo-worker-token"},
    "v1/serviceaccounts": {"demo-router"},
    "rbac.authorization.k8s.io/v1/rolebindings": {"demo-router"},
    "networking.k8s.io/v1/networkpolicies": {"demo-workers"},
    "policy/v1/poddisruptionbudgets": {"demo-prefill", "demo-decode", "demo-router"},
    "v1/services": {"demo-prefill", "demo-decode", "demo-router"},
    "apps/v1/deployments": {"demo-prefill", "demo-decode", "demo-router"},
}


def names(kube, resource: str, namespace: str = "default") -> list[str]:
    return sorted(o["metadata"]["name"] for o in kube.objects(resource, namespace))


def deployment(kube_client, name: str) -> dict[str, Any] | None:
    return kube_client.get(DEPLOYMENT, "default", name)


def replicas(kube_client, name: str) -> int | None:
    d = deployment(kube_client, name)
    return None if d is None else d["spec"]["replicas"]


def service(kube_client, name: str = "demo") -> dict[str, Any]:
    body = kube_client.get(INFERENCE_SERVICE, "default", name)
    assert body is not None
    return body


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def converged(kube_client, name: str = "demo") -> bool:
    body = kube_client.get(INFERENCE_SERVICE, "default", name)
    return (
        bool(body)
        and (body.get("status") or {}).get("observedGeneration") == body["metadata"]["generation"]
    )


def all_children(kube) -> bool:
    return all(set(names(kube, r)) == want for r, want in CHILDREN.items())


def mark_ready(kube_client, name: str = "demo", namespace: str = "default") -> None:
    """Do what the Deployment controller would: every pool's pods ready at the asked size."""
    for pool in ("prefill", "decode", "router"):
        d = kube_client.get(DEPLOYMENT, namespace, f"{name}-{pool}")
        assert d is not None, pool
        n = d["spec"].get("replicas", 1)
        kube_client.patch(
            DEPLOYMENT,
            namespace,
            f"{name}-{pool}",
            {
                "status": {
                    "observedGeneration": d["metadata"]["generation"],
                    "replicas": n,
                    "readyReplicas": n,
                    "updatedReplicas": n,
                    "availableReplicas": n,
                }
            },
            subresource="status",
        )
