"""Reconcile one InferenceService: parse, render, apply, observe, report.

No kopf here: the handlers (``handlers.py``) call :meth:`Reconciler.reconcile`
and turn :class:`RetryLater` into kopf's ``TemporaryError``. All API calls go
through a :class:`~splitserve_operator.k8s.Cluster`.

Idempotent: objects are created when absent and patched only when they drift
from what render wants (three-way merge, see ``merge.py``); the status is
patched only when it changes. Reconciles of one object never overlap: a
trigger that arrives while one runs makes it run once more (:class:`Serializer`).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve_operator import merge
from splitserve_operator.k8s import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    AlreadyExists,
    ApiError,
    Cluster,
    Forbidden,
    Invalid,
    kind_of,
)
from splitserve_operator.render import (
    Desired,
    RenderInputs,
    ServiceRef,
    owns_desired_replicas,
    plan_replicas,
    render,
)
from splitserve_operator.render.names import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from splitserve_operator.spec import InferenceServiceSpec, Pool, SpecError, parse_spec
from splitserve_operator.status import (
    PoolObservation,
    Problem,
    Reason,
    compute_status,
    invalid_status,
    status_patch,
)

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name) of an InferenceService."""


class RetryLater(Exception):
    """A transient failure (API unreachable, throttled, 5xx): try again after ``delay`` s."""

    def __init__(self, message: str, delay: float = 5.0) -> None:
        super().__init__(message)
        self.delay = delay


class Action(StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"
    FAILED = "failed"


@dataclass
class Outcome:
    """What one reconcile did (for events, logs and tests)."""

    actions: dict[str, Action] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    status: dict[str, Any] | None = None
    skipped: str | None = None

    @property
    def created(self) -> list[str]:
        return [k for k, a in self.actions.items() if a == Action.CREATED]

    @property
    def patched(self) -> list[str]:
        return [k for k, a in self.actions.items() if a == Action.PATCHED]


def _map(value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else empty: bodies from the API may hold anything."""
    return value if isinstance(value, Mapping) else {}


def key_of(body: Mapping[str, Any]) -> Key:
    meta = _map(body.get("metadata"))
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    refs = _map(obj.get("metadata")).get("ownerReferences")
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _label(obj: Mapping[str, Any], key: str) -> str | None:
    value = _map(_map(obj.get("metadata")).get("labels")).get(key)
    return str(value) if value is not None else None


def _planned(body: Mapping[str, Any], pool: Pool) -> int | None:
    pools = _map(_map(body.get("status")).get("pools"))
    value = _map(pools.get(pool.value)).get("desiredReplicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
        meta = _map(body.get("metadata"))
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
        fresh = not _map(body.get("status")).get("observedGeneration")
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
        old = _map(body.get("status"))
        new = invalid_status(
            generation=generation, problems=problems, previous=old, now=self.clock()
        )
        outcome = Outcome(problems=[Problem(Reason.INVALID_SPEC, "; ".join(problems))], status=new)
        changed = self._write_status(body, new, old)
        if changed and self.record_events:
            self.cluster.event(
                body, "Warning", Reason.INVALID_SPEC.value, "fix the spec: " + "; ".join(problems)
            )
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
                live=_live_replicas(live[pool], ref),
                planned=_planned(body, pool),
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
            except _Conflict as exc:
                outcome.actions[label] = Action.FAILED
                outcome.problems.append(Problem(Reason.NAME_CONFLICT, str(exc)))
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
            if owns_desired_replicas(spec, pool) or _planned(body, pool) is None
        }
        old = _map(body.get("status"))
        new = compute_status(
            generation=generation,
            pools=observations,
            desired=desired_field,
            problems=outcome.problems,
            previous=old,
            now=self.clock(),
        )
        outcome.status = new
        self._write_status(body, new, old)
        self._record(body, outcome, repeat_problems=_degraded(new) != _degraded(old))
        return outcome

    def _ensure(
        self, desired: Desired, ref: ServiceRef, *, known: dict[str, Any] | None, fetch: bool
    ) -> tuple[Action, dict[str, Any] | None]:
        kind = kind_of(desired.manifest)
        actual = known
        if actual is None and fetch and not desired.create_only:
            actual = self.cluster.get(kind, desired.namespace, desired.name)
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
        owner = _controller_uid(actual)
        if owner != ref.uid:
            adoptable = (
                owner is None
                and _label(actual, LABEL_MANAGED_BY) == MANAGED_BY
                and _label(actual, LABEL_INSTANCE) == ref.name
            )
            if not adoptable:
                raise _Conflict(
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


def _degraded(status: Mapping[str, Any]) -> tuple[object, object, object]:
    conditions = status.get("conditions")
    for c in conditions if isinstance(conditions, list) else []:
        if isinstance(c, Mapping) and c.get("type") == "Degraded":
            return c.get("status"), c.get("reason"), c.get("message")
    return None, None, None


class _Conflict(Exception):
    """An object with our name exists and is not ours."""


def _live_replicas(deployment: Mapping[str, Any] | None, ref: ServiceRef) -> int | None:
    if not deployment or _controller_uid(deployment) != ref.uid:
        return None
    value = _map(deployment.get("spec")).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Serializer:
    """Runs reconciles of one key one at a time, coalescing triggers.

    :meth:`run` runs ``fn`` now and returns its result, after any run in progress
    for the key; :meth:`nudge` asks for a run without waiting: if one is in
    progress, it runs once more when done; otherwise ``fn`` runs now in the caller.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[Key, threading.Lock] = {}
        self._dirty: set[Key] = set()

    def _lock(self, key: Key) -> threading.Lock:
        with self._mutex:
            return self._locks.setdefault(key, threading.Lock())

    def run(self, key: Key, fn: Callable[[], Any]) -> Any:
        lock = self._lock(key)
        with lock:
            with self._mutex:
                self._dirty.discard(key)
            result = fn()
            self._drain(key, fn)
            return result

    def nudge(self, key: Key, fn: Callable[[], Any]) -> bool:
        """Returns False when a run in progress will pick the nudge up instead."""
        lock = self._lock(key)
        if not lock.acquire(blocking=False):
            with self._mutex:
                self._dirty.add(key)
            return False
        try:
            with self._mutex:
                self._dirty.discard(key)
            fn()
            self._drain(key, fn)
        finally:
            lock.release()
        return True

    def _drain(self, key: Key, fn: Callable[[], Any]) -> None:
        while True:
            with self._mutex:
                if key not in self._dirty:
                    return
                self._dirty.discard(key)
            fn()

    def forget(self, key: Key) -> None:
        with self._mutex:
            self._dirty.discard(key)
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():
                del self._locks[key]
