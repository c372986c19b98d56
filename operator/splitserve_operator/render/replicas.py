"""How many replicas each pool gets: the seam between whoever scales a pool and its
Deployment. Pure.

A worker pool's size is its WorkerPool's ``spec.replicas`` (written by ``kubectl scale``,
an autoscaler or the planner); the Deployment gets that number, clamped to
``autoscaling.<pool>.minReplicas..maxReplicas`` while autoscaling is on. The router is
sized by ``spec.router.replicas``.

:func:`pool_target` decides what the operator itself writes to ``spec.replicas`` of a
WorkerPool, so that it never fights another scaler:

- a new pool starts at ``spec.<pool>.replicas`` (clamped to the bounds when autoscaled);
- with autoscaling off, an edit of ``spec.<pool>.replicas`` is a new request and is
  written (taking the field from whoever scaled the pool before); otherwise the operator
  keeps writing the field only while it still owns it, so a ``kubectl scale`` or an HPA
  that took it keeps it;
- with autoscaling on, the planner owns the field; the operator only keeps its seed
  until the planner takes over.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import SCALED_POOLS, Pool


def seed_replicas(spec: InferenceServiceSpec, pool: Pool) -> int:
    """The size a pool starts at: ``spec.<pool>.replicas``, clamped when autoscaled."""
    replicas = spec.pool(pool).replicas
    if pool in SCALED_POOLS and spec.autoscaling.enabled:
        return spec.autoscaling.bounds(pool).clamp(replicas)
    return replicas


def deployment_replicas(spec: InferenceServiceSpec, pool: Pool, target: int | None) -> int:
    """Replicas for ``pool``'s Deployment, given its WorkerPool's ``spec.replicas``
    (``target``; None while there is none)."""
    if pool not in SCALED_POOLS:
        return spec.pool(pool).replicas
    if target is None:
        return seed_replicas(spec, pool)
    if spec.autoscaling.enabled:
        return spec.autoscaling.bounds(pool).clamp(target)
    return target


@dataclass(frozen=True)
class PoolTarget:
    """What the operator applies to a WorkerPool's ``spec.replicas``."""

    replicas: int | None
    """The value to apply; None: leave the field to whoever owns it."""
    target: int
    """The pool's size once applied (what its Deployment follows, before clamping)."""
    requested: int
    """The ``spec.<pool>.replicas`` the pool has taken (recorded on the pool)."""


def pool_target(
    spec: InferenceServiceSpec,
    pool: Pool,
    *,
    exists: bool,
    live: int | None,
    recorded: int | None,
    ours: bool,
) -> PoolTarget:
    """``live``: the WorkerPool's ``spec.replicas``; ``recorded``: the
    ``spec.<pool>.replicas`` it took last; ``ours``: whether the operator's field manager
    owns ``spec.replicas`` now."""
    requested = spec.pool(pool).replicas
    if not exists or live is None:
        seed = seed_replicas(spec, pool)
        return PoolTarget(seed, seed, requested)
    if spec.autoscaling.enabled:
        kept = recorded if recorded is not None else requested
        return PoolTarget(live if ours else None, live, kept)
    if recorded != requested or ours:
        return PoolTarget(requested, requested, requested)
    return PoolTarget(None, live, requested)
