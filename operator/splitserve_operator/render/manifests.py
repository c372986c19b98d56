"""``render()``: every object of one InferenceService, in the order to apply them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import WORKER_POOLS, Pool
from splitserve_operator.render import pools, routes, support, workloads
from splitserve_operator.render.names import ServiceRef
from splitserve_operator.render.replicas import PoolTarget


@dataclass(frozen=True)
class Desired:
    """One object the operator wants to exist."""

    manifest: dict[str, Any]
    create_only: bool = False
    """Create when absent, never patch (the token Secret: generated once)."""
    existing_only: bool = False
    """Patched if it exists, never created: an object the spec turned off after it was
    made is neutralised in place (the operator deletes nothing; its owner does)."""

    @property
    def api_version(self) -> str:
        return str(self.manifest["apiVersion"])

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.manifest["metadata"]["namespace"])


@dataclass(frozen=True)
class RenderInputs:
    """What render needs besides the spec; chosen by the caller so render stays pure."""

    replicas: Mapping[Pool, int]
    """Per pool, the Deployment's (see :mod:`splitserve_operator.render.replicas`)."""
    token: str
    """A fresh random token; used only if the Secret does not exist yet."""
    router_cluster_role: str = "splitserve-router"
    """The chart's ClusterRole that lets a router discover its workers."""
    pools: Mapping[Pool, PoolTarget] = field(default_factory=dict)
    """Per worker pool, what its WorkerPool gets (``replicas.pool_target``); a pool
    missing here gets no WorkerPool in the output."""
    extra: Mapping[str, Any] = field(default_factory=dict)


def render(ref: ServiceRef, spec: InferenceServiceSpec, inputs: RenderInputs) -> list[Desired]:
    config = support.config_map(ref, spec)
    config_hash = support.config_hash(config)
    objects = [
        Desired(config),
        Desired(support.token_secret(ref, inputs.token), create_only=True),
        Desired(support.router_service_account(ref)),
        Desired(support.router_role_binding(ref, inputs.router_cluster_role)),
    ]
    policy = support.network_policy(ref, spec)
    objects.append(Desired(policy, existing_only=not spec.network_policy.enabled))
    objects += [Desired(workloads.service(ref, spec, pool)) for pool in Pool]
    objects += [
        Desired(
            pools.worker_pool(
                ref,
                pool,
                replicas=inputs.pools[pool].replicas,
                requested=inputs.pools[pool].requested,
            )
        )
        for pool in WORKER_POOLS
        if pool in inputs.pools
    ]
    objects += [
        Desired(
            workloads.deployment(
                ref, spec, pool, replicas=inputs.replicas[pool], config_hash=config_hash
            )
        )
        for pool in Pool
    ]
    objects += [Desired(workloads.disruption_budget(ref, pool)) for pool in Pool]
    flex = workloads.flex_deployment(ref, spec, config_hash=config_hash)
    budget = workloads.flex_disruption_budget(ref, spec)
    objects += [Desired(made) for made in (flex, budget) if made is not None]
    route = routes.http_route(ref, spec)
    objects.append(Desired(route, existing_only=spec.router.http_route is None))
    return objects


def render_deployment(
    ref: ServiceRef, spec: InferenceServiceSpec, inputs: RenderInputs, pool: Pool
) -> dict[str, Any]:
    """Only ``pool``'s Deployment, as :func:`render` makes it (for cheap drift checks)."""
    config_hash = support.config_hash(support.config_map(ref, spec))
    return workloads.deployment(
        ref, spec, pool, replicas=inputs.replicas[pool], config_hash=config_hash
    )
