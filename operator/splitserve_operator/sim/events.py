"""The simulator's clock: simulated time, the event heap, and the arrivals to come.

:class:`Clock` is what the simulator's parts need of time (read it, schedule an event);
:class:`EventLoop` is the clock itself and advances time through arrivals and events
in order (an arrival first when both fall at the same time).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from splitserve_operator.sim.workload import Request

Event = tuple[float, int, Callable[[Any], None], Any]
"""``(time, sequence number, fn, arg)``: ``fn(arg)`` runs at ``time``; ties run in the
order they were scheduled."""


class Clock(Protocol):
    """Simulated time as the simulator's parts see it."""

    @property
    def now(self) -> float:
        """Seconds since the simulation started."""
        ...

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` at time ``t`` (never before ``now``)."""
        ...


class EventLoop:
    """Time, the event heap and the arrivals (consumed lazily, in arrival order)."""

    def __init__(self, arrivals: Iterator[Request]) -> None:
        self.now = 0.0
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self._arrivals = arrivals
        self._next: Request | None = next(arrivals, None)

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def advance(self, t_end: float, arrive: Callable[[Request], None]) -> None:
        """Process every arrival (handed to ``arrive``) and event up to ``t_end``; then
        time is ``t_end`` (unless that is infinite: then the time of the last one)."""
        heap = self._heap
        pop = heapq.heappop
        while True:
            nxt = self._next
            ta = nxt.arrival if nxt is not None else math.inf
            th = heap[0][0] if heap else math.inf
            if ta <= th:
                if ta > t_end or nxt is None:
                    break
                self.now = ta
                self._next = next(self._arrivals, None)
                arrive(nxt)
            else:
                if th > t_end:
                    break
                t, _, fn, arg = pop(heap)
                self.now = t
                fn(arg)
        if t_end != math.inf:
            self.now = max(self.now, t_end)

    @property
    def done(self) -> bool:
        """No arrivals left and nothing in flight."""
        return self._next is None and not self._heap
