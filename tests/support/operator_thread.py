"""The real operator in a background thread, for tests and the bench: kopf's own
:class:`kopf.testing.KopfRunner` running ``kopf run`` with the registry and settings
:func:`splitserve_operator.control.runtime.build` makes.

``with OperatorThread(config, configuration) as op:`` starts it and waits until kopf
has run its startup handlers (with leader election on: until this replica leads; pass
``wait_for_lead=False`` to ``start`` for a standby); leaving the block stops kopf, waits
for its thread and closes what the operator holds (resync, autoscaling loop, executor, API
client, the lease), re-raising whatever made the operator fail. :meth:`kill` stops it as
a crash would (the lease is left to expire). A stopped operator stays stopped: start a
new one to restart.

kopf's command line reconfigures the root logger (``--quiet``: warnings and up) and
captures the process's stdout and stderr while it runs, so print nothing a caller
must see from inside the block.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import kopf
import kubernetes.client
from kopf.testing import KopfRunner
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.controller import Controller
from splitserve_operator.control.health import HealthServer
from splitserve_operator.control.runtime import Operator, build


def kopf_args(config: OperatorConfig) -> list[str]:
    """``kopf run`` arguments for ``config`` (what :func:`runtime.serve` passes kopf)."""
    args = ["run", "--standalone", "--quiet"]
    if config.clusterwide:
        args.append("--all-namespaces")
    for namespace in config.namespaces:
        args += ["--namespace", namespace]
    return args


class OperatorThread:
    """One operator run by kopf in a thread: ``start()`` then ``stop()``, or ``with``."""

    def __init__(
        self,
        config: OperatorConfig,
        configuration: kubernetes.client.Configuration,
        *,
        timeout: float = 30.0,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.operator: Operator = build(config, configuration, clock=clock, wall_clock=wall_clock)
        self.timeout = timeout
        self._started = threading.Event()
        self._stack = contextlib.ExitStack()
        self._stopping = threading.Lock()
        self._runner = KopfRunner(
            kopf_args(config),
            registry=self.operator.registry,
            settings=self.operator.settings,
            timeout=timeout,
        )
        # Losing the lease stops kopf, from another thread than the one renewing it.
        self.operator.on_lost = lambda: threading.Thread(target=self.stop, daemon=True).start()

        # Registered after the operator's own startup handlers, which kopf runs in
        # order: when this one runs, those have run (leadership held, metrics up).
        @kopf.on.startup(registry=self.operator.registry)
        def _started(**_: Any) -> None:
            self._started.set()

    @property
    def controller(self) -> Controller:
        return self.operator.controller

    @property
    def running(self) -> bool:
        return self._started.is_set() and not self._runner.future.done()

    @property
    def leading(self) -> bool:
        """Whether this replica acts (always, without leader election)."""
        elector = self.operator.elector
        return self.running and (elector is None or elector.leading)

    def start(self, wait: float = 30.0, *, wait_for_lead: bool = True) -> OperatorThread:
        self._stack.callback(self.operator.close)
        if self.operator.config.liveness_endpoint:
            health = HealthServer(self.operator.config.liveness_endpoint, self.operator.heartbeats)
            self._stack.callback(health.close)
            health.start()
        self._stack.enter_context(self._runner)
        # first on the way out: a standby blocked waiting for the lease lets go at once
        self._stack.callback(self.operator.stopping.set)
        self._runner.future.add_done_callback(self._ended)
        if not wait_for_lead:
            return self
        if not self._started.wait(wait):
            self.stop()
            raise TimeoutError(f"the operator did not start within {wait} s")
        if self._runner.future.done():
            self.stop()  # re-raises why it ended
            raise RuntimeError("the operator stopped as soon as it started")
        return self

    def _ended(self, _: Future[Any]) -> None:
        self._started.set()  # wakes start() when kopf ends before it is ready

    def stop(self) -> None:
        """Stop kopf, wait for its thread, release the operator's resources; raises what
        made the operator fail, if anything did. Idempotent."""
        with self._stopping:
            self._stack.close()

    def kill(self) -> None:
        """Stop as a crash would: the lease is not handed back (a standby takes it only
        once it expires)."""
        self.operator.release_on_close = False
        self.stop()

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
