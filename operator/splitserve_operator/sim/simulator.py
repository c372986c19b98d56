"""The simulator: a workload and a configuration in, windows and a result out.

Its parts each have a module: the event loop and shared state
(:mod:`.events`), the pools (:mod:`.pools`), the router (:mod:`.routing`) and
the observations (:mod:`.windows`). See the package docstring for the API the
planner drives.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator

from splitserve_operator.sim.config import Mode, Role, SimConfig, Slo
from splitserve_operator.sim.events import Event, EventLoop
from splitserve_operator.sim.instances import Instance, State
from splitserve_operator.sim.metrics import SimResult, Window
from splitserve_operator.sim.pools import PoolsMixin
from splitserve_operator.sim.routing import RoutingMixin
from splitserve_operator.sim.windows import WindowsMixin
from splitserve_operator.sim.workload import Request, Workload

__all__ = ["Event", "EventLoop", "Simulator"]


class Simulator(RoutingMixin, PoolsMixin, WindowsMixin):
    """A discrete-event simulation of the router and its pools.

    ``workload`` is a :class:`Workload` or any iterable of :class:`Request`
    in arrival order (consumed lazily). ``slo`` only feeds the per-window
    ``slo_attainment``.
    """

    def __init__(
        self,
        config: SimConfig,
        workload: Workload | Iterable[Request],
        *,
        slo: Slo | None = None,
        keep_requests: bool = True,
    ) -> None:
        self.config = config
        self.slo = slo
        self.now = 0.0
        self._heap: list[Event] = []
        self._seq = itertools.count()
        if isinstance(workload, Workload):
            self._block_tokens = workload.block_tokens
            self._arrivals: Iterator[Request] = workload.requests()
        else:
            self._block_tokens = 512
            self._arrivals = iter(workload)
        self._next: Request | None = next(self._arrivals, None)
        self._ids = itertools.count()
        self.pools: dict[Role, list[Instance]] = {r: [] for r in config.pools}
        self._pending: dict[Role, deque[Request]] = {r: deque() for r in config.pools}
        self._first_role = Role.BOTH if config.mode is Mode.COLOCATED else Role.PREFILL
        self.keep_requests = keep_requests
        self.finished: list[Request] = []
        self.n_arrived = 0
        self.n_finished = 0
        self.transfers_in_flight = 0
        self.prefill_tokens = 0
        """Prompt tokens computed so far (instances add to it)."""
        self.local_prefills = 0
        """Requests the router prefilled on a decode worker (``SimConfig.local_prefill``)."""
        self._gone_gpu_seconds = 0.0
        self._gone_tokens = 0
        self._reset_window(0.0)
        for role, n in config.replicas.items():
            for _ in range(n):
                self._add_instance(role, State.ACTIVE)

    def run_until(self, t: float) -> Window:
        """Advance simulated time to ``t`` and report the window since the last call."""
        if t < self.now:
            raise ValueError(f"cannot run back in time ({t} < {self.now})")
        self._advance(t)
        return self.observe()

    def run(self) -> SimResult:
        """Run until every request has finished (or nothing more can happen)."""
        self._advance(math.inf)
        return self.result()
