"""Engine instances: a prefill worker, a decode worker, a colocated worker.

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

import heapq
from collections import deque
from enum import IntEnum
from typing import TYPE_CHECKING

from splitserve_operator.sim.config import PoolConfig, Role
from splitserve_operator.sim.cost import CostModel, transfer_end
from splitserve_operator.sim.prefix import PrefixCache
from splitserve_operator.sim.workload import Request

if TYPE_CHECKING:
    from splitserve_operator.sim.simulator import Simulator


class State(IntEnum):
    STARTING = 0
    """Added, loading its model: takes no work until ``ready_at``."""
    ACTIVE = 1
    DRAINING = 2
    """Being removed: takes no new work, finishes what it holds, then goes."""
    GONE = 3


def steps_until(cost: CostModel, n: int, ctx: float, k: int, dt: float) -> int:
    """Smallest ``j`` in ``[1, k]`` whose span of ``j`` decode steps lasts at least ``dt``
    (``k`` when none does)."""
    lo, hi = 1, k
    while lo < hi:
        mid = (lo + hi) // 2
        if cost.decode_span(n, ctx, mid) >= dt:
            hi = mid
        else:
            lo = mid + 1
    return lo


class DecodeBatch:
    """The running decode sequences of one instance.

    Sequence ``r`` admitted at step ``s0`` with context ``c`` attends to
    ``c + (s - s0)`` positions at step ``s``, so the batch's context sum at step
    ``s`` is ``ctx_off + n * s`` with ``ctx_off = sum(c - s0)``: joining and
    finishing are O(log n) and a span needs no per-sequence work.
    """

    __slots__ = ("ctx_off", "done", "n", "reserved", "step", "tokens_out")

    def __init__(self) -> None:
        self.step = 0
        self.n = 0
        self.ctx_off = 0
        self.reserved = 0
        self.tokens_out = 0
        self.done: list[tuple[int, int, Request, int]] = []

    def ctx_sum(self) -> int:
        return self.ctx_off + self.n * self.step

    def admit(self, req: Request) -> None:
        """Join at the current step boundary; the next step decodes its second token."""
        off = req.prompt + 1 - self.step
        heapq.heappush(self.done, (self.step + req.output - 1, req.rid, req, off))
        self.n += 1
        self.ctx_off += off

    def pop_done(self) -> list[Request]:
        out = []
        done = self.done
        while done and done[0][0] <= self.step:
            _, _, req, off = heapq.heappop(done)
            self.n -= 1
            self.ctx_off -= off
            self.reserved -= req.prompt + req.output
            out.append(req)
        return out

    def steps_to_next_done(self) -> int:
        return self.done[0][0] - self.step


class Instance:
    """What every instance has: identity, lifecycle, accounting."""

    role: Role

    def __init__(
        self, sim: Simulator, iid: int, pool: PoolConfig, now: float, state: State
    ) -> None:
        self.sim = sim
        self.iid = iid
        self.pool = pool
        self.cost = pool.cost
        self.state = state
        self.created_at = now
        self.removed_at = -1.0
        self.busy_s = 0.0
        """Seconds spent computing, summed at the end of each step or span."""
        self.busy = False
        self.version = 0

    def has_work(self) -> bool:
        raise NotImplementedError

    def load(self, req: Request) -> float:
        """Routing score for sending ``req`` here: lower is better."""
        raise NotImplementedError

    def kv_used_tokens(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.iid}, {self.state.name})"


class _SpanMixin:
    """Pure-decode spans shared by the decode and colocated instances."""

    sim: Simulator
    cost: CostModel
    batch: DecodeBatch
    version: int
    busy: bool
    busy_s: float
    span_t0: float
    span_k: int

    def _start_span(self, now: float) -> None:
        b = self.batch
        k = b.steps_to_next_done()
        self.span_t0, self.span_k = now, k
        self.busy = True
        self.version += 1
        self.sim.schedule(
            now + self.cost.decode_span(b.n, b.ctx_sum(), k), self._end_span, self.version
        )

    def _end_span(self, version: int) -> None:
        if version != self.version:
            return
        now = self.sim.now
        b = self.batch
        b.tokens_out += b.n * self.span_k
        b.step += self.span_k
        self.busy_s += now - self.span_t0
        self._boundary(now)

    def _cut_span(self, now: float) -> None:
        """End the running span at the first step boundary at or after ``now``."""
        b = self.batch
        j = steps_until(self.cost, b.n, b.ctx_sum(), self.span_k, now - self.span_t0)
        if j < self.span_k:
            self.span_k = j
            self.version += 1
            t = self.span_t0 + self.cost.decode_span(b.n, b.ctx_sum(), j)
            self.sim.schedule(max(t, now), self._end_span, self.version)

    def steps_done_now(self, now: float) -> int:
        """Steps of the running span completed by ``now`` (for observations)."""
        if not self.busy or self.span_k <= 0:
            return 0
        b = self.batch
        j = steps_until(self.cost, b.n, b.ctx_sum(), self.span_k, now - self.span_t0)
        t = self.span_t0 + self.cost.decode_span(b.n, b.ctx_sum(), j)
        return j if t <= now else j - 1

    def _boundary(self, now: float) -> None:
        raise NotImplementedError


class DecodeInstance(_SpanMixin, Instance):
    """Continuous batching: requests whose KV has arrived join at step boundaries."""

    role = Role.DECODE

    def __init__(
        self, sim: Simulator, iid: int, pool: PoolConfig, now: float, state: State
    ) -> None:
        super().__init__(sim, iid, pool, now, state)
        self.batch = DecodeBatch()
        self.waiting: deque[Request] = deque()
        self.waiting_tokens = 0
        self.span_t0 = now
        self.span_k = 0

    def has_work(self) -> bool:
        return self.busy or bool(self.waiting)

    def load(self, req: Request) -> float:
        return (self.batch.reserved + self.waiting_tokens) / self.pool.kv_capacity_tokens

    decode_load = load

    def kv_used_tokens(self) -> int:
        b = self.batch
        return b.ctx_off + b.n * (b.step + self.steps_done_now(self.sim.now))

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
        sim = self.sim
        for req in b.pop_done():
            sim.finish(req, now)
        w = self.waiting
        while w and self._fits(w[0]):
            req = w.popleft()
            need = req.prompt + req.output
            self.waiting_tokens -= need
            b.reserved += need
            b.admit(req)
            sim.decode_admitted(req, now)
        if b.n:
            self._start_span(now)
        else:
            self.busy = False
            sim.idle(self)


class PrefillInstance(Instance):
    """Batched prefill; the KV then goes to a decode worker over this instance's link."""

    role = Role.PREFILL

    def __init__(
        self,
        sim: Simulator,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
        cache: PrefixCache,
    ) -> None:
        super().__init__(sim, iid, pool, now, state)
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
        sim, cfg = self.sim, self.sim.config
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
        sim.prefill_tokens += tokens
        dt = self.cost.step_time(tokens, attn, len(batch), 0, 0)
        sim.schedule(now + dt, self._done, None)

    def _done(self, _: None) -> None:
        sim, cfg = self.sim, self.sim.config
        now = sim.now
        self.busy_s += now - self.t_start
        batch = self.running
        link = cfg.link
        assert link is not None
        kv_bytes = sum(r.prompt for r in batch) * cfg.model.kv_bytes_per_token
        # bytes occupy the link (FIFO); the fixed latency does not
        transfer_s = kv_bytes / (link.bandwidth * cfg.links_per_instance)
        end = transfer_end(
            self.link_free, self.t_start, now, transfer_s, cfg.model.layers, cfg.layerwise
        )
        self.link_free = end
        end += link.latency_s
        for r in batch:
            r.t_prefill_end = now
        sim.kv_sent(batch, end)
        self.running = []
        self.running_tokens = 0
        if self.queue:
            self._start(now)
        else:
            self.busy = False
            sim.idle(self)


