"""Names and labels of everything the operator creates for one InferenceService."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_operator.api.values import GROUP, Pool

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
POOL_KIND = "WorkerPool"
POOL_PLURAL = "workerpools"
"""One per worker pool of an InferenceService: its size, with a scale subresource, so
``kubectl scale``, a HorizontalPodAutoscaler or KEDA can drive the pool."""

MANAGED_BY = "splitserve-operator"
"""Value of ``app.kubernetes.io/managed-by`` on every object the operator makes."""

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"

ANNOTATION_REQUESTED_REPLICAS = f"{GROUP}/requested-replicas"
"""On a WorkerPool: the InferenceService's ``spec.<pool>.replicas`` the pool last took, so
that an edit of it is told apart from the pool being scaled by someone else since."""
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
"""On pod templates: a hash of the ConfigMap, so that a config change rolls the pods."""


@dataclass(frozen=True)
class ServiceRef:
    """Which InferenceService the objects belong to (for names and owner references)."""

    name: str
    namespace: str
    uid: str

    def deployment(self, pool: Pool) -> str:
        return f"{self.name}-{pool.value}"

    def service(self, pool: Pool) -> str:
        return f"{self.name}-{pool.value}"

    def worker_pool(self, pool: Pool) -> str:
        return f"{self.name}-{pool.value}"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def token_secret(self) -> str:
        return f"{self.name}-worker-token"

    @property
    def router_service_account(self) -> str:
        return f"{self.name}-router"

    @property
    def router_role_binding(self) -> str:
        return f"{self.name}-router"

    @property
    def http_route(self) -> str:
        return f"{self.name}-router"

    @property
    def network_policy(self) -> str:
        return f"{self.name}-workers"

    def selector(self, pool: Pool) -> dict[str, str]:
        """The (immutable) Deployment selector of a pool."""
        return {LABEL_INSTANCE: self.name, LABEL_COMPONENT: pool.value}

    def selector_string(self, pool: Pool) -> str:
        """:meth:`selector` as a label selector string (a scale subresource's)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector(pool).items()))

    def labels(self, component: str | None = None) -> dict[str, str]:
        labels = {
            LABEL_NAME: "splitserve",
            LABEL_INSTANCE: self.name,
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_PART_OF: "splitserve",
        }
        if component is not None:
            labels[LABEL_COMPONENT] = component
        return labels

    def owner_reference(self) -> dict[str, object]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def metadata(self, name: str, component: str | None = None) -> dict[str, object]:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(component),
            "ownerReferences": [self.owner_reference()],
        }
