"""The planner bench's pools as the simulator (``splitserve_operator.sim``): Llama 3.1 8B
on H100s, prefill and decode disaggregated over RoCE 400G, roofline costs, replicas
ready 30 s after they are asked for.

The simulator reports non-overlapping windows; the planner wants what Prometheus
would show over the last ``window_s`` (a rolling window) plus a short window for
arrivals. :class:`SimPools` ticks the simulator every ``fast_window_s`` and rolls
the sub-windows up: rates are time-weighted, percentiles are the sample-weighted
mean of the sub-windows' percentiles (the simulator keeps no histogram), queues
and KV use are the latest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from splitserve_operator.planner.model import Observation
from splitserve_operator.sim.config import Mode, Role, SimConfig, Slo, roofline_config
from splitserve_operator.sim.hardware import get_gpu, get_link
from splitserve_operator.sim.metrics import Percentiles, Window
from splitserve_operator.sim.model_spec import load_model_spec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Request

MODEL = "llama-3.1-8b"
GPU = "h100"
LINK = "roce400"
STARTUP_S = 30.0
PROMPT_TOKENS = 2048
OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class RatePhase:
    until_s: float
    rate: float
    """Requests/s arriving until ``until_s``."""


def config(prefill: int, decode: int) -> SimConfig:
    return roofline_config(
        load_model_spec(MODEL),
        Mode.DISAGGREGATED,
        get_gpu(GPU),
        link=get_link(LINK),
        prefill=prefill,
        decode=decode,
        startup_s=STARTUP_S,
    )


def arrivals(phases: Sequence[RatePhase], seed: int) -> Iterator[Request]:
    """Poisson arrivals whose rate follows ``phases``, generated lazily."""
    rng = np.random.default_rng(seed)
    t, rid, start = 0.0, 0, 0.0
    for phase in phases:
        t = max(t, start)
        while True:
            t += rng.exponential(1.0 / phase.rate)
            if t >= phase.until_s:
                t = phase.until_s
                break
            yield Request(rid, t, PROMPT_TOKENS, OUTPUT_TOKENS)
            rid += 1
        start = phase.until_s


def _weighted_p90(parts: Sequence[Percentiles | None]) -> float | None:
    have = [p for p in parts if p is not None and p.n > 0]
    if not have:
        return None
    return sum(p.p90 * p.n for p in have) / sum(p.n for p in have)


class SimPools:
    """The simulator behind the bench's environment interface."""

    def __init__(
        self,
        phases: Sequence[RatePhase],
        slo: Slo,
        *,
        start: tuple[int, int],
        window_s: float,
        fast_window_s: float,
        seed: int = 0,
    ) -> None:
        self.phases = tuple(phases)
        self.slo = slo
        self.sim = Simulator(config(*start), arrivals(self.phases, seed), slo=slo)
        self.window_s = window_s
        self.fast_window_s = fast_window_s
        self._windows: deque[Window] = deque()

    @property
    def end_s(self) -> float:
        return self.phases[-1].until_s

    def advance(self, t: float) -> None:
        """Run to ``t`` in steps of the fast window, keeping the sub-windows."""
        while self.sim.now < t - 1e-9:
            step = min(self.sim.now + self.fast_window_s, t)
            self._windows.append(self.sim.run_until(step))
            while self._windows and self._windows[0].t_end <= self.sim.now - self.window_s:
                self._windows.popleft()

    def replicas(self) -> tuple[int, int, int, int]:
        """(prefill asked, prefill ready, decode asked, decode ready)."""
        last = self._windows[-1] if self._windows else None
        ready = {
            role: (last.pools[role].active if last else self.sim.replicas(Role(role)))
            for role in ("prefill", "decode")
        }
        return (
            self.sim.replicas(Role.PREFILL),
            ready["prefill"],
            self.sim.replicas(Role.DECODE),
            ready["decode"],
        )

    def set_replicas(self, prefill: int, decode: int) -> None:
        self.sim.set_replicas(prefill=prefill, decode=decode)

    def observe(self) -> Observation:
        ws = list(self._windows)
        dur = sum(w.duration for w in ws) or 1e-9

        def rate(attr: str) -> float:
            return sum(getattr(w, attr) * w.duration for w in ws) / dur

        last = ws[-1]
        return Observation(
            ttft_s=_weighted_p90([w.ttft for w in ws]),
            tpot_s=_weighted_p90([w.tpot for w in ws]),
            request_rate=sum(w.completed for w in ws) / dur,
            prompt_token_rate=rate("input_token_rate"),
            prompt_token_rate_fast=last.input_token_rate,
            generation_token_rate=rate("output_token_rate"),
            prefill_queue=float(last.pools["prefill"].queue),
            decode_queue=float(last.pools["decode"].queue),
            kv_utilization=last.pools["decode"].kv_utilization,
            prefill_served_token_rate=rate("prefill_token_rate"),
            decode_served_token_rate=rate("output_token_rate"),
        )

    def finish(self) -> tuple[float, float]:
        """Run every request to its end: (SLO attainment, replica-seconds)."""
        result = self.sim.run()
        return result.attainment(self.slo), self.sim.gpu_seconds()


def static_attainment(
    prefill: int, decode: int, rate: float, slo: Slo, seconds: float, seed: int = 0
) -> float:
    sim = Simulator(config(prefill, decode), arrivals((RatePhase(seconds, rate),), seed), slo=slo)
    return sim.run().attainment(slo)
