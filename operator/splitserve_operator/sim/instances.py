"""Engine instances: a prefill worker and a decode worker.

The colocated worker is :mod:`splitserve_operator.sim.colocated`; the shared
base, the span mechanics and what an instance sees of the simulation
(:class:`~splitserve_operator.sim.instance_base.Host`) are
:mod:`splitserve_operator.sim.instance_base`.

Each instance is a small state machine driven by the simulator's event heap.
Decode is advanced in *spans*: while a decode batch does not change, ``k``
steps are one event (:meth:`CostModel.decode_span` gives their total time in
closed form). A span ends early, at the next step boundary, when a request
arrives that could join the batch; that is what keeps a day-long trace of
100,000 requests at a few hundred thousand events.

Memory: a request reserves KV for its whole prompt and output when it is
admitted (to prefill on a colocated worker, to the batch on a decode worker)
and frees it when done, so nothing is ever preempted; a request waits when
its reservation does not fit.
"""

from __future__ import annotations

from collections import deque

from splitserve_operator.sim.config import PoolConfig, Role, SimConfig
from splitserve_operator.sim.cost import transfer_end
from splitserve_operator.sim.instance_base import Host, Instance, SpanInstance, State
from splitserve_operator.sim.prefix import PrefixCache
from splitserve_operator.sim.workload import Request


class DecodeInstance(SpanInstance):
    """Continuous batching: requests whose KV has arrived join at step boundaries."""

    role = Role.DECODE

    def __init__(
        self, host: Host, config: SimConfig, iid: int, pool: PoolConfig, now: float, state: State
    ) -> None:
        super().__init__(host, config, iid, pool, now, state)
        self.waiting: deque[Request] = deque()
        self.waiting_tokens = 0

    def has_work(self) -> bool:
        return self.busy or bool(self.waiting)

    def load(self, req: Request) -> float:
        return (self.batch.reserved + self.waiting_tokens) / self.pool.kv_capacity_tokens

    decode_load = load

    def kv_used_tokens(self) -> int:
        b = self.batch
        return b.ctx_off + b.n * (b.step + self.steps_done_now(self.host.now))

    def _fits(self, req: Request) -> bool:
        b = self.batch
        if b.n == 0:
            return True  # alone it always runs, even if larger than the cache
        return b.n < self.pool.max_seqs and (
            b.reserved + req.prompt + req.output <= self.pool.kv_capacity_tokens
        )

    def offer(self, req: Request, now: float) -> None:
        """A request whose KV has landed here."""
        self.waiting.append(req)
        self.waiting_tokens += req.prompt + req.output
        if not self.busy:
            self._boundary(now)
        elif len(self.waiting) == 1 and self._fits(req):
            self._cut_span(now)

    offer_decode = offer

    def _boundary(self, now: float) -> None:
        b = self.batch
        host = self.host
        for req in b.pop_done():
            host.finish(req, now)
        w = self.waiting
        while w and self._fits(w[0]):
            req = w.popleft()
            need = req.prompt + req.output
            self.waiting_tokens -= need
            b.reserved += need
            b.admit(req)
            host.decode_admitted(req, now)
        if b.n:
            self._start_span(now)
        else:
            self.busy = False
            host.idle(self)


class PrefillInstance(Instance):
    """Batched prefill; the KV then goes to a decode worker over this instance's link."""

    role = Role.PREFILL

    def __init__(
        self,
        host: Host,
        config: SimConfig,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
        cache: PrefixCache,
    ) -> None:
        super().__init__(host, config, iid, pool, now, state)
        self.queue: deque[Request] = deque()
        self.queued_tokens = 0
        self.running: list[Request] = []
        self.running_tokens = 0
        self.t_start = now
        self.link_free = now
        self.cache = cache

    def has_work(self) -> bool:
        return self.busy or bool(self.queue)

    def load(self, req: Request) -> float:
        hit = self.cache.hit_tokens(req.hash_ids, req.prompt) if req.hash_ids else 0
        return self.queued_tokens + self.running_tokens - hit

    def offer(self, req: Request, now: float) -> None:
        self.queue.append(req)
        self.queued_tokens += req.prompt
        if not self.busy:
            self._start(now)

    def _start(self, now: float) -> None:
        cfg = self.config
        q, cache = self.queue, self.cache
        batch: list[Request] = []
        tokens = 0
        attn = 0.0
        caching = cfg.prefix_caching
        while q:
            r = q[0]
            hit = cache.hit_tokens(r.hash_ids, r.prompt) if caching and r.hash_ids else 0
            new = r.prompt - hit
            if batch and tokens + new > cfg.max_prefill_tokens:
                break
            q.popleft()
            self.queued_tokens -= r.prompt
            r.cached = hit
            tokens += new
            attn += new * hit + new * (new + 1) / 2
            batch.append(r)
        if caching:
            for r in batch:
                if r.hash_ids:
                    cache.use(r.hash_ids, r.prompt)
        self.running = batch
        self.running_tokens = tokens
        self.t_start = now
        self.busy = True
        host = self.host
        host.prefilled(tokens)
        dt = self.cost.step_time(tokens, attn, len(batch), 0, 0)
        host.schedule(now + dt, self._done, None)

    def _done(self, _: None) -> None:
        host, cfg = self.host, self.config
        now = host.now
        self.busy_s += now - self.t_start
        batch = self.running
        link = cfg.link
        assert link is not None
        # bytes occupy the link (FIFO); the fixed latency does not
        transfer_s = cfg.handoff_s(sum(r.prompt for r in batch))
        end = transfer_end(
            self.link_free, self.t_start, now, transfer_s, cfg.model.layers, cfg.layerwise
        )
        self.link_free = end
        end += link.latency_s
        for r in batch:
            r.t_prefill_end = now
        host.kv_sent(batch, end)
        self.running = []
        self.running_tokens = 0
        if self.queue:
            self._start(now)
        else:
            self.busy = False
            host.idle(self)