class ColocatedInstance(_SpanMixin, Instance):
    """One engine doing both: each step carries every running decode plus
    prompt chunks up to ``chunk_size`` tokens in all (decode first).

    Also the decode instance when the router may prefill locally
    (``SimConfig.local_prefill``): then it takes landed KV too (:meth:`offer_decode`)."""

    role = Role.BOTH

    def __init__(
        self,
        sim: Simulator,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
        cache: PrefixCache,
        role: Role = Role.BOTH,
    ) -> None:
        super().__init__(sim, iid, pool, now, state)
        self.role = role
        self.landed: deque[Request] = deque()
        self.landed_tokens = 0
        self.batch = DecodeBatch()
        self.queue: deque[Request] = deque()
        self.queued_tokens = 0
        self.partial: list[Request] = []
        self.partial_tokens = 0
        self.finishing: list[Request] = []
        self.cache = cache
        self.span_t0 = now
        self.span_k = 0
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
        used = b.ctx_off + b.n * (b.step + (0 if self.mixed else self.steps_done_now(self.sim.now)))
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
        now = self.sim.now
        b = self.batch
        b.tokens_out += b.n
        b.step += 1
        self.busy_s += now - self.span_t0
        self._boundary(now)

    def _boundary(self, now: float) -> None:
        b = self.batch
        sim = self.sim
        for req in b.pop_done():
            sim.finish(req, now)
        if self.finishing:
            for req in self.finishing:
                sim.first_token(req, now)
                if req.output == 1:
                    b.reserved -= req.prompt + req.output
                    sim.finish(req, now)
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
            sim.decode_admitted(req, now)
        q = self.queue
        caching = sim.config.prefix_caching
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
            sim.idle(self)

    def _start_mixed(self, now: float) -> None:
        b = self.batch
        budget = self.sim.config.chunk_size - b.n
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
        self.sim.prefill_tokens += tokens
        self.mixed = True
        self.busy = True
        self.span_t0 = now
        self.span_k = 1
        self.version += 1
        dt = self.cost.step_time(tokens, attn, seqs, b.n, b.ctx_sum())
        self.sim.schedule(now + dt, self._end_step, None)
