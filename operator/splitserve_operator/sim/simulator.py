"""The simulator: a workload and a configuration in, windows and a result out.

:class:`Simulator` is the event loop (:mod:`.events`) over its parts, each with a
module: the pools (:mod:`.pools`), the router (:mod:`.routing`) and the observations
(:mod:`.windows`). To its instances it is their :class:`~.instance_base.Host`. See
the package docstring for the API the planner drives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from splitserve_operator.sim.config import Role, SimConfig, Slo
from splitserve_operator.sim.events import EventLoop
from splitserve_operator.sim.instance_base import Instance, State
from splitserve_operator.sim.metrics import SimResult, Window
from splitserve_operator.sim.pools import Pools
from splitserve_operator.sim.routing import Router
from splitserve_operator.sim.windows import Recorder
from splitserve_operator.sim.workload import Request, Workload


class Simulator(EventLoop):
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
        arrivals: Iterator[Request]
        if isinstance(workload, Workload):
            block_tokens = workload.block_tokens
            arrivals = workload.requests()
        else:
            block_tokens = 512
            arrivals = iter(workload)
        super().__init__(arrivals)
        self.config = config
        self.slo = slo
        self.recorder = Recorder(config, slo, keep_requests=keep_requests)
        self.pools = Pools(config, self, block_tokens, self._dispatch)
        self.router = Router(config, self, self.pools, self.recorder)
        self.recorder.start_window(0.0, self.pools)
        for role, n in config.replicas.items():
            for _ in range(n):
                self.pools.add(role, State.ACTIVE)

    # ---- the planner's API ----
    def run_until(self, t: float) -> Window:
        """Advance simulated time to ``t`` and report the window since the last call."""
        if t < self.now:
            raise ValueError(f"cannot run back in time ({t} < {self.now})")
        self.advance(t, self.router.arrive)
        return self.observe()

    def run(self) -> SimResult:
        """Run until every request has finished (or nothing more can happen)."""
        self.advance(math.inf, self.router.arrive)
        return self.result()

    def observe(self) -> Window:
        """Report the window since the last observation and start a new one."""
        router = self.router
        return self.recorder.observe(
            self.now, self.pools, router.pending, router.transfers_in_flight
        )

    def result(self) -> SimResult:
        return self.recorder.result(self.pools)

    def set_replicas(
        self, *, prefill: int | None = None, decode: int | None = None, both: int | None = None
    ) -> None:
        """:meth:`Pools.set_replicas <splitserve_operator.sim.pools.Pools.set_replicas>`."""
        self.pools.set_replicas(prefill=prefill, decode=decode, both=both)

    def switch(self, from_role: Role, to_role: Role, switch_s: float) -> bool:
        """:meth:`Pools.switch <splitserve_operator.sim.pools.Pools.switch>`: one worker
        changes role, serving the new one after ``switch_s`` instead of a cold start."""
        return self.pools.switch(from_role, to_role, switch_s)

    def replicas(self, role: Role) -> int:
        """Instances of ``role`` that are active or starting (what was last asked for)."""
        return self.pools.replicas(role)

    def gpus(self) -> int:
        return self.pools.gpus()

    def gpu_seconds(self) -> float:
        """GPU-seconds held so far (every instance from its adding to its going)."""
        return self.pools.gpu_seconds()

    @property
    def finished(self) -> list[Request]:
        """Finished requests, in finishing order (when ``keep_requests``)."""
        return self.recorder.finished

    @property
    def local_prefills(self) -> int:
        """Requests the router prefilled on a decode worker (``SimConfig.local_prefill``)."""
        return self.recorder.local_prefills

    # ---- the Host of the instances and the router ----
    def prefilled(self, tokens: int) -> None:
        self.recorder.prefill_tokens += tokens

    def kv_sent(self, batch: list[Request], t_landed: float) -> None:
        self.router.kv_sent(batch, t_landed)

    def first_token(self, req: Request, t: float) -> None:
        req.t_first = t + self.config.router_overhead_s
        self.recorder.first_token(req)

    def decode_admitted(self, req: Request, t: float) -> None:
        """A request joined a decode batch (a hook for subclasses and tests)."""

    def finish(self, req: Request, t: float) -> None:
        req.t_last = t + self.config.router_overhead_s
        self.recorder.finished_request(req)

    def idle(self, inst: Instance) -> None:
        self.pools.idle(inst)

    def _dispatch(self, role: Role) -> None:
        self.router.dispatch_pending(role)
