"""What every simulated instance shares: what it needs of the simulation, its lifecycle
state and accounting, and the decode spans of the instances that batch decodes.

:class:`Host` is all an instance sees of the simulator: the clock, and the calls it makes
when a request reaches a milestone. :class:`Instance` is the abstract base of the
prefill, decode and colocated instances; :class:`SpanInstance` advances a pure-decode
batch ``k`` steps per event and cuts a span short at the next step boundary when work
arrives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import Protocol

from splitserve_operator.sim.config import PoolConfig, Role, SimConfig
from splitserve_operator.sim.decode_batch import DecodeBatch, steps_until
from splitserve_operator.sim.events import Clock
from splitserve_operator.sim.workload import Request


class Host(Clock, Protocol):
    """What an instance needs of the simulation it runs in."""

    def prefilled(self, tokens: int) -> None:
        """``tokens`` prompt tokens were computed (not counting prefix-cache hits)."""
        ...

    def kv_sent(self, batch: list[Request], t_landed: float) -> None:
        """A prefill batch's KV will have landed on the decode side at ``t_landed``."""
        ...

    def first_token(self, req: Request, t: float) -> None:
        """``req``'s first token is out at ``t``."""
        ...

    def decode_admitted(self, req: Request, t: float) -> None:
        """``req`` joined a decode batch at ``t``."""
        ...

    def finish(self, req: Request, t: float) -> None:
        """``req``'s last token is out at ``t``."""
        ...

    def idle(self, inst: Instance) -> None:
        """``inst`` ran out of work."""
        ...


class State(IntEnum):
    STARTING = 0
    """Added, loading its model: takes no work until ``ready_at``."""
    ACTIVE = 1
    DRAINING = 2
    """Being removed: takes no new work, finishes what it holds, then goes."""
    GONE = 3


class Instance(ABC):
    """What every instance has: identity, lifecycle, accounting."""

    role: Role

    def __init__(
        self,
        host: Host,
        config: SimConfig,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
    ) -> None:
        self.host = host
        self.config = config
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

    @abstractmethod
    def has_work(self) -> bool:
        """Whether the instance holds or computes anything."""

    @abstractmethod
    def load(self, req: Request) -> float:
        """Routing score for sending ``req`` here: lower is better."""

    def kv_used_tokens(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.iid}, {self.state.name})"


class SpanInstance(Instance):
    """An instance that runs a decode batch in spans (the decode and colocated ones)."""

    def __init__(
        self,
        host: Host,
        config: SimConfig,
        iid: int,
        pool: PoolConfig,
        now: float,
        state: State,
    ) -> None:
        super().__init__(host, config, iid, pool, now, state)
        self.batch = DecodeBatch()
        self.span_t0 = now
        self.span_k = 0

    def _start_span(self, now: float) -> None:
        b = self.batch
        k = b.steps_to_next_done()
        self.span_t0, self.span_k = now, k
        self.busy = True
        self.version += 1
        self.host.schedule(
            now + self.cost.decode_span(b.n, b.ctx_sum(), k), self._end_span, self.version
        )

    def _end_span(self, version: int) -> None:
        if version != self.version:
            return
        now = self.host.now
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
            self.host.schedule(max(t, now), self._end_span, self.version)

    def steps_done_now(self, now: float) -> int:
        """Steps of the running span completed by ``now`` (for observations)."""
        if not self.busy or self.span_k <= 0:
            return 0
        b = self.batch
        j = steps_until(self.cost, b.n, b.ctx_sum(), self.span_k, now - self.span_t0)
        t = self.span_t0 + self.cost.decode_span(b.n, b.ctx_sum(), j)
        return j if t <= now else j - 1

    @abstractmethod
    def _boundary(self, now: float) -> None:
        """At a step boundary: retire finished sequences, admit waiting ones, step on."""
