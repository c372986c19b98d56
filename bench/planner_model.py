"""A small queueing model of a prefill pool and a decode pool, for the planner bench.

Time-stepped (``dt`` seconds), per request, deterministic for a seed:

- prefill: one FIFO across the pool; the pool computes ``ready * prefill_tps``
  prompt tokens per second; a request's first token comes when its prompt is
  done, never sooner than ``prompt / prefill_tps`` after it started (one
  prompt runs on one replica) plus a fixed KV hand-off.
- decode: a request joins the running batch when a KV slot is free
  (``ready * kv_slots``), else waits in the decode queue. Each replica's batch
  of ``B`` sequences steps every ``tpot(B) = tpot_base + tpot_per_seq * B``
  seconds (memory-bound decode: a bigger batch is slower per step).
- replicas: a scale-up is ready ``startup_s`` later; a scale-down removes
  capacity at once (drained sequences keep running on the rest).

It exposes what Prometheus would: windowed rates, p-quantiles of TTFT and
TPOT over the window, queue gauges, KV utilisation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from splitserve_operator.planner.model import Observation


@dataclass(frozen=True)
class ModelParams:
    prefill_tps: float = 8000.0
    """Prompt tokens/s one prefill replica computes."""
    handoff_s: float = 0.02
    """KV hand-off from prefill to decode (s)."""
    tpot_base: float = 0.020
    """Decode step time with an empty batch (s)."""
    tpot_per_seq: float = 0.0004
    """Extra step time per running sequence (s)."""
    kv_slots: int = 128
    """Sequences one decode replica holds in its KV cache."""
    startup_s: float = 30.0
    """From a scale-up to the new replica being ready (s)."""


@dataclass(frozen=True)
class Phase:
    until_s: float
    rate: float
    """Requests/s arriving until ``until_s``."""


@dataclass
class _Req:
    arrival: float
    prompt: int
    output: int
    prefill_left: float = 0.0
    prefill_start: float = -1.0
    t_first: float = -1.0
    t_last: float = -1.0


@dataclass
class QueueModel:
    phases: tuple[Phase, ...]
    prompt_tokens: int = 512
    output_tokens: int = 128
    prefill_replicas: int = 2
    decode_replicas: int = 2
    params: ModelParams = field(default_factory=ModelParams)
    dt: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        self.now = 0.0
        self._rng = np.random.default_rng(self.seed)
        self._desired = [self.prefill_replicas, self.decode_replicas]
        self._ready = [self.prefill_replicas, self.decode_replicas]
        self._pending: list[deque[tuple[float, int]]] = [deque(), deque()]
        self._prefill_q: deque[_Req] = deque()
        self._handoff: deque[tuple[float, _Req]] = deque()
        self._decode_q: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._progress = np.zeros(0)
        self.finished: list[_Req] = []
        self.all: list[_Req] = []
        # per-step ledgers for windowed rates: (time, prompt arrivals, gen tokens, prefilled)
        self._ledger: deque[tuple[float, int, float, float]] = deque()
        self._first_tokens: deque[tuple[float, float]] = deque()
        self._done: deque[tuple[float, float]] = deque()
        self.replica_seconds = 0.0

    # ---- control ----
    def replicas(self) -> tuple[int, int, int, int]:
        """(prefill asked, prefill ready, decode asked, decode ready)."""
        return self._desired[0], self._ready[0], self._desired[1], self._ready[1]

    def set_replicas(self, prefill: int, decode: int) -> None:
        for pool, n in enumerate((prefill, decode)):
            have = self._desired[pool]
            if n > have:
                self._pending[pool].append((self.now + self.params.startup_s, n - have))
            elif n < have:
                cut = have - n
                # cancel starting replicas first, then remove ready ones
                while cut and self._pending[pool]:
                    at, k = self._pending[pool].pop()
                    drop = min(k, cut)
                    cut -= drop
                    if k - drop:
                        self._pending[pool].append((at, k - drop))
                self._ready[pool] -= cut
            self._desired[pool] = n

    # ---- time ----
    def _rate(self, t: float) -> float:
        for p in self.phases:
            if t < p.until_s:
                return p.rate
        return 0.0

    @property
    def end_s(self) -> float:
        return self.phases[-1].until_s

    def run_until(self, t_end: float) -> None:
        while self.now < t_end - 1e-9:
            self._step()

    def _step(self) -> None:
        dt, now, prm = self.dt, self.now, self.params
        for pool in (0, 1):
            while self._pending[pool] and self._pending[pool][0][0] <= now:
                self._ready[pool] += self._pending[pool].popleft()[1]
        self.replica_seconds += (self._desired[0] + self._desired[1]) * dt
        # arrivals
        n_new = int(self._rng.poisson(self._rate(now) * dt))
        for i in range(n_new):
            r = _Req(now + dt * (i + 0.5) / n_new, self.prompt_tokens, self.output_tokens)
            r.prefill_left = r.prompt
            self._prefill_q.append(r)
            self.all.append(r)
        # prefill: a fluid FIFO over the pool's tokens/s; a prompt still takes at
        # least prompt / prefill_tps (it runs on one replica)
        budget = self._ready[0] * prm.prefill_tps * dt
        prefilled = 0.0
        for r in self._prefill_q:
            if budget <= 0:
                break
            if r.prefill_start < 0:
                r.prefill_start = now
            take = min(r.prefill_left, budget)
            r.prefill_left -= take
            budget -= take
            prefilled += take
        while self._prefill_q and self._prefill_q[0].prefill_left <= 1e-9:
            r = self._prefill_q.popleft()
            done_at = max(now + dt, r.prefill_start + r.prompt / prm.prefill_tps)
            self._handoff.append((done_at + prm.handoff_s, r))
        while self._handoff and self._handoff[0][0] <= now + dt:
            at, r = self._handoff.popleft()
            at = max(at, now)
            r.t_first = at
            self._first_tokens.append((at, at - r.arrival))
            self._decode_q.append(r)
        # decode admission (KV slots)
        slots = self._ready[1] * prm.kv_slots
        admitted: list[_Req] = []
        while self._decode_q and len(self._running) + len(admitted) < slots:
            admitted.append(self._decode_q.popleft())
        if admitted:
            self._running.extend(admitted)
            self._progress = np.concatenate([self._progress, np.ones(len(admitted))])
        gen = 0.0
        if self._running and self._ready[1] > 0:
            batch = len(self._running) / self._ready[1]
            tpot = prm.tpot_base + prm.tpot_per_seq * batch
            step_tokens = dt / tpot
            outputs = np.array([r.output for r in self._running], dtype=float)
            before = self._progress
            self._progress = np.minimum(before + step_tokens, outputs)
            gen = float((self._progress - before).sum())
            done = self._progress >= outputs - 1e-9
            if done.any():
                keep = []
                for i, r in enumerate(self._running):
                    if done[i]:
                        # time of the last token inside this step
                        frac = (outputs[i] - before[i]) / step_tokens
                        r.t_last = now + dt * frac
                        self.finished.append(r)
                        tpot_r = (r.t_last - r.t_first) / max(r.output - 1, 1)
                        self._done.append((r.t_last, tpot_r))
                    else:
                        keep.append(i)
                self._running = [self._running[i] for i in keep]
                self._progress = self._progress[keep]
        self._ledger.append((now + dt, n_new * self.prompt_tokens, gen, prefilled))
        self.now = now + dt
        horizon = self.now - 600.0
        for q in (self._ledger, self._first_tokens, self._done):
            while q and q[0][0] < horizon:
                q.popleft()

    # ---- what Prometheus would show ----
    def observe(self, window_s: float, quantile: float, fast_window_s: float) -> Observation:
        # Like Prometheus' rate(), a window longer than the history covers the history.
        window_s = min(window_s, self.now)
        fast_window_s = min(fast_window_s, self.now)
        lo = self.now - window_s
        fast_lo = self.now - fast_window_s
        fast = 0.0
        prompt = gen = prefilled = 0.0
        for t, p, g, pf in reversed(self._ledger):
            if t <= lo:
                break
            prompt += p
            if t > fast_lo:
                fast += p
            gen += g
            prefilled += pf
        ttfts = [v for t, v in self._first_tokens if t > lo]
        tpots = [v for t, v in self._done if t > lo]
        kv_total = self._ready[1] * self.params.kv_slots
        return Observation(
            ttft_s=_quantile(ttfts, quantile),
            tpot_s=_quantile(tpots, quantile),
            request_rate=len(tpots) / window_s,
            prompt_token_rate=prompt / window_s,
            prompt_token_rate_fast=fast / fast_window_s,
            generation_token_rate=gen / window_s,
            prefill_queue=float(sum(1 for r in self._prefill_q if r.prefill_start < 0)),
            decode_queue=float(len(self._decode_q)),
            kv_utilization=(len(self._running) / kv_total) if kv_total else 1.0,
            prefill_served_token_rate=prefilled / window_s,
            decode_served_token_rate=gen / window_s,
        )

    def attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        """Requests meeting both SLOs over all that arrived (unfinished ones are misses)."""
        if not self.all:
            return 1.0
        good = 0
        for r in self.finished:
            tpot = (r.t_last - r.t_first) / max(r.output - 1, 1)
            if r.t_first - r.arrival <= ttft_slo and tpot <= tpot_slo:
                good += 1
        return good / len(self.all)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.quantile(np.asarray(values), q))
