"""A background thread that calls one function every ``interval`` seconds (the resync of
every InferenceService, the autoscaling loop), counting the passes it completed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, interval: float, fn: Callable[[], object]) -> None:
        self.name = name
        self.interval = interval
        self.fn = fn
        self.passes = 0
        """Calls of ``fn`` completed (whatever they returned or raised)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start calling (once; an interval of 0 or less never calls)."""
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.fn()
            except Exception:  # one bad pass must not end the loop; the next one retries
                log.exception(
                    "%s: a pass failed; the next one runs in %s s", self.name, self.interval
                )
            self.passes += 1
