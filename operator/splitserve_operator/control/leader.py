"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go does it, so that of
the operator's replicas exactly one reconciles, plans and scales at a time.

Why a Lease and not kopf's peering: kopf's peering pauses an operator when it sees one of
*higher* priority, and pauses *every* operator when two share a priority (two replicas of
one Deployment do), so it needs a distinct priority per pod and a KopfPeering CRD; it has
no lock (an operator acts before it has seen its peers), a dead peer blocks the others
for its whole lifetime (60 s by default), and it pauses only kopf's handlers, not the
operator's own threads (the resync, the autoscaling loop). A Lease gives one holder, a
handover bounded by its duration, and a gate the operator holds before it starts
anything.

The rules (client-go's ``leaderelection``):

- The lease is free when it has no holder, or when its record has not changed for
  ``duration_s`` *as this process observed it* (its own monotonic clock: no trust in other
  machines' clocks).
- Taking or renewing it is a write with the ``resourceVersion`` precondition; a 409 means
  someone else won.
- The leader renews every ``retry_period_s`` and gives up (stops everything) when it has
  not renewed for ``renew_deadline_s`` (shorter than ``duration_s``, so it stops before a
  standby may take over); a clean stop releases the lease so a standby takes it at once.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, Protocol

from splitserve_operator.api.fields import as_map, count
from splitserve_operator.control.config import LeaseConfig
from splitserve_operator.control.k8s import LEASE, AlreadyExists, ApiError, Conflict, Kind

log = logging.getLogger(__name__)

MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"
"""The Lease's ``MicroTime`` format."""


class LeaseClient(Protocol):
    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...
    def patch(self, kind: Kind, namespace: str, name: str, patch: Any) -> dict[str, Any]: ...


class Step(StrEnum):
    TAKE = "take"
    RENEW = "renew"
    WAIT = "wait"


def decide(
    spec: Mapping[str, Any], identity: str, *, unchanged_for: float, duration_s: float
) -> Step:
    """What to do with a lease whose ``spec`` has not changed for ``unchanged_for`` s."""
    holder = spec.get("holderIdentity")
    if holder == identity:
        return Step.RENEW
    held_for = count(spec.get("leaseDurationSeconds"), 0) or duration_s
    if holder and unchanged_for < held_for:
        return Step.WAIT
    return Step.TAKE


class LeaderElector:
    """Takes and keeps the lease; thread-safe enough for one thread to run it."""

    def __init__(
        self,
        client: LeaseClient,
        config: LeaseConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        beat: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self.config = config
        self._clock = clock
        self._wall = wall_clock
        self._beat = beat
        self._seen: tuple[object, float] | None = None
        """(resourceVersion of the lease as last read, when this process first saw it)."""
        self.leading = False
        self.lost = threading.Event()
        """Set when leadership was held and then lost (not on a clean release)."""
        self._last_renewal = 0.0

    def _record(self, at: dt.datetime, transitions: int, acquired: str) -> dict[str, Any]:
        stamp = at.strftime(MICRO_TIME)
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, math.ceil(self.config.duration_s)),
            "acquireTime": acquired or stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    def try_once(self) -> bool:
        """One attempt to take or renew the lease; whether this replica holds it now."""
        self._beat()
        cfg = self.config
        lease = self.client.get(LEASE, cfg.namespace, cfg.name)
        now = self._clock()
        if lease is None:
            body = {
                "apiVersion": LEASE.api_version,
                "kind": LEASE.kind,
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": self._record(self._wall(), 0, ""),
            }
            try:
                made = self.client.create(body)
            except AlreadyExists:
                return False
            self._seen = (as_map(made.get("metadata")).get("resourceVersion"), now)
            return self._now_leading(now)
        meta, spec = as_map(lease.get("metadata")), as_map(lease.get("spec"))
        version = meta.get("resourceVersion")
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, now)
        step = decide(
            spec, cfg.identity, unchanged_for=now - self._seen[1], duration_s=cfg.duration_s
        )
        if step is Step.WAIT:
            self.leading = False
            return False
        transitions = count(spec.get("leaseTransitions"))
        acquired = str(spec.get("acquireTime") or "") if step is Step.RENEW else ""
        if step is Step.TAKE and spec.get("holderIdentity"):
            transitions += 1
        patch = {
            "metadata": {"resourceVersion": version},
            "spec": self._record(self._wall(), transitions, acquired),
        }
        try:
            renewed = self.client.patch(LEASE, cfg.namespace, cfg.name, patch)
        except Conflict:
            self.leading = False
            return False
        self._seen = (as_map(renewed.get("metadata")).get("resourceVersion"), now)
        if step is Step.TAKE:
            log.info("took the lease %s/%s as %s", cfg.namespace, cfg.name, cfg.identity)
        return self._now_leading(now)

    def _now_leading(self, now: float) -> bool:
        self.leading = True
        self._last_renewal = now
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this replica holds the lease (True) or ``stop`` is set (False)."""
        log.info("waiting for the lease %s/%s as %s", self.config.namespace, self.config.name,
                 self.config.identity)  # fmt: skip
        while not stop.is_set():
            try:
                if self.try_once():
                    return True
            except ApiError as exc:
                log.warning("could not read the lease, trying again: %s", exc)
            stop.wait(self.config.retry_period_s)
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew until ``stop`` is set; call ``on_lost`` (once) if the lease is lost."""
        while not stop.wait(self.config.retry_period_s):
            try:
                if self.try_once():
                    continue
                reason = "another replica holds it"
            except ApiError as exc:
                if self._clock() - self._last_renewal < self.config.renew_deadline_s:
                    log.warning("could not renew the lease, trying again: %s", exc)
                    continue
                reason = f"no renewal for {self.config.renew_deadline_s} s ({exc})"
            self.leading = False
            self.lost.set()
            log.error("lost the lease %s/%s: %s; stopping", self.config.namespace,
                      self.config.name, reason)  # fmt: skip
            on_lost()
            return

    def release(self) -> None:
        """Hand the lease back (a clean stop), so that a standby takes it at once."""
        if not self.leading or self.lost.is_set():
            return
        self.leading = False
        cfg = self.config
        try:
            lease = self.client.get(LEASE, cfg.namespace, cfg.name)
            spec = as_map((lease or {}).get("spec"))
            if lease is None or spec.get("holderIdentity") != cfg.identity:
                return
            self.client.patch(
                LEASE,
                cfg.namespace,
                cfg.name,
                {
                    "metadata": {"resourceVersion": as_map(lease.get("metadata")).get(
                        "resourceVersion")},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1,
                             "renewTime": self._wall().strftime(MICRO_TIME)},
                },
            )  # fmt: skip
            log.info("released the lease %s/%s", cfg.namespace, cfg.name)
        except ApiError as exc:
            log.warning("could not release the lease (a standby takes it when it expires): %s",
                        exc)  # fmt: skip
