"""The simulator's observations: per-window reports, GPU time, and the final result."""

from __future__ import annotations

import numpy as np

from splitserve_operator.sim.config import Role
from splitserve_operator.sim.events import EventLoop
from splitserve_operator.sim.instances import (
    ColocatedInstance,
    DecodeInstance,
    PrefillInstance,
    State,
)
from splitserve_operator.sim.metrics import Percentiles, PoolObservation, SimResult, Window


class WindowsMixin(EventLoop):
    """What the planner and the benches read: windows, GPU-seconds, the result."""

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
        self._w_ttft = []
        self._w_tpot = []
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
