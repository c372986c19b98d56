"""How many replicas each pool's Deployment gets: the seam with the planner.

With autoscaling off, ``spec.<pool>.replicas`` decides. With it on, the planner
owns the number: it writes its decision to the InferenceService's
``status.pools.<pool>.desiredReplicas``; the operator applies that (clamped to
``autoscaling.<pool>.minReplicas..maxReplicas``), and until the planner has
decided it keeps what the live Deployment has, or starts from
``spec.<pool>.replicas`` clamped to the bounds. The operator never overwrites
``desiredReplicas`` while autoscaling is on, except to fill it in when absent.
"""

from __future__ import annotations

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import SCALED_POOLS, Pool


def plan_replicas(
    spec: InferenceServiceSpec,
    pool: Pool,
    *,
    live: int | None = None,
    planned: int | None = None,
) -> int:
    """Replicas to apply to ``pool``'s Deployment.

    ``live``: the Deployment's current ``spec.replicas`` (None when it does not
    exist); ``planned``: ``status.pools.<pool>.desiredReplicas`` (None when unset).
    """
    if pool not in SCALED_POOLS or not spec.autoscaling.enabled:
        return spec.pool(pool).replicas
    bounds = spec.autoscaling.bounds(pool)
    for candidate in (planned, live):
        if isinstance(candidate, int) and not isinstance(candidate, bool) and candidate >= 0:
            return bounds.clamp(candidate)
    return bounds.clamp(spec.pool(pool).replicas)


def owns_desired_replicas(spec: InferenceServiceSpec, pool: Pool) -> bool:
    """Whether the operator (rather than the planner) writes ``desiredReplicas``."""
    return pool not in SCALED_POOLS or not spec.autoscaling.enabled
