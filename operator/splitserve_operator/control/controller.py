"""What each trigger does: a change to an InferenceService, an event on one of its
Deployments or WorkerPools, the periodic resync. No kopf here either: the kopf handlers
in :mod:`.handlers` are one-line calls into :class:`Controller`.

A reconcile started by a background trigger (an event, the resync) that fails on a
transient API error is tried again after an exponential backoff with jitter
(:class:`~.backoff.Backoff`); kopf's own handlers get the same through
``TemporaryError(delay=...)``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.status import PoolObservation
from splitserve_operator.api.values import Pool
from splitserve_operator.control.backoff import Backoff
from splitserve_operator.control.cache import ServiceCache
from splitserve_operator.control.k8s import INFERENCE_SERVICE, ApiError, KubeClient
from splitserve_operator.control.outcome import Outcome, RetryLater
from splitserve_operator.control.ownership import needs_apply
from splitserve_operator.control.reconciler import Reconciler
from splitserve_operator.control.serializer import Key, Serializer, key_of
from splitserve_operator.render.manifests import RenderInputs, render_deployment
from splitserve_operator.render.names import LABEL_COMPONENT, LABEL_INSTANCE, ServiceRef

log = logging.getLogger(__name__)


class Controller:
    def __init__(
        self,
        client: KubeClient,
        reconciler: Reconciler,
        cache: ServiceCache | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.client = client
        self.reconciler = reconciler
        self.cache = cache or ServiceCache()
        self.serializer = Serializer()
        self.backoff = backoff or Backoff()
        self._lock = threading.Lock()
        self._attempts: dict[Key, int] = {}
        self._retries: dict[Key, threading.Timer] = {}
        self._closed = False

    def close(self) -> None:
        """Cancel the retries waiting to run."""
        with self._lock:
            self._closed = True
            timers = list(self._retries.values())
            self._retries.clear()
        for timer in timers:
            timer.cancel()

    # -- InferenceService ------------------------------------------------------------

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        """Reconcile now (after any run in progress); the kopf change handlers' path."""
        key = key_of(body)
        snapshot = dict(body)
        return self.serializer.run(key, lambda: self._reconcile_latest(key, snapshot))

    def _reconcile_latest(self, key: Key, fallback: Mapping[str, Any]) -> Outcome:
        body = self.cache.get(key)
        if body is None and self.cache.deleted(fallback):
            # a snapshot from before the delete: reconciling it would recreate what the
            # garbage collector just took
            return Outcome(skipped="deleted: its objects went with it")
        start = body or fallback
        outcome = self.reconciler.reconcile(start)
        if outcome.service:
            self.cache.refresh(
                outcome.service, since=as_map(start.get("metadata")).get("resourceVersion")
            )
        return outcome

    def nudge(self, key: Key) -> None:
        """Reconcile soon; coalesces with a run in progress. A transient failure is
        retried after a backoff; other errors are logged (the next trigger retries)."""
        body = self.cache.get(key)
        if body is None:
            return
        try:
            self.serializer.nudge(key, lambda: self._reconcile_latest(key, body))
        except RetryLater as exc:
            self._retry(key, exc)
            return
        except Exception:  # a background trigger must not die with one object's failure
            log.exception("reconcile of %s/%s failed; the next trigger retries", *key)
            return
        with self._lock:
            self._attempts.pop(key, None)

    def _retry(self, key: Key, exc: RetryLater) -> None:
        with self._lock:
            if self._closed or key in self._retries:
                return
            attempt = self._attempts.get(key, 0)
            self._attempts[key] = attempt + 1
            delay = self.backoff.delay(attempt, retry_after=exc.retry_after)
            timer = threading.Timer(delay, self._retry_now, (key,))
            timer.daemon = True
            self._retries[key] = timer
        log.warning("%s/%s: %s (retry %d in %.1f s)", *key, exc, attempt + 1, delay)
        timer.start()

    def _retry_now(self, key: Key) -> None:
        with self._lock:
            self._retries.pop(key, None)
        self.nudge(key)

    def observe_service(self, event_type: str | None, body: Mapping[str, Any]) -> Key:
        """Record the body (no I/O); the kopf change handlers reconcile spec changes."""
        key = self.cache.observe(event_type, body)
        if event_type == "DELETED":
            self.serializer.forget(key)
            with self._lock:
                self._attempts.pop(key, None)
                timer = self._retries.pop(key, None)
            if timer is not None:
                timer.cancel()
        return key

    def on_service_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        self.observe_service(event_type, body)

    @staticmethod
    def wants_reconcile(event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Whether this InferenceService event calls for a reconcile (no I/O): the watch
        lists it (``event_type`` None: the operator starts, or leads, or relists), or its
        status has not observed its spec's generation yet (made, or its spec changed). The
        echo of the operator's own status write, and one being deleted, do not."""
        if event_type == "DELETED":
            return False
        meta = as_map(body.get("metadata"))
        if meta.get("deletionTimestamp"):
            return False
        if event_type is None:
            return True
        observed = as_map(body.get("status")).get("observedGeneration")
        return observed is None or observed != meta.get("generation")

    # -- children: Deployments and WorkerPools ----------------------------------------

    def _owner(self, child: Mapping[str, Any]) -> tuple[Key, Mapping[str, Any], Pool] | None:
        """The owning InferenceService (key, cached body) and pool of a child we made."""
        meta = as_map(child.get("metadata"))
        labels = as_map(meta.get("labels"))
        instance, component = labels.get(LABEL_INSTANCE), labels.get(LABEL_COMPONENT)
        if not isinstance(instance, str) or component not in {p.value for p in Pool}:
            return None
        key = (str(meta.get("namespace") or ""), instance)
        owner = self.cache.peek(key)
        if owner is None:
            return None
        owner_uid = str(as_map(owner.get("metadata")).get("uid"))
        refs = [r for r in meta.get("ownerReferences") or [] if as_map(r).get("controller")]
        if refs and as_map(refs[0]).get("uid") != owner_uid:
            return None  # someone else's object, or a leftover of a deleted namesake
        return key, owner, Pool(str(component))

    def on_deployment_event(self, event_type: str | None, deployment: Mapping[str, Any]) -> None:
        triaged = self.triage_deployment(event_type, deployment)
        if triaged is not None:
            self.follow_up(event_type, *triaged)

    def triage_deployment(
        self, event_type: str | None, deployment: Mapping[str, Any]
    ) -> tuple[Key, str] | None:
        """(owner key, owner uid) when this Deployment event calls for a reconcile (or, for
        a deletion, for a look at the owner); None in the common case. No I/O."""
        found = self._owner(deployment)
        if found is None:
            return None
        key, owner, pool = found
        owner_uid = str(as_map(owner.get("metadata")).get("uid"))
        if event_type == "DELETED" or self._needs_reconcile(owner, pool, deployment):
            return key, owner_uid
        return None

    def triage_pool(
        self, event_type: str | None, worker_pool: Mapping[str, Any]
    ) -> tuple[Key, str] | None:
        """(owner key, owner uid) when a WorkerPool was scaled (its spec generation is not
        the one its Deployment follows) or deleted; None otherwise. No I/O."""
        found = self._owner(worker_pool)
        if found is None:
            return None
        key, owner, _pool = found
        owner_uid = str(as_map(owner.get("metadata")).get("uid"))
        meta, status = as_map(worker_pool.get("metadata")), as_map(worker_pool.get("status"))
        if event_type == "DELETED":
            return key, owner_uid
        if meta.get("generation") == 1 and "observedGeneration" not in status:
            return None  # just made: the reconcile that made it reports on it
        if status.get("observedGeneration") != meta.get("generation"):
            return key, owner_uid
        return None

    def follow_up(self, event_type: str | None, key: Key, owner_uid: str) -> None:
        """Reconcile the owner; for a deleted child only if the owner still lives."""
        if event_type == "DELETED" and not self._owner_alive(key, owner_uid):
            return
        self.nudge(key)

    def _owner_alive(self, key: Key, uid: object) -> bool:
        """Read the owner from the API: its child's deletion may be the garbage
        collector at work after the owner itself went (the cache may lag)."""
        try:
            fresh = self.client.get(INFERENCE_SERVICE, *key)
        except ApiError as exc:
            log.warning("cannot read %s/%s: %s", *key, exc)
            return True  # let the reconcile decide (it skips deleted objects)
        if fresh is None or as_map(fresh.get("metadata")).get("deletionTimestamp"):
            return False
        if as_map(fresh.get("metadata")).get("uid") != uid:
            return False
        self.cache.observe("MODIFIED", fresh)
        return True

    def _needs_reconcile(
        self, owner: Mapping[str, Any], pool: Pool, deployment: Mapping[str, Any]
    ) -> bool:
        status = as_map(owner.get("status"))
        if not status.get("observedGeneration"):
            return False  # the first reconcile is under way; it will observe this
        meta = as_map(owner.get("metadata"))
        try:
            spec = parse_spec(owner.get("spec"), name=meta.get("name"))
        except SpecError:
            return False
        # Status: does the owner's record of this pool still match the Deployment?
        obs = PoolObservation.from_deployment(deployment)
        recorded = as_map(as_map(status.get("pools")).get(pool.value))
        if obs is not None and (
            recorded.get("replicas") != obs.replicas
            or recorded.get("readyReplicas") != obs.ready
            or recorded.get("updatedReplicas") != obs.updated
        ):
            return True
        if obs is not None and obs.stalled:
            return True
        # Drift: would an apply change this Deployment? Its replicas are checked as they
        # are (a pool's size changes through its WorkerPool, whose events come here too):
        # a writer that changed them has taken the field, and that shows as drift.
        ref = ServiceRef(
            str(meta.get("name")), str(meta.get("namespace") or ""), str(meta.get("uid") or "")
        )
        live = as_map(deployment.get("spec")).get("replicas")
        replicas = {p: live if isinstance(live, int) else 1 for p in Pool}
        inputs = RenderInputs(
            replicas=replicas, token="-", router_cluster_role=self.reconciler.router_cluster_role
        )
        desired = render_deployment(ref, spec, inputs, pool)
        return needs_apply(desired, deployment, self.reconciler.field_manager)

    # -- periodic resync -------------------------------------------------------------

    def resync_all(self) -> int:
        keys = self.cache.keys()
        for key in keys:
            self.nudge(key)
        return len(keys)
