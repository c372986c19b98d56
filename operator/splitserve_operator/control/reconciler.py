"""Reconcile one InferenceService: parse, render, apply, observe, report.

No kopf here: the handlers (:mod:`.handlers`) call :meth:`Reconciler.reconcile`
and turn :class:`~.outcome.RetryLater` into kopf's ``TemporaryError``. All API calls
go through a :class:`~.k8s.Cluster`.

Every child is written with server-side apply under the operator's field manager
(:data:`~.k8s.FIELD_MANAGER`), with ``force`` where it owns the field: the API server
merges, keeps what other writers set, and removes what the operator stopped asking for.
A child is applied only when :func:`~.ownership.needs_apply` says the apply would change
it (what the operator owns of it differs from what render wants, or another writer took
one of its fields), so an unchanged service costs reads only. The first reconcile applies
without ``force``: an object of the same name made by someone else then conflicts
instead of being taken over. The status is applied the same way on the status
subresource, holding only the reconciler's own conditions.

The token Secret is the one exception: created once (the operator may not read
Secrets), again only while a pool is not fully ready (a pod may be waiting for it).

Reconciles of one object never overlap: a trigger that arrives while one runs makes it
run once more (:class:`~.serializer.Serializer`, used by the :class:`~.controller.Controller`).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from splitserve_operator.api.deprecations import deprecations
from splitserve_operator.api.fields import as_int, as_map, count
from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.status import (
    PoolObservation,
    Problem,
    Reason,
    compute_status,
    invalid_status,
)
from splitserve_operator.api.values import WORKER_POOLS, Pool
from splitserve_operator.control.bodies import controller_uid, degraded_condition, label_of
from splitserve_operator.control.k8s import (
    DEPLOYMENT,
    FIELD_MANAGER,
    JSON_PATCH,
    WORKER_POOL,
    AlreadyExists,
    ApiError,
    Cluster,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    kind_of,
)
from splitserve_operator.control.outcome import Action, NameConflict, Outcome, RetryLater
from splitserve_operator.control.ownership import needs_apply, owners, upgrade_patch
from splitserve_operator.render.manifests import Desired, RenderInputs, render
from splitserve_operator.render.names import (
    ANNOTATION_REQUESTED_REPLICAS,
    API_VERSION,
    KIND,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    ServiceRef,
)
from splitserve_operator.render.pools import worker_pool_status
from splitserve_operator.render.replicas import PoolTarget, deployment_replicas, pool_target
from splitserve_operator.render.routes import router_url

log = logging.getLogger(__name__)

REPLICAS_FIELD = ("spec", "replicas")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _target(
    spec: InferenceServiceSpec, pool: Pool, live: Mapping[str, Any] | None, manager: str
) -> PoolTarget:
    meta = as_map((live or {}).get("metadata"))
    recorded = as_map(meta.get("annotations")).get(ANNOTATION_REQUESTED_REPLICAS)
    return pool_target(
        spec,
        pool,
        exists=live is not None,
        live=as_int(as_map((live or {}).get("spec")).get("replicas")),
        recorded=int(recorded) if isinstance(recorded, str) and recorded.isdigit() else None,
        ours=live is not None and manager in owners(live, REPLICAS_FIELD),
    )


def _fully_ready(deployment: Mapping[str, Any] | None) -> bool:
    obs = PoolObservation.from_deployment(deployment)
    return obs is not None and obs.ready >= obs.replicas


class Reconciler:
    """Drives one InferenceService to its desired state. Thread-safe."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        router_cluster_role: str = "splitserve-router",
        clock: Callable[[], dt.datetime] = _now,
        token_factory: Callable[[], str] = lambda: secrets.token_urlsafe(32),
        record_events: bool = True,
        field_manager: str = FIELD_MANAGER,
    ) -> None:
        self.cluster = cluster
        self.router_cluster_role = router_cluster_role
        self.clock = clock
        self.token_factory = token_factory
        self.record_events = record_events
        self.field_manager = field_manager

    # -- entry point -------------------------------------------------------------------

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        meta = as_map(body.get("metadata"))
        if meta.get("deletionTimestamp"):
            return Outcome(skipped="being deleted: its objects go with it")
        generation = count(meta.get("generation"))
        try:
            try:
                spec = parse_spec(body.get("spec"), name=meta.get("name", ""))
            except SpecError as exc:
                return self._report_invalid(body, generation, exc.problems)
            ref = ServiceRef(
                name=str(meta["name"]),
                namespace=str(meta.get("namespace") or "default"),
                uid=str(meta.get("uid") or ""),
            )
            fresh = not as_map(body.get("status")).get("observedGeneration")
            return self._apply_all(body, ref, spec, generation, fresh)
        except ApiError as exc:
            if exc.transient:
                raise RetryLater(
                    f"API call failed, will retry: {exc}", retry_after=exc.retry_after
                ) from exc
            raise

    # -- invalid spec ------------------------------------------------------------------

    def _report_invalid(
        self, body: Mapping[str, Any], generation: int, problems: list[str]
    ) -> Outcome:
        old = as_map(body.get("status"))
        new = invalid_status(
            generation=generation,
            problems=problems,
            previous=old,
            now=self.clock(),
            warnings=deprecations(body.get("spec")),
        )
        outcome = Outcome(problems=[Problem(Reason.INVALID_SPEC, "; ".join(problems))], status=new)
        outcome.service = self._write_status(body, new)
        changed = outcome.service is not None
        if changed and self.record_events:
            self.cluster.event(
                body, "Warning", Reason.INVALID_SPEC.value, "fix the spec: " + "; ".join(problems)
            )
        self._announce_deprecations(body, new, old)
        return outcome

    # -- apply -------------------------------------------------------------------------

    def _apply_all(
        self,
        body: Mapping[str, Any],
        ref: ServiceRef,
        spec: InferenceServiceSpec,
        generation: int,
        fresh: bool,
    ) -> Outcome:
        # The pools and Deployments first: who scales each pool decides their replicas.
        pools_live: dict[Pool, dict[str, Any] | None] = {}
        deployments_live: dict[Pool, dict[str, Any] | None] = {}
        for pool in WORKER_POOLS:
            pools_live[pool] = (
                None
                if fresh
                else self.cluster.get(WORKER_POOL, ref.namespace, ref.worker_pool(pool))
            )
        for pool in Pool:
            deployments_live[pool] = (
                None if fresh else self.cluster.get(DEPLOYMENT, ref.namespace, ref.deployment(pool))
            )
        targets = {
            pool: _target(spec, pool, pools_live[pool], self.field_manager) for pool in WORKER_POOLS
        }
        replicas = {
            pool: deployment_replicas(spec, pool, targets[pool].target if pool in targets else None)
            for pool in Pool
        }
        inputs = RenderInputs(
            replicas=replicas,
            token=self.token_factory(),
            router_cluster_role=self.router_cluster_role,
            pools=targets,
        )
        need_secret = fresh or not all(_fully_ready(d) for d in deployments_live.values())
        outcome = Outcome()
        results: dict[str, dict[str, Any] | None] = {}
        for desired in render(ref, spec, inputs):
            label = f"{desired.kind}/{desired.name}"
            if desired.create_only and not need_secret:
                outcome.actions[label] = Action.UNCHANGED
                continue
            known_kinds = {"Deployment": deployments_live, "WorkerPool": pools_live}
            known = None
            # the pools' objects were read above; the flex Deployment, not a Pool, is not
            component = desired.name.rsplit("-", 1)[1]
            listed = desired.kind in known_kinds and component in {p.value for p in Pool}
            if listed:
                known = known_kinds[desired.kind].get(Pool(component))
            try:
                action, obj = self._ensure(
                    desired,
                    ref,
                    known=known,
                    fetch=not fresh and not listed,
                )
            except Forbidden as exc:
                outcome.actions[label] = Action.FAILED
                outcome.problems.append(
                    Problem(
                        Reason.FORBIDDEN,
                        f"the operator may not write {label}: {exc.message}; check the chart's "
                        "ClusterRole",
                    )
                )
                continue
            except Invalid as exc:
                outcome.actions[label] = Action.FAILED
                outcome.problems.append(
                    Problem(
                        Reason.APPLY_FAILED,
                        f"the API server rejected {label}: {exc.message}; fix the spec fields "
                        "it names",
                    )
                )
                continue
            except NameConflict as exc:
                outcome.actions[label] = Action.FAILED
                outcome.problems.append(Problem(Reason.NAME_CONFLICT, str(exc)))
                continue
            except NotFound as exc:  # a kind the cluster does not serve (no Gateway API)
                outcome.actions[label] = Action.FAILED
                outcome.problems.append(
                    Problem(
                        Reason.APPLY_FAILED,
                        f"the API server does not serve {desired.kind} "
                        f"({desired.api_version}): {exc.message}; install its CRDs or drop the "
                        "spec field that asks for it",
                    )
                )
                continue
            outcome.actions[label] = action
            results[label] = obj

        deployments = {pool: results.get(f"Deployment/{ref.deployment(pool)}") for pool in Pool}
        for pool in WORKER_POOLS:
            self._pool_status(ref, pool, results.get(f"WorkerPool/{ref.worker_pool(pool)}"),
                              deployments[pool])  # fmt: skip
        observations = {pool: PoolObservation.from_deployment(deployments[pool]) for pool in Pool}
        desired_counts = {
            pool: targets[pool].target if pool in targets else replicas[pool] for pool in Pool
        }
        old = as_map(body.get("status"))
        new = compute_status(
            generation=generation,
            pools=observations,
            desired=desired_counts,
            problems=outcome.problems,
            previous=old,
            now=self.clock(),
            url=router_url(ref),
            warnings=deprecations(body.get("spec")),
        )
        outcome.status = new
        outcome.service = self._write_status(body, new)
        self._record(
            body, outcome, repeat_problems=degraded_condition(new) != degraded_condition(old)
        )
        self._announce_deprecations(body, new, old)
        return outcome

    def _ensure(
        self,
        desired: Desired,
        ref: ServiceRef,
        *,
        known: dict[str, Any] | None,
        fetch: bool,
    ) -> tuple[Action, dict[str, Any] | None]:
        kind = kind_of(desired.manifest)
        if desired.create_only:
            try:
                return Action.CREATED, self.cluster.create(desired.manifest)
            except AlreadyExists:
                return Action.UNCHANGED, None
        actual = known
        if actual is None and fetch:
            actual = self.cluster.get(kind, desired.namespace, desired.name)
        if actual is None and desired.existing_only:
            return Action.UNCHANGED, None
        if actual is None:
            # Absent as far as we know: apply without force, so that an object of this
            # name someone else made conflicts instead of being taken over.
            try:
                applied = self.cluster.apply(
                    desired.manifest, field_manager=self.field_manager, force=False
                )
                return (Action.CREATED if applied.created else Action.PATCHED), applied.obj
            except Conflict:
                actual = self.cluster.get(kind, desired.namespace, desired.name)
                if actual is None:  # deleted in between: the next trigger recreates it
                    raise RetryLater(
                        f"{desired.kind}/{desired.name} vanished while applying"
                    ) from None
        self._check_ownership(desired, ref, actual)
        upgrade = upgrade_patch(actual, self.field_manager)
        if upgrade is not None:  # made by a version that merged: apply from here on
            actual = self.cluster.patch(
                kind, desired.namespace, desired.name, upgrade, content_type=JSON_PATCH
            )
        if not needs_apply(desired.manifest, actual, self.field_manager):
            return Action.UNCHANGED, actual
        applied = self.cluster.apply(desired.manifest, field_manager=self.field_manager, force=True)
        return Action.PATCHED, applied.obj

    @staticmethod
    def _check_ownership(desired: Desired, ref: ServiceRef, actual: Mapping[str, Any]) -> None:
        owner = controller_uid(actual)
        if owner == ref.uid:
            return
        adoptable = (
            owner is None
            and label_of(actual, LABEL_MANAGED_BY) == MANAGED_BY
            and label_of(actual, LABEL_INSTANCE) == ref.name
        )
        if not adoptable:
            raise NameConflict(
                f"{desired.kind}/{desired.name} already exists and belongs to "
                f"{'another owner' if owner else 'nobody'}; delete or rename it, or rename "
                "the InferenceService"
            )

    def _pool_status(
        self,
        ref: ServiceRef,
        pool: Pool,
        worker_pool: Mapping[str, Any] | None,
        deployment: Mapping[str, Any] | None,
    ) -> None:
        """Report the Deployment's pods on the WorkerPool (what its scale subresource reads),
        once the Deployment controller has reported on them."""
        if worker_pool is None or deployment is None or "status" not in deployment:
            return
        if controller_uid(worker_pool) != ref.uid:
            return
        status = as_map(deployment.get("status"))
        manifest = worker_pool_status(
            ref,
            pool,
            generation=count(as_map(worker_pool.get("metadata")).get("generation")),
            replicas=count(status.get("replicas")),
            ready=count(status.get("readyReplicas")),
        )
        if needs_apply(manifest, worker_pool, self.field_manager, "status"):
            self.cluster.apply(
                manifest, field_manager=self.field_manager, force=True, subresource="status"
            )

    # -- status and events -------------------------------------------------------------

    def _write_status(
        self, body: Mapping[str, Any], new: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Apply the reconciler's part of the status when it differs from what it owns;
        the InferenceService as the write answered, or None when nothing was written."""
        meta = as_map(body.get("metadata"))
        manifest = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
            "status": dict(new),
        }
        if not needs_apply(manifest, body, self.field_manager, "status"):
            return None
        try:
            applied = self.cluster.apply(
                manifest, field_manager=self.field_manager, force=True, subresource="status"
            )
        except ApiError as exc:
            if exc.status == 404:
                return None  # deleted meanwhile
            raise
        return applied.obj

    def _announce_deprecations(
        self, body: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any]
    ) -> None:
        """One Warning Event when the deprecated fields in use change (not on every
        reconcile that still finds them)."""
        warnings = new.get("warnings") or []
        if self.record_events and warnings and warnings != (old.get("warnings") or []):
            self.cluster.event(body, "Warning", "DeprecatedFields", "; ".join(warnings))

    def _record(self, body: Mapping[str, Any], outcome: Outcome, *, repeat_problems: bool) -> None:
        """Events for what changed; a problem is announced when the Degraded condition
        changes, not again on every reconcile that still meets it."""
        if not self.record_events:
            return
        if outcome.created:
            self.cluster.event(
                body, "Normal", "Created", "created " + ", ".join(sorted(outcome.created))
            )
        if outcome.patched:
            self.cluster.event(
                body,
                "Normal",
                "Updated",
                "applied (spec change or drift) " + ", ".join(sorted(outcome.patched)),
            )
        for problem in outcome.problems if repeat_problems else []:
            self.cluster.event(body, "Warning", problem.reason.value, problem.message)
