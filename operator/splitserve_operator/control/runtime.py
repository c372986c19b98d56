"""Running the operator (``python -m splitserve_operator``, ``splitserve operator``):
:func:`build` makes one from its settings with a fresh kopf registry, settings and API
client each time (so a process may hold several, as the tests do), :func:`serve` runs it
until stopped.

What runs, in order: the liveness endpoint (at once, on a standby too); kopf, whose first
startup handler waits for the lease when leader election is on (:meth:`Operator.lead`);
then, on the leader only, the lease's renewal, the resync, the autoscaling loop and the
planner's ``/metrics``. Losing the lease stops kopf and ends :func:`serve` with a non-zero
code, so the pod restarts as a standby.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
import kubernetes.client

from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.autoscaling.schedule import AutoscalingLoop
from splitserve_operator.control.backoff import Backoff
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.controller import Controller
from splitserve_operator.control.handlers import build_registry
from splitserve_operator.control.health import HealthServer, Heartbeats
from splitserve_operator.control.k8s import KubeClient
from splitserve_operator.control.leader import LeaderElector
from splitserve_operator.control.periodic import Periodic
from splitserve_operator.control.reconciler import Reconciler
from splitserve_operator.render.names import MANAGED_BY

log = logging.getLogger(__name__)

LOOP_BEAT_S = 1.0
"""Seconds (s) between the event loop's heartbeats; the probe fails after 30 missed."""


@dataclass
class Operator:
    """Everything one running operator is made of."""

    config: OperatorConfig
    client: KubeClient
    controller: Controller
    autoscaler: Autoscaler
    autoscaling: AutoscalingLoop
    resync: Periodic
    elector: LeaderElector | None
    heartbeats: Heartbeats
    registry: kopf.OperatorRegistry = field(init=False)
    settings: kopf.OperatorSettings = field(init=False)
    on_lost: Callable[[], None] = lambda: None
    """Stops kopf when the lease is lost (set by whoever runs kopf)."""
    release_on_close: bool = True
    """Hand the lease back on :meth:`close` (False: leave it to expire, as a crash does)."""
    stopping: threading.Event = field(default_factory=threading.Event)

    def lead(self) -> bool:
        """Wait until this replica may act, then start what only the leader runs. False
        when the operator stops first."""
        if self.elector is not None:
            if not self.elector.acquire(self.stopping):
                return False
            threading.Thread(
                target=self.elector.keep,
                args=(self.stopping, lambda: self.on_lost()),
                name="splitserve-lease",
                daemon=True,
            ).start()
        self.autoscaler.start_metrics_server()
        self.resync.start()
        self.autoscaling.start()
        return True

    def step_down(self) -> None:
        """Stop what :meth:`lead` started (kopf's cleanup)."""
        self.resync.stop()
        self.autoscaling.stop()
        self.autoscaler.close()
        self.controller.close()

    def close(self) -> None:
        """Stop everything beside kopf, release the lease (unless told not to) and close
        the API client. Call once kopf has stopped."""
        self.stopping.set()
        self.step_down()
        if self.elector is not None and self.release_on_close:
            self.elector.release()
        self.settings.execution.executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def build(
    config: OperatorConfig,
    configuration: kubernetes.client.Configuration,
    *,
    clock: Callable[[], float] | None = None,
    wall_clock: Callable[[], dt.datetime] | None = None,
) -> Operator:
    """The operator's parts. ``clock`` (monotonic seconds) and ``wall_clock`` (the
    stamps written in status) are the autoscaling loop's, for tests that drive its
    ticks; unset, the real clocks."""
    configuration.connection_pool_maxsize = max(
        configuration.connection_pool_maxsize or 0, config.workers + 4
    )
    identity = config.leader_election.identity if config.leader_election else ""
    agent = f"{MANAGED_BY}/0.1.0" + (f" ({identity})" if identity else "")
    client = KubeClient(configuration, timeout=config.request_timeout, user_agent=agent)
    reconciler = Reconciler(
        client, router_cluster_role=config.router_cluster_role, record_events=config.record_events
    )
    backoff = Backoff(config.retry_base_seconds, config.retry_max_seconds)
    controller = Controller(client, reconciler, backoff=backoff)
    clocks: dict[str, Any] = {}
    if clock is not None:
        clocks["clock"] = clock
    if wall_clock is not None:
        clocks["wall_clock"] = wall_clock
    autoscaler = Autoscaler(client, config.autoscale, record_events=config.record_events, **clocks)
    heartbeats = Heartbeats()
    elector = None
    if config.leader_election is not None:
        lease = config.leader_election
        elector = LeaderElector(
            client,
            lease,
            beat=lambda: heartbeats.beat(
                "leader-election", 3 * lease.retry_period_s + config.request_timeout
            ),
        )
    operator = Operator(
        config=config,
        client=client,
        controller=controller,
        autoscaler=autoscaler,
        autoscaling=AutoscalingLoop(autoscaler, controller.cache),
        resync=Periodic("splitserve-resync", config.resync_seconds, controller.resync_all),
        elector=elector,
        heartbeats=heartbeats,
    )
    operator.registry = build_registry(controller, lead=operator.lead, step_down=operator.step_down)
    operator.settings = config.kopf_settings()
    return operator


async def serve(operator: Operator) -> int:
    """Run ``operator`` until it is stopped (a signal, or kopf's own exit); 1 when it
    stopped because it lost the lease."""
    stop = threading.Event()
    operator.on_lost = stop.set
    health = None
    if operator.config.liveness_endpoint:
        health = HealthServer(operator.config.liveness_endpoint, operator.heartbeats).start()

    async def beat() -> None:
        while True:
            operator.heartbeats.beat("event-loop", 30 * LOOP_BEAT_S)
            await asyncio.sleep(LOOP_BEAT_S)

    beating = asyncio.create_task(beat())
    try:
        await kopf.operator(
            registry=operator.registry,
            settings=operator.settings,
            clusterwide=operator.config.clusterwide,
            namespaces=list(operator.config.namespaces),
            standalone=True,
            stop_flag=stop,
        )
    finally:
        beating.cancel()
        operator.close()
        if health is not None:
            health.close()
    if operator.elector is not None and operator.elector.lost.is_set():
        log.error("stopped after losing the lease: exiting so that this pod restarts as a standby")
        return 1
    return 0
