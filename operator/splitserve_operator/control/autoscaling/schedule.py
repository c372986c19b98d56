"""The autoscaling loop's clock: one operator-wide task, not a kopf timer per object.

kopf's timers (and daemons) put kopf's finalizer on every object they watch, so that
deleting an autoscaled InferenceService while the operator is down would hang. Here a
:class:`~splitserve_operator.control.periodic.Periodic` thread wakes every
``AutoscaleConfig.resolution_s``, walks the InferenceServices the watch has cached, and
hands each one whose ``autoscaling.interval`` has passed to a small pool of
threads (one tick per service at a time). It runs only on the elected leader.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.control.cache import ServiceCache
from splitserve_operator.control.periodic import Periodic
from splitserve_operator.control.serializer import Key

log = logging.getLogger(__name__)


class AutoscalingLoop:
    def __init__(self, autoscaler: Autoscaler, cache: ServiceCache, *, workers: int = 4) -> None:
        self.autoscaler = autoscaler
        self.cache = cache
        self.periodic = Periodic(
            "splitserve-autoscaling", autoscaler.config.resolution_s, self.tick_all
        )
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="splitserve-planner")
        self._lock = threading.Lock()
        self._running: set[Key] = set()

    def start(self) -> None:
        self.periodic.start()

    def stop(self) -> None:
        self.periodic.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def tick_all(self) -> int:
        """Start a tick for every cached service that is due; how many were started."""
        started = 0
        keys = self.cache.keys()
        for key in keys:
            seen = self.cache.peek(key)  # read only: most services are not due
            if seen is None or not self.autoscaler.due(seen):
                continue
            body = self.cache.get(key)  # the tick's own copy
            if body is None:
                continue
            with self._lock:
                if key in self._running:
                    continue
                self._running.add(key)
            self._executor.submit(self._tick, key, body)
            started += 1
        return started

    def _tick(self, key: Key, body: dict[str, Any]) -> None:
        try:
            self.autoscaler.tick(body)
        except Exception:  # one service's failure must not stop the others' planning
            log.exception("planner tick of %s/%s failed; the next tick retries", *key)
        finally:
            with self._lock:
                self._running.discard(key)
