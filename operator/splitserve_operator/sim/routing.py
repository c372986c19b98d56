"""The simulator's router and request lifecycle: where requests go and when they finish."""

from __future__ import annotations

import math

from splitserve_operator.sim.config import Role
from splitserve_operator.sim.events import EventLoop
from splitserve_operator.sim.instances import (
    ColocatedInstance,
    Instance,
    PrefillInstance,
    State,
)
from splitserve_operator.sim.workload import Request


class RoutingMixin(EventLoop):
    """Routes arrivals, landed KV and pending requests; records first tokens and finishes."""

    def _pick(self, role: Role, req: Request) -> Instance | None:
        best, best_score = None, math.inf
        decode = role is Role.DECODE
        for inst in self.pools[role]:
            if inst.state is State.ACTIVE:
                s = inst.decode_load(req) if decode else inst.load(req)  # type: ignore[attr-defined]
                if s < best_score:
                    best, best_score = inst, s
        return best

    def _route(self, role: Role, req: Request) -> None:
        inst = self._pick(role, req)
        if inst is None:
            self._pending[role].append(req)
        elif role is Role.DECODE:
            inst.offer_decode(req, self.now)  # type: ignore[attr-defined]
        else:
            inst.offer(req, self.now)  # type: ignore[attr-defined]

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
            self.local_prefills += 1
            d.offer(req, self.now)
        else:
            p.offer(req, self.now)  # type: ignore[attr-defined]

    def _dispatch_pending(self, role: Role) -> None:
        q = self._pending[role]
        while q and any(i.state is State.ACTIVE for i in self.pools[role]):
            self._route(role, q.popleft())

    def _arrive(self, req: Request) -> None:
        self.n_arrived += 1
        self._w_arrivals += 1
        self._w_in_tokens += req.prompt
        self._route_first(req)

    def kv_sent(self, batch: list[Request], t_landed: float) -> None:
        """A prefill batch's KV will have landed on the decode side at ``t_landed``."""
        self.transfers_in_flight += len(batch)
        self.schedule(t_landed, self._kv_landed, batch)

    def _kv_landed(self, batch: list[Request]) -> None:
        now = self.now
        self.transfers_in_flight -= len(batch)
        after = self.config.first_token_after_transfer
        for r in batch:
            self.first_token(r, now if after else r.t_prefill_end)
            if r.output == 1:
                self.finish(r, now)
            else:
                self._route(Role.DECODE, r)

    def first_token(self, req: Request, t: float) -> None:
        req.t_first = t + self.config.router_overhead_s
        self._w_first += 1
        self._w_ttft.append(req.t_first - req.arrival)

    def decode_admitted(self, req: Request, t: float) -> None:
        """A request joined a decode batch (hook for subclasses and tests)."""

    def finish(self, req: Request, t: float) -> None:
        req.t_last = t + self.config.router_overhead_s
        self.n_finished += 1
        if self.keep_requests:
            self.finished.append(req)
        tpot = req.tpot
        self._w_tpot.append(tpot)
        slo = self.slo
        if slo is not None and tpot <= slo.tpot_s and req.t_first - req.arrival <= slo.ttft_s:
            self._w_ok += 1
