"""Running the operator in the foreground (``python -m splitserve_operator``,
``splitserve operator``): :func:`build` makes one from its settings with a fresh kopf
registry, settings and API client each time (so a process may hold several, as the
tests do), :func:`serve` runs it until stopped."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes.client

from splitserve_operator.control.autoscaling.handlers import install as install_autoscaling
from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.controller import Controller, Resync
from splitserve_operator.control.handlers import build_registry
from splitserve_operator.control.k8s import KubeClient
from splitserve_operator.control.reconciler import Reconciler

log = logging.getLogger(__name__)


@dataclass
class Operator:
    """Everything one running operator is made of."""

    config: OperatorConfig
    client: KubeClient
    controller: Controller
    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings
    resync: Resync

    def close(self) -> None:
        """Stop what runs beside kopf (the resync thread, the handlers' executor) and
        close the API client. Call once kopf has stopped."""
        self.resync.stop()
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
    client = KubeClient(configuration, timeout=config.request_timeout)
    reconciler = Reconciler(
        client,
        router_cluster_role=config.router_cluster_role,
        record_events=config.record_events,
        retry_delay=config.retry_delay,
    )
    controller = Controller(client, reconciler)
    registry = build_registry(controller)
    # The planner's loop: a kopf timer on autoscaled InferenceServices.
    clocks: dict[str, Any] = {}
    if clock is not None:
        clocks["clock"] = clock
    if wall_clock is not None:
        clocks["wall_clock"] = wall_clock
    autoscaler = Autoscaler(client, config.autoscale, record_events=config.record_events, **clocks)
    install_autoscaling(registry, autoscaler)
    resync = Resync(controller, config.resync_seconds)
    return Operator(config, client, controller, registry, config.kopf_settings(), resync)


async def serve(operator: Operator) -> None:
    """Run ``operator`` until it is stopped (a signal, or kopf's own exit)."""
    operator.resync.start()
    try:
        await kopf.operator(
            registry=operator.registry,
            settings=operator.settings,
            clusterwide=operator.config.clusterwide,
            namespaces=list(operator.config.namespaces),
            standalone=True,
            liveness_endpoint=operator.config.liveness_endpoint,
        )
    finally:
        operator.close()
