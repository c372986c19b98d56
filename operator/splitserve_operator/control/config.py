"""The operator's knobs: one dataclass, each field with its unit and why."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.render.names import API_VERSION, KIND, LABEL_MANAGED_BY, MANAGED_BY

if TYPE_CHECKING:
    import kopf


@dataclass(frozen=True)
class LeaseConfig:
    """Leader election on a Lease (see :mod:`.leader`); the defaults are client-go's."""

    namespace: str
    """Where the Lease lives: the operator's own namespace."""
    identity: str
    """This replica (its pod name); recorded as ``holderIdentity``."""
    name: str = "splitserve-operator"
    duration_s: float = 15.0
    """Seconds (s) a standby waits on an unchanged lease before taking it."""
    renew_deadline_s: float = 10.0
    """Seconds (s) the leader keeps acting without a successful renewal."""
    retry_period_s: float = 2.0
    """Seconds (s) between attempts to take or renew the lease."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration "
                f"(got {self.retry_period_s}, {self.renew_deadline_s}, {self.duration_s})"
            )


DEPLOYMENT_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
"""The label selector on the Deployment watch: the API server sends only the operator's
own Deployments, not every Deployment of the cluster."""


@dataclass
class OperatorConfig:
    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty: the whole cluster (what the chart's ClusterRole is for)."""

    router_cluster_role: str = "splitserve-router"
    """The chart's read-only ClusterRole a router is bound to in its namespace (pods and
    EndpointSlices), so it can discover its workers. The operator holds only ``bind`` on
    it, never the permissions themselves."""

    resync_seconds: float = 300.0
    """Seconds between full reconciles of every InferenceService (0: never). Deployments
    are watched and repaired at once; this catches drift in the objects that are not
    watched (Services, ConfigMap, NetworkPolicy, disruption budgets, RBAC) without
    watching every Service and Secret in the cluster."""

    workers: int = 16
    """Threads that run reconciles. A reconcile mostly waits on the API server, so more
    threads than cores pay off; 16 creates 200 InferenceServices in a few seconds."""

    request_timeout: float = 30.0
    """Seconds (s) one API call may take before it counts as failed and is retried."""

    retry_base_seconds: float = 1.0
    """Seconds (s) before the first retry of a reconcile that failed on a transient API
    error (no answer, 409, 429, 5xx); each further retry waits twice as long, with jitter,
    and at least the server's ``Retry-After``."""

    retry_max_seconds: float = 300.0
    """Seconds (s) no retry waits longer than (the resync also catches up by then)."""

    leader_election: LeaseConfig | None = None
    """Elect one active replica through a Lease (what the chart's two replicas do); None:
    this process acts at once, alone (a single replica, a local run)."""

    watch_timeout: float | None = 300.0
    """Seconds (s) a watch request stays open before kopf reopens it; None: forever."""

    liveness_endpoint: str | None = None
    """``http://0.0.0.0:8080/healthz`` serves the liveness probe, on a standby too (see
    :mod:`.health`); None: no endpoint."""

    record_events: bool = True
    """Record Kubernetes Events (created, drift repaired, invalid spec) on the resource."""

    kopf_event_level: int = logging.WARNING
    """kopf posts its own log lines as Events from this level up: WARNING keeps its
    failures and drops one "handler succeeded" Event per change."""

    annotation_prefix: str = "kopf.splitserve.io"
    """Where kopf would keep its last-handled state on each resource (annotations only: the
    CRD's status schema is ours alone). The handlers are level-triggered (no kopf change
    handler), so kopf writes none; an older version's annotations stay unread."""

    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    """The planner's loop: timer resolution, PromQL windows, the operator's metrics
    port, planner knobs (see :mod:`.autoscaling.config`)."""

    extra: dict[str, str] = field(default_factory=dict)

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def kopf_settings(self) -> kopf.OperatorSettings:
        import kopf  # here, so that `splitserve --help` does not load kopf

        from splitserve_operator.control.diffbase import LeanDiffBase

        settings = kopf.OperatorSettings()
        settings.peering.standalone = True
        settings.scanning.disabled = True
        settings.execution.max_workers = self.workers
        settings.posting.level = self.kopf_event_level
        settings.posting.enabled = self.record_events
        settings.watching.server_timeout = self.watch_timeout
        settings.watching.client_timeout = (
            None if self.watch_timeout is None else self.watch_timeout + 30
        )
        settings.networking.request_timeout = self.request_timeout + 30
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=self.annotation_prefix
        )
        settings.persistence.diffbase_storage = LeanDiffBase(
            prefix=self.annotation_prefix,
            key="last-handled-configuration",
            changing_kinds=[(API_VERSION, KIND)],
        )
        # Server-side filtering: kopf's `labels=` on a handler filters after the API server
        # sent everything; a label selector on the watch itself makes the server filter.
        settings.watching.label_selectors[("apps", "deployments")] = DEPLOYMENT_SELECTOR
        return settings
