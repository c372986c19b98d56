"""The simulator's clock and event heap, and the state its parts share.

:class:`EventLoop` is the base of :class:`~splitserve_operator.sim.simulator.Simulator`:
it declares the attributes the pool, routing and window parts read and write
(set in ``Simulator.__init__``) and advances time through arrivals and events.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from splitserve_operator.sim.config import Role, SimConfig, Slo
from splitserve_operator.sim.instances import Instance
from splitserve_operator.sim.workload import Request

Event = tuple[float, int, Callable[[Any], None], Any]


class EventLoop:
    """Time, the event heap and the arrivals; the shared simulator state."""

    config: SimConfig
    slo: Slo | None
    now: float
    _heap: list[Event]
    _seq: Iterator[int]
    _block_tokens: int
    _arrivals: Iterator[Request]
    _next: Request | None
    _ids: Iterator[int]
    pools: dict[Role, list[Instance]]
    _pending: dict[Role, deque[Request]]
    _first_role: Role
    keep_requests: bool
    finished: list[Request]
    n_arrived: int
    n_finished: int
    transfers_in_flight: int
    prefill_tokens: int
    local_prefills: int
    _gone_gpu_seconds: float
    _gone_tokens: int
    _w_start: float
    _w_arrivals: int
    _w_in_tokens: int
    _w_first: int
    _w_ttft: list[float]
    _w_tpot: list[float]
    _w_ok: int
    _w_prefill0: int
    _w_out0: int
    _w_gpu_s0: float
    _w_busy0: dict[int, float]

    if TYPE_CHECKING:

        def _arrive(self, req: Request) -> None:
            """A request arrives (the router's part)."""

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def _advance(self, t_end: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        arrive = self._arrive
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
