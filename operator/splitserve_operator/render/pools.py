"""The WorkerPool of each worker pool: the pool's size as a resource of its own, with a
scale subresource (``spec.replicas``, ``status.replicas``, ``status.selector``).

Whoever scales the pool writes ``spec.replicas`` (``kubectl scale workerpool``, a
HorizontalPodAutoscaler, KEDA, or the built-in planner under its own field manager); the
operator applies it to the pool's Deployment. The operator itself sets it only when the
pool is made and when the InferenceService's ``spec.<pool>.replicas`` changes (see
:func:`splitserve_operator.render.replicas.pool_target`).
"""

from __future__ import annotations

from typing import Any

from splitserve_operator.api.values import Pool
from splitserve_operator.render.names import (
    ANNOTATION_REQUESTED_REPLICAS,
    API_VERSION,
    POOL_KIND,
    ServiceRef,
)


def worker_pool(
    ref: ServiceRef, pool: Pool, *, replicas: int | None, requested: int
) -> dict[str, Any]:
    """The WorkerPool as the operator applies it; ``replicas`` None leaves ``spec.replicas``
    to whoever else scales the pool."""
    metadata: dict[str, Any] = ref.metadata(ref.worker_pool(pool), pool.value)
    metadata["annotations"] = {ANNOTATION_REQUESTED_REPLICAS: str(requested)}
    spec: dict[str, Any] = {} if replicas is None else {"replicas": replicas}
    return {"apiVersion": API_VERSION, "kind": POOL_KIND, "metadata": metadata, "spec": spec}


def worker_pool_status(
    ref: ServiceRef, pool: Pool, *, generation: int, replicas: int, ready: int
) -> dict[str, Any]:
    """The WorkerPool's status: the spec generation its Deployment now follows, the pods
    it has and has ready, and the selector of its pods (what an autoscaler counts)."""
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "metadata": {"name": ref.worker_pool(pool), "namespace": ref.namespace},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "selector": ref.selector_string(pool),
        },
    }
