"""The simulator's observations: what happens to requests, counted per window and in
all, turned into the planner's :class:`Window` reports and the run's
:class:`SimResult`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from splitserve_operator.sim.colocated import ColocatedInstance
from splitserve_operator.sim.config import Role, SimConfig, Slo
from splitserve_operator.sim.instance_base import State
from splitserve_operator.sim.instances import DecodeInstance, PrefillInstance
from splitserve_operator.sim.metrics import Percentiles, PoolObservation, SimResult, Window
from splitserve_operator.sim.pools import Pools
from splitserve_operator.sim.workload import Request


class Recorder:
    """Counts arrivals, first tokens, finishes and computed prompt tokens; keeps the
    finished requests when asked to (``keep_requests``)."""

    def __init__(self, config: SimConfig, slo: Slo | None, *, keep_requests: bool) -> None:
        self.config = config
        self.slo = slo
        self.keep_requests = keep_requests
        self.finished: list[Request] = []
        self.n_arrived = 0
        self.n_finished = 0
        self.prefill_tokens = 0
        """Prompt tokens computed so far (instances add to it)."""
        self.local_prefills = 0
        """Requests the router prefilled on a decode worker (``SimConfig.local_prefill``)."""
        self._start = 0.0
        self._arrivals = 0
        self._in_tokens = 0
        self._first = 0
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._ok = 0
        self._prefill0 = 0
        self._out0 = 0
        self._gpu_s0 = 0.0
        self._busy0: dict[int, float] = {}

    # ---- what happens to requests ----
    def arrived(self, req: Request) -> None:
        self.n_arrived += 1
        self._arrivals += 1
        self._in_tokens += req.prompt

    def first_token(self, req: Request) -> None:
        """``req.t_first`` is set."""
        self._first += 1
        self._ttft.append(req.t_first - req.arrival)

    def finished_request(self, req: Request) -> None:
        """``req.t_first`` and ``req.t_last`` are set."""
        self.n_finished += 1
        if self.keep_requests:
            self.finished.append(req)
        tpot = req.tpot
        self._tpot.append(tpot)
        slo = self.slo
        if slo is not None and tpot <= slo.tpot_s and req.t_first - req.arrival <= slo.ttft_s:
            self._ok += 1

    # ---- windows ----
    def start_window(self, t: float, pools: Pools) -> None:
        """Begin a window at ``t`` (counts from now on)."""
        self._start = t
        self._arrivals = 0
        self._in_tokens = 0
        self._first = 0
        self._ttft = []
        self._tpot = []
        self._ok = 0
        self._prefill0 = self.prefill_tokens
        self._out0 = pools.decode_tokens() + self._first
        self._gpu_s0 = pools.gpu_seconds()
        self._busy0 = pools.busy_seconds()

    def observe(
        self,
        now: float,
        pools: Pools,
        pending: Mapping[Role, Sequence[Request]],
        transfers_in_flight: int,
    ) -> Window:
        """Report the window since the last one (``pending``: what waits for an active
        instance of each role) and start a new one."""
        dur = max(now - self._start, 1e-12)
        ttft = Percentiles.of(self._ttft)
        tpot = Percentiles.of(self._tpot)
        attain = self._ok / len(self._tpot) if self.slo is not None and self._tpot else None
        obs = {
            str(role): self._observe_pool(role, pools, pending[role], dur)
            for role in pools.instances
        }
        gpu_s = pools.gpu_seconds()
        out_tokens = pools.decode_tokens() + self._first
        w = Window(
            t_start=self._start,
            t_end=now,
            arrivals=self._arrivals,
            request_rate=self._arrivals / dur,
            input_token_rate=self._in_tokens / dur,
            output_token_rate=(out_tokens - self._out0) / dur,
            prefill_token_rate=(self.prefill_tokens - self._prefill0) / dur,
            first_tokens=self._first,
            completed=len(self._tpot),
            ttft=ttft,
            tpot=tpot,
            slo_attainment=attain,
            pools=obs,
            transfers_in_flight=transfers_in_flight,
            gpus=pools.gpus(),
            gpu_seconds=gpu_s - self._gpu_s0,
        )
        self.start_window(now, pools)
        return w

    def _observe_pool(
        self, role: Role, pools: Pools, pending: Sequence[Request], dur: float
    ) -> PoolObservation:
        insts = pools.instances[role]
        pool_cfg = self.config.pools[role]
        queue = len(pending)
        queue_tokens = sum(r.prompt for r in pending)
        running = 0
        used = 0
        busy = 0.0
        for i in insts:
            busy += i.busy_s - self._busy0.get(i.iid, 0.0)
            if isinstance(i, PrefillInstance):
                queue += len(i.queue)
                queue_tokens += i.queued_tokens
                running += len(i.running)
            elif isinstance(i, DecodeInstance):
                queue += len(i.waiting)
                queue_tokens += i.waiting_tokens
                running += i.batch.n
                used += i.kv_used_tokens()
            elif isinstance(i, ColocatedInstance):
                queue += len(i.queue) + len(i.landed)
                queue_tokens += i.queued_tokens + i.landed_tokens
                running += i.batch.n + len(i.partial)
                used += i.kv_used_tokens()
        serving = [i for i in insts if i.state in (State.ACTIVE, State.DRAINING)]
        cap = len(serving) * pool_cfg.kv_capacity_tokens
        return PoolObservation(
            active=sum(1 for i in insts if i.state is State.ACTIVE),
            starting=sum(1 for i in insts if i.state is State.STARTING),
            draining=sum(1 for i in insts if i.state is State.DRAINING),
            queue=queue,
            queue_tokens=queue_tokens,
            running=running,
            kv_utilization=used / cap if cap else 0.0,
            busy_fraction=min(1.0, busy / (max(1, len(serving)) * dur)),
        )

    # ---- the run ----
    def result(self, pools: Pools) -> SimResult:
        reqs = sorted(self.finished, key=lambda r: r.rid)
        first_arrival = reqs[0].arrival if reqs else 0.0
        last = max((r.t_last for r in reqs), default=0.0)
        return SimResult(
            label=self.config.label(),
            n_requests=self.n_arrived,
            arrival=np.array([r.arrival for r in reqs]),
            prompt=np.array([r.prompt for r in reqs], dtype=np.int64),
            output=np.array([r.output for r in reqs], dtype=np.int64),
            ttft=np.array([r.t_first - r.arrival for r in reqs]),
            tpot=np.array([r.tpot for r in reqs]),
            finish=np.array([r.t_last for r in reqs]),
            duration_s=last - first_arrival,
            gpu_seconds=pools.gpu_seconds(),
            gpus=self.config.gpus,
            extra={
                "prefill_tokens": float(self.prefill_tokens),
                "local_prefills": float(self.local_prefills),
            },
        )
