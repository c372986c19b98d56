"""The InferenceService's status, the Kubernetes way. Pure: observations in, status out.

- ``observedGeneration``: the spec generation this status describes.
- ``conditions``: ``Ready``, ``Progressing``, ``Degraded``, each with a reason,
  a message and a ``lastTransitionTime`` that moves only when the status flips.
- ``pools.<pool>``: ``replicas`` (the Deployment's ``spec.replicas``),
  ``readyReplicas``, ``updatedReplicas`` and ``desiredReplicas`` (observed: the pool's
  WorkerPool ``spec.replicas``, which is where a pool is scaled; see ``render/replicas.py``).
- ``url``: the router Service's address inside the cluster.
- ``warnings``: deprecated spec fields in use, each with what to write instead;
  absent when there are none.

Every condition carries ``type``, ``status``, ``reason``, ``message``,
``lastTransitionTime`` and ``observedGeneration`` (the CRD requires them all).

What this module builds is the reconciler's part of the status only, applied under the
operator's own field manager: ``conditions`` is a list-map keyed by ``type`` in the CRD,
so the API server merges each writer's conditions by type (the planner applies its
``ScalingActive`` beside these), and nobody's update is lost to a stale read. A field
left out of what the reconciler applies (``warnings`` once the spec has none) is removed
by the server, as the reconciler owned it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from splitserve_operator.api.fields import as_map, count, timestamp
from splitserve_operator.api.values import Pool

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
OWN_CONDITIONS = (READY, PROGRESSING, DEGRADED)
"""The condition types the reconciler writes (others, such as the planner's
``ScalingActive`` and ``KVIntegrity``, are their writers' own)."""
KV_INTEGRITY = "KVIntegrity"
"""Whether the router's correctness guard found disaggregated requests decoding other
tokens than the same requests prefilled on their decode worker, over a recent window:
written by the autoscaling loop from Prometheus."""


class IntegrityReason(StrEnum):
    VERIFIED = "NoMismatch"
    MISMATCH = "GuardMismatch"
    UNKNOWN = "MetricsUnavailable"


def kv_integrity_condition(
    mismatches: float | None,
    window: str,
    unknown_why: str | None,
    *,
    generation: int,
    now: datetime,
    previous: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """``KVIntegrity`` from the guard's mismatches over ``window`` (a duration such as
    ``10m``): False when there were any, True when there were none, Unknown when they
    could not be read (``unknown_why``)."""
    if unknown_why is not None or mismatches is None:
        value, reason = "Unknown", IntegrityReason.UNKNOWN.value
        message = (
            "cannot tell whether moved KV decodes right: "
            f"{unknown_why or 'no correctness guard series in Prometheus'}; the router's "
            "splitserve_guard_checks_total must be scraped"
        )
    elif mismatches > 0:
        value, reason = "False", IntegrityReason.MISMATCH.value
        message = (
            f"the correctness guard saw {mismatches:g} disaggregated request(s) in the last "
            f"{window} decode other tokens than the same request prefilled on its decode "
            "worker: the KV that moved was not the KV that worker computes. The router logs "
            "each one ('correctness guard: request ...'); set kvTransfer.checksums to find "
            "corrupt transfers, or route with disaggregation never until it is fixed"
        )
    else:
        value, reason = "True", IntegrityReason.VERIFIED.value
        message = f"every disaggregated request the guard re-ran in the last {window} matched"
    since = timestamp(now)
    for old in previous:
        if (
            isinstance(old, Mapping)
            and old.get("type") == KV_INTEGRITY
            and old.get("status") == value
        ):
            since = str(old.get("lastTransitionTime") or since)
    return {
        "type": KV_INTEGRITY,
        "status": value,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


class Reason(StrEnum):
    ALL_POOLS_READY = "AllPoolsReady"
    POOLS_NOT_READY = "PoolsNotReady"
    ROLLING_OUT = "RollingOut"
    ROLLOUT_COMPLETE = "RolloutComplete"
    ROLLOUT_STALLED = "RolloutStalled"
    AS_EXPECTED = "AsExpected"
    INVALID_SPEC = "InvalidSpec"
    APPLY_FAILED = "ApplyFailed"
    NAME_CONFLICT = "NameConflict"
    FORBIDDEN = "Forbidden"


@dataclass(frozen=True)
class PoolObservation:
    """What one pool's Deployment says about itself."""

    replicas: int
    """``spec.replicas`` as applied."""
    ready: int = 0
    updated: int = 0
    available: int = 0
    total: int = 0
    """``status.replicas``: pods of any revision."""
    rolled_out: bool = False
    """The Deployment controller has seen the latest spec and every pod is current."""
    stalled: str | None = None
    """The Deployment's ``ProgressDeadlineExceeded`` message, if any."""

    @classmethod
    def from_deployment(cls, deployment: Mapping[str, Any] | None) -> PoolObservation | None:
        if not deployment:
            return None
        spec = deployment.get("spec") or {}
        status = deployment.get("status") or {}
        meta = deployment.get("metadata") or {}
        replicas = count(spec.get("replicas"), 1)
        ready = count(status.get("readyReplicas"))
        updated = count(status.get("updatedReplicas"))
        total = count(status.get("replicas"))
        observed = count(status.get("observedGeneration"))
        generation = count(meta.get("generation"))
        stalled = None
        for cond in status.get("conditions") or []:
            if (
                isinstance(cond, Mapping)
                and cond.get("type") == "Progressing"
                and cond.get("reason") == "ProgressDeadlineExceeded"
            ):
                stalled = str(cond.get("message") or "progress deadline exceeded")
        rolled_out = (
            observed >= generation
            and updated >= replicas
            and ready >= replicas
            and total <= replicas
        )
        return cls(
            replicas=replicas,
            ready=ready,
            updated=updated,
            available=count(status.get("availableReplicas")),
            total=total,
            rolled_out=rolled_out,
            stalled=stalled,
        )


@dataclass(frozen=True)
class Problem:
    """Why the operator could not do its job; becomes ``Degraded=True``."""

    reason: Reason
    message: str


def condition(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int,
    now: datetime,
    previous: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    value = "True" if status else "False"
    since = timestamp(now)
    for old in previous:
        if isinstance(old, Mapping) and old.get("type") == type_ and old.get("status") == value:
            since = str(old.get("lastTransitionTime") or since)
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def _pool_text(pool: Pool, obs: PoolObservation | None) -> str:
    if obs is None:
        return f"{pool.value}: no Deployment"
    return f"{pool.value}: {obs.ready}/{obs.replicas} ready"


def compute_status(
    *,
    generation: int,
    pools: Mapping[Pool, PoolObservation | None],
    desired: Mapping[Pool, int],
    problems: Sequence[Problem],
    previous: Mapping[str, Any] | None,
    now: datetime,
    url: str | None = None,
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """The reconciler's status for a reconcile that got as far as observing the pools.

    ``desired``: each pool's target (``desiredReplicas``); a pool missing from it has none.
    ``url``: the router's in-cluster URL; ``warnings``: the deprecations in the spec.
    """
    previous = as_map(previous)
    old_conditions = previous.get("conditions")
    old_conditions = old_conditions if isinstance(old_conditions, list) else []
    observed = {pool: obs for pool, obs in pools.items() if obs is not None}
    summary = "; ".join(_pool_text(pool, pools.get(pool)) for pool in Pool)

    serving = (
        len(observed) == len(Pool)
        and all(obs.ready >= obs.replicas for obs in observed.values())
        and observed[Pool.ROUTER].ready >= 1
        and observed[Pool.DECODE].ready >= 1
    )
    rolled_out = len(observed) == len(Pool) and all(o.rolled_out for o in observed.values())
    stalled = [f"{p.value}: {o.stalled}" for p, o in observed.items() if o.stalled]

    if problems:
        degraded = (True, problems[0].reason.value, " ".join(p.message for p in problems))
    elif stalled:
        degraded = (True, Reason.ROLLOUT_STALLED.value, "; ".join(stalled))
    else:
        degraded = (False, Reason.AS_EXPECTED.value, "all objects are as the spec asks")

    if rolled_out:
        progressing = (False, Reason.ROLLOUT_COMPLETE.value, summary)
    else:
        progressing = (True, Reason.ROLLING_OUT.value, summary)

    if serving:
        ready = (True, Reason.ALL_POOLS_READY.value, summary)
    else:
        ready = (False, Reason.POOLS_NOT_READY.value, summary)

    conditions = [
        condition(t, s, r, m, generation=generation, now=now, previous=old_conditions)
        for t, (s, r, m) in ((READY, ready), (PROGRESSING, progressing), (DEGRADED, degraded))
    ]
    pool_status: dict[str, Any] = {}
    for pool in Pool:
        entry: dict[str, Any] = {}
        obs = pools.get(pool)
        if obs is not None:
            entry.update(
                replicas=obs.replicas, readyReplicas=obs.ready, updatedReplicas=obs.updated
            )
        if pool in desired:
            entry["desiredReplicas"] = desired[pool]
        pool_status[pool.value] = entry
    out = {"observedGeneration": generation, "conditions": conditions, "pools": pool_status}
    if url is not None:
        out["url"] = url
    if warnings:
        out["warnings"] = list(warnings)
    return out


def invalid_status(
    *,
    generation: int,
    problems: Sequence[str],
    previous: Mapping[str, Any] | None,
    now: datetime,
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """Status for a spec that cannot be served: what to fix, and the deprecation
    ``warnings`` (which may explain it); the pools and the URL as last reported (they
    still run what the last valid spec asked for)."""
    previous = as_map(previous)
    old_conditions = previous.get("conditions")
    old_conditions = old_conditions if isinstance(old_conditions, list) else []
    message = "fix the spec: " + "; ".join(problems)
    left = "the spec is invalid; objects from the last valid spec are left as they are"
    conditions = [
        condition(
            READY,
            False,
            Reason.INVALID_SPEC.value,
            left,
            generation=generation,
            now=now,
            previous=old_conditions,
        ),
        condition(
            PROGRESSING,
            False,
            Reason.INVALID_SPEC.value,
            left,
            generation=generation,
            now=now,
            previous=old_conditions,
        ),
        condition(
            DEGRADED,
            True,
            Reason.INVALID_SPEC.value,
            message,
            generation=generation,
            now=now,
            previous=old_conditions,
        ),
    ]
    out: dict[str, Any] = {"observedGeneration": generation, "conditions": conditions}
    if isinstance(previous.get("pools"), Mapping):
        out["pools"] = dict(previous["pools"])
    if isinstance(previous.get("url"), str):
        out["url"] = previous["url"]
    if warnings:
        out["warnings"] = list(warnings)
    return out
