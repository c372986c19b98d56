"""The event loop, the router, and the pools' sizes over time.

See the package docstring for the API the planner drives.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from splitserve_operator.sim.config import ConfigError, Mode, Role, SimConfig, Slo
from splitserve_operator.sim.instances import (
    ColocatedInstance,
    DecodeInstance,
    Instance,
    PrefillInstance,
    State,
)
from splitserve_operator.sim.metrics import Percentiles, PoolObservation, SimResult, Window
from splitserve_operator.sim.prefix import PrefixCache
from splitserve_operator.sim.workload import Request, Workload

Event = tuple[float, int, Callable[[Any], None], Any]


class Simulator:
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

    # ---------------------------------------------------------------- events
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

    # ---------------------------------------------------------------- public API
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

    def set_replicas(
        self, *, prefill: int | None = None, decode: int | None = None, both: int | None = None
    ) -> None:
        """Resize pools from now on. Added instances take work after
        ``config.startup_s``; removed ones are the starting ones first, then the
        least loaded, which drain (finish what they hold) before their GPUs go."""
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            if n is None:
                continue
            if role not in self.pools:
                raise ConfigError(f"this simulation ({self.config.mode}) has no {role} pool")
            if n < 0:
                raise ConfigError(f"replicas of {role} must be >= 0")
            self._resize(role, n)

    def replicas(self, role: Role) -> int:
        """Instances of ``role`` that are active or starting (what was last asked for)."""
        return sum(1 for i in self.pools[role] if i.state in (State.ACTIVE, State.STARTING))

    def observe(self) -> Window:
        """Report the window since the last observation and start a new one."""
        now = self.now
        dur = max(now - self._w_start, 1e-12)
        ttft = Percentiles.of(self._w_ttft)
        tpot = Percentiles.of(self._w_tpot)
        attain = self._w_ok / len(self._w_tpot) if self.slo is not None and self._w_tpot else None
        pools = {str(role): self._observe_pool(role, dur) for role in self.pools}
        gpu_s = self.gpu_seconds()
        out_tokens = self._decode_tokens() + self._w_first
        w = Window(
            t_start=self._w_start,
            t_end=now,
            arrivals=self._w_arrivals,
            request_rate=self._w_arrivals / dur,
            input_token_rate=self._w_in_tokens / dur,
            output_token_rate=(out_tokens - self._w_out0) / dur,
            prefill_token_rate=(self.prefill_tokens - self._w_prefill0) / dur,
            first_tokens=self._w_first,
            completed=len(self._w_tpot),
            ttft=ttft,
            tpot=tpot,
            slo_attainment=attain,
            pools=pools,
            transfers_in_flight=self.transfers_in_flight,
            gpus=self.gpus(),
            gpu_seconds=gpu_s - self._w_gpu_s0,
        )
        self._reset_window(now)
        return w

    def gpus(self) -> int:
        return sum(i.pool.tp for p in self.pools.values() for i in p if i.state is not State.GONE)

    def gpu_seconds(self) -> float:
        """GPU-seconds held so far (every instance from its adding to its going)."""
        live = sum(
            i.pool.tp * (self.now - i.created_at)
            for p in self.pools.values()
            for i in p
            if i.state is not State.GONE
        )
        return self._gone_gpu_seconds + live

    def result(self) -> SimResult:
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
            gpu_seconds=self.gpu_seconds(),
            gpus=self.config.gpus,
            extra={
                "prefill_tokens": float(self.prefill_tokens),
                "local_prefills": float(self.local_prefills),
            },
        )

    # ---------------------------------------------------------------- instances
    def _add_instance(self, role: Role, state: State) -> Instance:
        cfg = self.config
        pool = cfg.pools[role]
        iid = next(self._ids)
        inst: Instance
        blocks = pool.kv_capacity_tokens // self._block_tokens if cfg.prefix_caching else 0
        if role is Role.DECODE and cfg.local_prefill is None:
            inst = DecodeInstance(self, iid, pool, self.now, state)
        elif role is Role.PREFILL:
            inst = PrefillInstance(
                self, iid, pool, self.now, state, PrefixCache(blocks, self._block_tokens)
            )
        else:
            cache = PrefixCache(blocks, self._block_tokens)
            inst = ColocatedInstance(self, iid, pool, self.now, state, cache, role)
        self.pools[role].append(inst)
        if state is State.STARTING:
            self.schedule(self.now + cfg.startup_s, self._ready, inst)
        return inst

    def _ready(self, inst: Instance) -> None:
        if inst.state is State.STARTING:
            inst.state = State.ACTIVE
            self._dispatch_pending(inst.role)

    def _resize(self, role: Role, n: int) -> None:
        pool = self.pools[role]
        live = [i for i in pool if i.state in (State.ACTIVE, State.STARTING)]
        if n > len(live):
            need = n - len(live)
            for inst in [i for i in pool if i.state is State.DRAINING][:need]:
                inst.state = State.ACTIVE
                need -= 1
            for _ in range(need):
                self._add_instance(
                    role, State.STARTING if self.config.startup_s > 0 else State.ACTIVE
                )
            self._dispatch_pending(role)
        elif n < len(live):
            excess = len(live) - n
            starting = [i for i in reversed(live) if i.state is State.STARTING]
            for inst in starting[:excess]:
                self._retire(inst)
                excess -= 1
            active = sorted((i for i in live if i.state is State.ACTIVE), key=self._idle_score)
            for inst in active[:excess]:
                inst.state = State.DRAINING
                if not inst.has_work():
                    self._retire(inst)

    @staticmethod
    def _idle_score(inst: Instance) -> float:
        if isinstance(inst, DecodeInstance):
            return inst.batch.reserved + inst.waiting_tokens
        if isinstance(inst, ColocatedInstance):
            return inst.batch.reserved + inst.queued_tokens
        assert isinstance(inst, PrefillInstance)
        return inst.queued_tokens + inst.running_tokens

    def _retire(self, inst: Instance) -> None:
        inst.state = State.GONE
        inst.removed_at = self.now
        self._gone_gpu_seconds += inst.pool.tp * (self.now - inst.created_at)
        b = getattr(inst, "batch", None)
        if b is not None:
            self._gone_tokens += b.tokens_out
        self.pools[inst.role].remove(inst)

    def idle(self, inst: Instance) -> None:
        """An instance ran out of work."""
        if inst.state is State.DRAINING:
            self._retire(inst)

    # ---------------------------------------------------------------- routing
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

    # ---------------------------------------------------------------- callbacks
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

    # ---------------------------------------------------------------- windows
    def _decode_tokens(self) -> int:
        n = 0
        for p in self.pools.values():
            for i in p:
                b = getattr(i, "batch", None)
                if b is not None:
                    n += b.tokens_out
        return n + self._gone_tokens

    def _reset_window(self, t: float) -> None:
        self._w_start = t
        self._w_arrivals = 0
        self._w_in_tokens = 0
        self._w_first = 0
        self._w_ttft: list[float] = []
        self._w_tpot: list[float] = []
        self._w_ok = 0
        self._w_prefill0 = self.prefill_tokens
        self._w_out0 = self._decode_tokens() + self._w_first
        self._w_gpu_s0 = self.gpu_seconds()
        self._w_busy0 = {i.iid: i.busy_s for p in self.pools.values() for i in p}

    def _observe_pool(self, role: Role, dur: float) -> PoolObservation:
        insts = self.pools[role]
        pool_cfg = self.config.pools[role]
        pending = self._pending[role]
        queue = len(pending)
        queue_tokens = sum(r.prompt for r in pending)
        running = 0
        used = 0
        busy = 0.0
        for i in insts:
            busy += i.busy_s - self._w_busy0.get(i.iid, 0.0)
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
