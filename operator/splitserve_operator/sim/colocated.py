"""The colocated instance: one engine doing prefill and decode in the same steps."""

from __future__ import annotations

from collections import deque

from splitserve_operator.sim.config import PoolConfig, Role, SimConfig
from splitserve_operator.sim.instance_base import Host, SpanInstance, State
from splitserve_operator.sim.prefix import PrefixCache
from splitserve_operator.sim.workload import Request


class ColocatedInstance(SpanInstance):
    """One engine doing both: each step carries every running decode plus
    prompt chunks up to ``chunk_size`` tokens in all (decode first).

    Also the decode instance when the router may prefill locally
    (``SimConfig.local_prefill``): then it takes landed KV too (:meth:`offer_decode`)."""

    role = Role.BOTH

    def __init__(
        self,
        host: Host,
        config: SimConfig,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
        cache: PrefixCache,
        role: Role = Role.BOTH,
    ) -> None:
        super().__init__(host, config, iid, pool, now, state)
        self.role = role
        self.landed: deque[Request] = deque()
        self.landed_tokens = 0
        self.queue: deque[Request] = deque()
        self.queued_tokens = 0
        self.partial: list[Request] = []
        self.partial_tokens = 0
        self.finishing: list[Request] = []
        self.cache = cache
        self.mixed = False
        """The step in flight carries prefill (it is a single step, never cut)."""

    def has_work(self) -> bool:
        return self.busy or bool(self.queue) or bool(self.landed)

    def load(self, req: Request) -> float:
        hit = self.cache.hit_tokens(req.hash_ids, req.prompt) if req.hash_ids else 0
        # pending prompt tokens, plus a chunk's worth of weight per 32 running decodes
        return self.queued_tokens + self.partial_tokens - hit + self.batch.n * 16

    def decode_load(self, req: Request) -> float:
        b = self.batch
        return (b.reserved + self.landed_tokens + self.queued_tokens) / self.pool.kv_capacity_tokens

    def offer_decode(self, req: Request, now: float) -> None:
        """A request whose KV has landed here: it joins the batch at a step boundary."""
        self.landed.append(req)
        self.landed_tokens += req.prompt + req.output
        if not self.busy:
            self._boundary(now)
        elif not self.mixed and len(self.landed) == 1 and self._fits(req):
            self._cut_span(now)

    def kv_used_tokens(self) -> int:
        b = self.batch
        used = b.ctx_off + b.n * (
            b.step + (0 if self.mixed else self.steps_done_now(self.host.now))
        )
        return used + sum(r.done_tokens for r in self.partial)

    def _fits(self, req: Request) -> bool:
        b = self.batch
        if b.n == 0 and not self.partial:
            return True
        return b.n + len(self.partial) < self.pool.max_seqs and (
            b.reserved + req.prompt + req.output <= self.pool.kv_capacity_tokens
        )

    def offer(self, req: Request, now: float) -> None:
        self.queue.append(req)
        self.queued_tokens += req.prompt
        if not self.busy:
            self._boundary(now)
        elif not self.mixed and len(self.queue) == 1 and self._fits(req):
            self._cut_span(now)

    def _end_step(self, _: None) -> None:
        now = self.host.now
        b = self.batch
        b.tokens_out += b.n
        b.step += 1
        self.busy_s += now - self.span_t0
        self._boundary(now)

    def _boundary(self, now: float) -> None:
        b = self.batch
        host = self.host
        for req in b.pop_done():
            host.finish(req, now)
        if self.finishing:
            for req in self.finishing:
                host.first_token(req, now)
                if req.output == 1:
                    b.reserved -= req.prompt + req.output
                    host.finish(req, now)
                else:
                    b.admit(req)
            self.finishing = []
        landed = self.landed
        while landed and self._fits(landed[0]):
            req = landed.popleft()
            need = req.prompt + req.output
            self.landed_tokens -= need
            b.reserved += need
            b.admit(req)
            host.decode_admitted(req, now)
        q = self.queue
        caching = self.config.prefix_caching
        while q and self._fits(q[0]):
            req = q.popleft()
            self.queued_tokens -= req.prompt
            b.reserved += req.prompt + req.output
            hit = self.cache.use(req.hash_ids, req.prompt) if caching and req.hash_ids else 0
            req.cached = hit
            req.done_tokens = hit
            self.partial.append(req)
            self.partial_tokens += req.prompt - hit
        if self.partial:
            self._start_mixed(now)
        elif b.n:
            self.mixed = False
            self._start_span(now)
        else:
            self.busy = False
            self.mixed = False
            host.idle(self)

    def _start_mixed(self, now: float) -> None:
        b = self.batch
        budget = self.config.chunk_size - b.n
        tokens = 0
        attn = 0.0
        seqs = 0
        for r in self.partial:
            if budget <= 0:
                break
            n = min(r.prompt - r.done_tokens, budget)
            attn += n * r.done_tokens + n * (n + 1) / 2
            r.done_tokens += n
            tokens += n
            budget -= n
            seqs += 1
            if r.done_tokens >= r.prompt:
                self.finishing.append(r)
        if self.finishing:
            self.partial = [r for r in self.partial if r.done_tokens < r.prompt]
        self.partial_tokens -= tokens
        self.host.prefilled(tokens)
        self.mixed = True
        self.busy = True
        self.span_t0 = now
        self.span_k = 1
        self.version += 1
        dt = self.cost.step_time(tokens, attn, seqs, b.n, b.ctx_sum())
        self.host.schedule(now + dt, self._end_step, None)
