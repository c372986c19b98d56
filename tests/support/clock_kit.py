"""A clock a test moves by hand, for the lease table, the reaper and the KV senders."""

from __future__ import annotations

import threading


class FakeClock:
    """Monotonic seconds that pass only when :meth:`advance` says so (thread-safe)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not run backwards")
        with self._lock:
            self._now += seconds
