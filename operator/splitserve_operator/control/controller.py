"""What each trigger does: a change to an InferenceService, an event on one of its
Deployments, a planner decision, the periodic resync. No kopf here either: the
kopf handlers in :mod:`.handlers` are one-line calls into :class:`Controller`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.status import PoolObservation
from splitserve_operator.api.values import SCALED_POOLS, Pool
from splitserve_operator.control import merge
from splitserve_operator.control.cache import ServiceCache
from splitserve_operator.control.k8s import INFERENCE_SERVICE, ApiError, KubeClient
from splitserve_operator.control.outcome import Outcome
from splitserve_operator.control.reconciler import Reconciler
from splitserve_operator.control.serializer import Key, Serializer, key_of
from splitserve_operator.render.manifests import RenderInputs, render_deployment
from splitserve_operator.render.names import LABEL_COMPONENT, LABEL_INSTANCE, ServiceRef
from splitserve_operator.render.replicas import plan_replicas

log = logging.getLogger(__name__)


class Controller:
    def __init__(
        self, client: KubeClient, reconciler: Reconciler, cache: ServiceCache | None = None
    ) -> None:
        self.client = client
        self.reconciler = reconciler
        self.cache = cache or ServiceCache()
        self.serializer = Serializer()

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
        return self.reconciler.reconcile(body or fallback)

    def nudge(self, key: Key) -> None:
        """Reconcile soon; coalesces with a run in progress. Errors are logged."""
        body = self.cache.get(key)
        if body is None:
            return
        try:
            self.serializer.nudge(key, lambda: self._reconcile_latest(key, body))
        except Exception:  # a background trigger must not die with one object's failure
            log.exception("reconcile of %s/%s failed; the next trigger retries", *key)

    def on_service_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self.observe_service(event_type, body)
        if key is not None:
            self.nudge(key)

    def observe_service(self, event_type: str | None, body: Mapping[str, Any]) -> Key | None:
        """Record the body; the key to reconcile when the planner moved a pool. No I/O."""
        key = self.cache.observe(event_type, body)
        if event_type == "DELETED":
            self.serializer.forget(key)
            return None
        return key if self._planner_moved(body) else None

    @staticmethod
    def _planner_moved(body: Mapping[str, Any]) -> bool:
        """The planner set ``desiredReplicas`` to something the Deployment lacks."""
        status = as_map(body.get("status"))
        if not status.get("observedGeneration"):
            return False
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return False
        if not spec.autoscaling.enabled:
            return False
        pools = as_map(status.get("pools"))
        for pool in SCALED_POOLS:
            entry = as_map(pools.get(pool.value))
            planned, applied = entry.get("desiredReplicas"), entry.get("replicas")
            if (
                isinstance(planned, int)
                and planned >= 0
                and applied != plan_replicas(spec, pool, planned=planned)
            ):
                return True
        return False

    # -- Deployments -----------------------------------------------------------------

    def on_deployment_event(self, event_type: str | None, deployment: Mapping[str, Any]) -> None:
        triaged = self.triage_deployment(event_type, deployment)
        if triaged is not None:
            self.follow_up(event_type, *triaged)

    def triage_deployment(
        self, event_type: str | None, deployment: Mapping[str, Any]
    ) -> tuple[Key, str] | None:
        """(owner key, owner uid) when this Deployment event calls for a reconcile (or, for
        a deletion, for a look at the owner); None in the common case. No I/O."""
        meta = as_map(deployment.get("metadata"))
        labels = as_map(meta.get("labels"))
        instance, component = labels.get(LABEL_INSTANCE), labels.get(LABEL_COMPONENT)
        if not isinstance(instance, str) or component not in {p.value for p in Pool}:
            return None
        key = (str(meta.get("namespace") or ""), instance)
        owner = self.cache.get(key)
        if owner is None:
            return None
        owner_uid = str(as_map(owner.get("metadata")).get("uid"))
        refs = [r for r in meta.get("ownerReferences") or [] if as_map(r).get("controller")]
        if refs and as_map(refs[0]).get("uid") != owner_uid:
            return None  # someone else's Deployment, or a leftover of a deleted namesake
        if event_type == "DELETED" or self._needs_reconcile(owner, Pool(component), deployment):
            return key, owner_uid
        return None

    def follow_up(self, event_type: str | None, key: Key, owner_uid: str) -> None:
        """Reconcile the owner; for a deleted Deployment only if the owner still lives."""
        if event_type == "DELETED" and not self._owner_alive(key, owner_uid):
            return
        self.nudge(key)

    def _owner_alive(self, key: Key, uid: object) -> bool:
        """Read the owner from the API: its Deployment's deletion may be the garbage
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
        # Drift: would an apply change this Deployment?
        ref = ServiceRef(
            str(meta.get("name")), str(meta.get("namespace") or ""), str(meta.get("uid") or "")
        )
        live = as_map(deployment.get("spec")).get("replicas")
        replicas = {
            p: plan_replicas(
                spec,
                p,
                live=live if p == pool and isinstance(live, int) else None,
                planned=as_map(as_map(status.get("pools")).get(p.value)).get("desiredReplicas"),
            )
            for p in Pool
        }
        inputs = RenderInputs(
            replicas=replicas, token="-", router_cluster_role=self.reconciler.router_cluster_role
        )
        desired = render_deployment(ref, spec, inputs, pool)
        return bool(merge.apply_patch(desired, deployment))

    # -- periodic resync -------------------------------------------------------------

    def resync_all(self) -> int:
        keys = self.cache.keys()
        for key in keys:
            self.nudge(key)
        return len(keys)


class Resync:
    """A thread that calls :meth:`Controller.resync_all` every ``interval`` seconds."""

    def __init__(self, controller: Controller, interval: float) -> None:
        self.controller = controller
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="splitserve-resync", daemon=True)

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            count = self.controller.resync_all()
            log.debug("resynced %d InferenceServices", count)
