"""The simulator's router: where new requests, landed KV and waiting requests go."""

from __future__ import annotations

import math
from collections import deque

from splitserve_operator.sim.colocated import ColocatedInstance
from splitserve_operator.sim.config import Mode, Role, SimConfig
from splitserve_operator.sim.instance_base import Host, Instance, State
from splitserve_operator.sim.instances import PrefillInstance
from splitserve_operator.sim.pools import Pools
from splitserve_operator.sim.windows import Recorder
from splitserve_operator.sim.workload import Request


class Router:
    """Routes arrivals, landed KV and the requests that waited for an active instance.

    ``host`` is the simulation (its clock, and where first and last tokens go)."""

    def __init__(self, config: SimConfig, host: Host, pools: Pools, recorder: Recorder) -> None:
        self.config = config
        self.host = host
        self.pools = pools
        self.recorder = recorder
        self.pending: dict[Role, deque[Request]] = {r: deque() for r in config.pools}
        """Requests waiting for an active instance of each role."""
        self.transfers_in_flight = 0
        self._first_role = Role.BOTH if config.mode is Mode.COLOCATED else Role.PREFILL

    def _pick(self, role: Role, req: Request) -> Instance | None:
        best, best_score = None, math.inf
        decode = role is Role.DECODE
        for inst in self.pools.instances[role]:
            if inst.state is State.ACTIVE:
                s = inst.decode_load(req) if decode else inst.load(req)  # type: ignore[attr-defined]
                if s < best_score:
                    best, best_score = inst, s
        return best

    def _route(self, role: Role, req: Request) -> None:
        inst = self._pick(role, req)
        if inst is None:
            self.pending[role].append(req)
        elif role is Role.DECODE:
            inst.offer_decode(req, self.host.now)  # type: ignore[attr-defined]
        else:
            inst.offer(req, self.host.now)  # type: ignore[attr-defined]

    def _route_first(self, req: Request) -> None:
        """Where a new request goes: a prefill (or colocated) worker, or, when the
        router may prefill locally and judges it cheaper, a decode worker."""
        policy = self.config.local_prefill
        if policy is None:
            self._route(self._first_role, req)
            return
        d = self._pick(Role.DECODE, req)
        p = self._pick(Role.PREFILL, req)
        if d is None:
            self._route(Role.PREFILL, req)
            return
        assert isinstance(d, ColocatedInstance)
        ahead = p.queued_tokens + p.running_tokens if isinstance(p, PrefillInstance) else 0
        waiting = len(d.queue) + len(d.landed)
        running = d.batch.n + len(d.partial)
        if p is None or policy.is_local(req.prompt, ahead, waiting, running):
            self.recorder.local_prefills += 1
            d.offer(req, self.host.now)
        else:
            p.offer(req, self.host.now)  # type: ignore[attr-defined]

    def dispatch_pending(self, role: Role) -> None:
        """Route what waited for an active instance of ``role``."""
        q = self.pending[role]
        while q and any(i.state is State.ACTIVE for i in self.pools.instances[role]):
            self._route(role, q.popleft())

    def arrive(self, req: Request) -> None:
        """A new request reaches the router."""
        self.recorder.arrived(req)
        self._route_first(req)

    def kv_sent(self, batch: list[Request], t_landed: float) -> None:
        """A prefill batch's KV will have landed on the decode side at ``t_landed``."""
        self.transfers_in_flight += len(batch)
        self.host.schedule(t_landed, self._kv_landed, batch)

    def _kv_landed(self, batch: list[Request]) -> None:
        now = self.host.now
        self.transfers_in_flight -= len(batch)
        after = self.config.first_token_after_transfer
        host = self.host
        for r in batch:
            host.first_token(r, now if after else r.t_prefill_end)
            if r.output == 1:
                host.finish(r, now)
            else:
                self._route(Role.DECODE, r)
