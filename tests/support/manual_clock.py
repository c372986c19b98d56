"""A clock a test moves by hand, for code that takes ``clock`` / ``wall_clock``.

The autoscaling loop asks its clock whether a service's tick is due and stamps what it
writes with its wall clock; with this clock a test makes exactly one tick due at a time
(:meth:`ManualClock.advance`) and knows which tick wrote a status (its ``stamp``), so it
never waits on a window of wall-clock time for the planner."""

from __future__ import annotations

import datetime as dt
import threading

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class ManualClock:
    def __init__(self, start_s: float = 1000.0, epoch: dt.datetime = EPOCH) -> None:
        self._now = start_s
        self._epoch = epoch
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        """Seconds; only moves in :meth:`advance`."""
        with self._lock:
            return self._now

    def wall(self) -> dt.datetime:
        """``epoch`` plus :meth:`monotonic` seconds (UTC)."""
        return self._epoch + dt.timedelta(seconds=self.monotonic())

    def advance(self, seconds: float) -> float:
        """Moves the clock forward; returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now

    def stamp(self) -> str:
        """:meth:`wall` as the operator writes times in status (whole seconds, UTC)."""
        return self.wall().strftime("%Y-%m-%dT%H:%M:%SZ")
