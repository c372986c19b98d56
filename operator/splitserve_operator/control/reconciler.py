"""Reconcile one InferenceService: parse, render, apply, observe, report.

No kopf here: the handlers (:mod:`.handlers`) call :meth:`Reconciler.reconcile`
and turn :class:`~.outcome.RetryLater` into kopf's ``TemporaryError``. All API calls
go through a :class:`~.k8s.Cluster`.

Idempotent: objects are created when absent and patched only when they drift
from what render wants (three-way merge, see :mod:`.merge`); the status is
patched only when it changes. Reconciles of one object never overlap: a
trigger that arrives while one runs makes it run once more (:class:`~.serializer.Serializer`,
used by the :class:`~.controller.Controller`).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from splitserve_operator.api.deprecations import deprecations
from splitserve_operator.api.fields import as_map
from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.status import (
    PoolObservation,
    Problem,
    Reason,
    compute_status,
    invalid_status,
    status_patch,
)
from splitserve_operator.api.values import Pool
from splitserve_operator.control import merge
from splitserve_operator.control.bodies import (
    controller_uid,
    degraded_condition,
    label_of,
    live_replicas,
    planned_replicas,
)
from splitserve_operator.control.k8s import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    AlreadyExists,
    ApiError,
    Cluster,
    Forbidden,
    Invalid,
    NotFound,
    kind_of,
)
from splitserve_operator.control.outcome import Action, NameConflict, Outcome, RetryLater
from splitserve_operator.control.serializer import key_of
from splitserve_operator.render.manifests import Desired, RenderInputs, render
from splitserve_operator.render.names import (
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    ServiceRef,
)
from splitserve_operator.render.replicas import owns_desired_replicas, plan_replicas
from splitserve_operator.render.routes import router_url

log = logging.getLogger(__name__)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


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
        retry_delay: float = 5.0,
    ) -> None:
        self.cluster = cluster
        self.retry_delay = retry_delay
        self.router_cluster_role = router_cluster_role
        self.clock = clock
        self.token_factory = token_factory
        self.record_events = record_events

    # -- entry point -------------------------------------------------------------------

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        meta = as_map(body.get("metadata"))
        if meta.get("deletionTimestamp"):
            return Outcome(skipped="being deleted: its objects go with it")
        generation = meta.get("generation")
        generation = generation if isinstance(generation, int) else 0
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
        try:
            return self._apply_all(body, ref, spec, generation, fresh)
        except ApiError as exc:
            if exc.transient:
                raise RetryLater(
                    f"API call failed, will retry: {exc}", delay=self.retry_delay
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
        changed = self._write_status(body, new, old)
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
        # Deployments first: their live replica counts feed the replica plan.
        live: dict[Pool, dict[str, Any] | None] = {}
        for pool in Pool:
            live[pool] = (
                None if fresh else self.cluster.get(DEPLOYMENT, ref.namespace, ref.deployment(pool))
            )
        replicas = {
            pool: plan_replicas(
                spec,
                pool,
                live=live_replicas(live[pool], ref),
                planned=planned_replicas(body, pool),
            )
            for pool in Pool
        }
        inputs = RenderInputs(
            replicas=replicas,
            token=self.token_factory(),
            router_cluster_role=self.router_cluster_role,
        )
        outcome = Outcome()
        results: dict[str, dict[str, Any] | None] = {}
        for desired in render(ref, spec, inputs):
            known = (
                live.get(Pool(desired.name.rsplit("-", 1)[1]))
                if desired.kind == "Deployment"
                else None
            )
            label = f"{desired.kind}/{desired.name}"
            try:
                action, obj = self._ensure(
                    desired, ref, known=known, fetch=not fresh and desired.kind != "Deployment"
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

        observations = {
            pool: PoolObservation.from_deployment(results.get(f"Deployment/{ref.deployment(pool)}"))
            for pool in Pool
        }
        desired_field = {
            pool: replicas[pool]
            for pool in Pool
            if owns_desired_replicas(spec, pool) or planned_replicas(body, pool) is None
        }
        old = as_map(body.get("status"))
        new = compute_status(
            generation=generation,
            pools=observations,
            desired=desired_field,
            problems=outcome.problems,
            previous=old,
            now=self.clock(),
            url=router_url(ref),
            warnings=deprecations(body.get("spec")),
        )
        outcome.status = new
        self._write_status(body, new, old)
        self._record(
            body, outcome, repeat_problems=degraded_condition(new) != degraded_condition(old)
        )
        self._announce_deprecations(body, new, old)
        return outcome

    def _ensure(
        self, desired: Desired, ref: ServiceRef, *, known: dict[str, Any] | None, fetch: bool
    ) -> tuple[Action, dict[str, Any] | None]:
        kind = kind_of(desired.manifest)
        actual = known
        if actual is None and fetch and not desired.create_only:
            actual = self.cluster.get(kind, desired.namespace, desired.name)
        if actual is None and desired.existing_only:
            return Action.UNCHANGED, None
        if actual is None:
            manifest = (
                desired.manifest
                if desired.create_only
                else merge.with_last_applied(desired.manifest)
            )
            try:
                return Action.CREATED, self.cluster.create(manifest)
            except AlreadyExists as exc:
                if desired.create_only:
                    return Action.UNCHANGED, None
                actual = self.cluster.get(kind, desired.namespace, desired.name)
                if actual is None:  # deleted in between: the next trigger recreates it
                    raise RetryLater(
                        f"{desired.kind}/{desired.name} vanished while applying",
                        delay=self.retry_delay,
                    ) from exc
        if desired.create_only:
            return Action.UNCHANGED, actual
        owner = controller_uid(actual)
        if owner != ref.uid:
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
        patch = merge.apply_patch(desired.manifest, actual)
        if not patch:
            return Action.UNCHANGED, actual
        patched = self.cluster.patch(kind, desired.namespace, desired.name, patch)
        return Action.PATCHED, patched or actual

    # -- status and events -------------------------------------------------------------

    def _write_status(
        self, body: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any]
    ) -> bool:
        patch = status_patch(new, old)
        if patch is None:
            return False
        namespace, name = key_of(body)
        try:
            self.cluster.patch(
                INFERENCE_SERVICE, namespace, name, {"status": patch}, subresource="status"
            )
        except ApiError as exc:
            if exc.status == 404:
                return False  # deleted meanwhile
            raise
        return True

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
                "patched (spec change or drift) " + ", ".join(sorted(outcome.patched)),
            )
        for problem in outcome.problems if repeat_problems else []:
            self.cluster.event(body, "Warning", problem.reason.value, problem.message)
