"""Running the operator: in the foreground (``python -m splitserve_operator``) or in a
thread (tests, the bench), with a fresh registry, settings and client each time."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import kopf
import kubernetes.client

from splitserve_operator import autoscale
from splitserve_operator.config import OperatorConfig
from splitserve_operator.controller import Controller, Resync
from splitserve_operator.handlers import build_registry
from splitserve_operator.k8s import KubeClient
from splitserve_operator.reconcile import Reconciler

log = logging.getLogger(__name__)


@dataclass
class Operator:
    """Everything one running operator is made of."""

    config: OperatorConfig
    client: KubeClient
    controller: Controller
    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings


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
    autoscaler = autoscale.Autoscaler(
        client, config.autoscale, record_events=config.record_events, **clocks
    )
    autoscale.install(registry, autoscaler)
    return Operator(config, client, controller, registry, config.kopf_settings())


async def serve(
    operator: Operator,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
) -> None:
    resync = Resync(operator.controller, operator.config.resync_seconds)
    resync.start()
    try:
        await kopf.operator(
            registry=operator.registry,
            settings=operator.settings,
            clusterwide=operator.config.clusterwide,
            namespaces=list(operator.config.namespaces),
            standalone=True,
            liveness_endpoint=operator.config.liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        resync.stop()
        operator.settings.execution.executor.shutdown(wait=False, cancel_futures=True)
        operator.client.close()


class OperatorThread:
    """Run an operator in a background thread: ``with OperatorThread(config, cfg) as op:``.

    Leaving the block stops kopf and waits for the thread (``timeout`` seconds).
    """

    def __init__(
        self,
        config: OperatorConfig,
        configuration: kubernetes.client.Configuration,
        *,
        timeout: float = 30.0,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.operator = build(config, configuration, clock=clock, wall_clock=wall_clock)
        self.timeout = timeout
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="splitserve-operator", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def controller(self) -> Controller:
        return self.operator.controller

    def _main(self) -> None:
        try:
            asyncio.run(serve(self.operator, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as exc:  # surfaced to the caller in __exit__
            self._error = exc
            self._ready.set()

    def start(self, wait: float = 30.0) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(wait):
            raise TimeoutError("the operator did not get ready")
        if self._error is not None:
            raise RuntimeError("the operator failed to start") from self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise TimeoutError("the operator did not stop")
        if self._error is not None:
            raise RuntimeError("the operator failed") from self._error

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
