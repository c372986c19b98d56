"""The flex bench's simulated half: Llama 3.1 70B on H100s (TP 4), prefill and decode
disaggregated over RoCE 400G, a new pod ready five minutes after it is asked for.

The same trace (long-prompt and long-generation phases taking turns) runs twice under
the operator's planner, ticking every ``TICK_S``: once scaling with new pods (what the
planner does today), once with the same GPUs as switchable workers and no new pods,
the planner's :func:`~splitserve_operator.planner.flex.rebalance` switching one at a
time (a switch costs its drain, ``SWITCH_S``, not a cold start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from splitserve.role_balance import BalanceConfig, BalanceMemory, Costs, Split
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.flex import rebalance
from splitserve_operator.planner.model import (
    Bounds,
    Observation,
    PlannerState,
    PoolStatus,
    Slo,
    Tick,
)
from splitserve_operator.sim.config import Mode, Role, roofline_config
from splitserve_operator.sim.config import Slo as SimSlo
from splitserve_operator.sim.hardware import get_gpu, get_link
from splitserve_operator.sim.metrics import Percentiles, Window
from splitserve_operator.sim.model_spec import load_model_spec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Request

MODEL, GPU, LINK, TP = "llama-3.1-70b", "h100", "roce400", 4
COLD_START_S = 300.0
"""Scheduling, image pull and 140 GB of weights: minutes."""
SWITCH_S = 20.0
"""A switching worker's drain bound: its streams run this long, then migrate."""
TICK_S = 10.0
WINDOW_S = 60.0
SLO = SimSlo(ttft_s=2.0, tpot_s=0.06)


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float
    prompt: int
    output: int


def arrivals(phases: Sequence[Phase], seed: int) -> Iterator[Request]:
    rng = np.random.default_rng(seed)
    t0, rid = 0.0, 0
    for ph in phases:
        t = t0
        while True:
            t += rng.exponential(1.0 / ph.rate)
            if t >= t0 + ph.seconds:
                break
            yield Request(rid, t, ph.prompt, ph.output)
            rid += 1
        t0 += ph.seconds


def _p90(parts: Sequence[Percentiles | None]) -> float | None:
    have = [p for p in parts if p is not None and p.n > 0]
    return sum(p.p90 * p.n for p in have) / sum(p.n for p in have) if have else None


class Run:
    """One simulation under the planner: rolling observations, one decision per tick."""

    def __init__(self, phases: Sequence[Phase], start: tuple[int, int], seed: int) -> None:
        cfg = roofline_config(load_model_spec(MODEL), Mode.DISAGGREGATED, get_gpu(GPU),
                              link=get_link(LINK), tp=TP, prefill=start[0], decode=start[1],
                              startup_s=COLD_START_S)  # fmt: skip
        self.sim = Simulator(cfg, arrivals(phases, seed), slo=SLO)
        self.end_s = sum(p.seconds for p in phases)
        self.windows: deque[Window] = deque()
        self.switches: list[tuple[float, Role]] = []

    def step(self, t: float) -> None:
        self.windows.append(self.sim.run_until(t))
        while self.windows and self.windows[0].t_end <= t - WINDOW_S:
            self.windows.popleft()

    def observe(self) -> Observation:
        ws = list(self.windows)
        dur = sum(w.duration for w in ws) or 1e-9

        def rate(attr: str) -> float:
            return sum(getattr(w, attr) * w.duration for w in ws) / dur

        last = ws[-1]
        return Observation(
            ttft_s=_p90([w.ttft for w in ws]), tpot_s=_p90([w.tpot for w in ws]),
            request_rate=sum(w.completed for w in ws) / dur,
            prompt_token_rate=rate("input_token_rate"),
            prompt_token_rate_fast=last.input_token_rate,
            generation_token_rate=rate("output_token_rate"),
            prefill_queue=float(last.pools["prefill"].queue),
            decode_queue=float(last.pools["decode"].queue),
            kv_utilization=last.pools["decode"].kv_utilization,
            prefill_served_token_rate=rate("prefill_token_rate"),
            decode_served_token_rate=rate("output_token_rate"),
        )  # fmt: skip

    def status(self, role: Role, bounds: Bounds) -> PoolStatus:
        last = self.windows[-1]
        return PoolStatus(self.sim.replicas(role), last.pools[role.value].active, bounds)


def scaling(phases: Sequence[Phase], start: tuple[int, int], most: int, seed: int = 0) -> Run:
    """The planner adding and removing pods (each ready after a cold start)."""
    run, state, slo = Run(phases, start, seed), PlannerState(), Slo(SLO.ttft_s, SLO.tpot_s)
    bounds = Bounds(1, most)
    t = TICK_S
    while t <= run.end_s:
        run.step(t)
        tick = Tick(t, slo, run.status(Role.PREFILL, bounds), run.status(Role.DECODE, bounds),
                    run.observe())  # fmt: skip
        p = plan(state, tick)
        state = p.state
        if p.prefill.changed or p.decode.changed:
            run.sim.set_replicas(prefill=p.prefill.replicas, decode=p.decode.replicas)
        t += TICK_S
    return run


def switching(phases: Sequence[Phase], start: tuple[int, int], seed: int = 0) -> Run:
    """The same GPUs as switchable workers: no new pods, one switch at a time."""
    run, state, slo = Run(phases, start, seed), PlannerState(), Slo(SLO.ttft_s, SLO.tpot_s)
    total = sum(start)
    bounds = Bounds(1, total)
    memory, balance = BalanceMemory(), BalanceConfig(colocate_last=False)  # no colocated pool here
    costs = Costs(drain_s=SWITCH_S, prefix_hit_ratio=0.0, cold_start_s=COLD_START_S,
                  can_scale=False)  # fmt: skip
    t = TICK_S
    while t <= run.end_s:
        run.step(t)
        pre, dec = run.status(Role.PREFILL, bounds), run.status(Role.DECODE, bounds)
        tick = Tick(t, slo, pre, dec, run.observe())
        p = plan(state, tick)
        state = p.state
        starting = (pre.replicas - pre.ready) + (dec.replicas - dec.ready)
        split = Split(prefill=pre.ready, decode=dec.ready, switching=starting)
        flex = rebalance(p, tick, split, costs, memory, PlannerConfig(), balance)
        memory = flex.balance.memory
        to, frm = flex.balance.switch_to, flex.balance.switch_from
        if (to is not None and frm is not None
                and run.sim.switch(Role(frm.value), Role(to.value), SWITCH_S)):  # fmt: skip
            run.switches.append((t, Role(to.value)))
        t += TICK_S
    return run


def finish(run: Run) -> tuple[float, float, float]:
    """Run every request to its end: (SLO attainment, goodput req/s, GPU-seconds)."""
    result = run.sim.run()
    att = result.attainment(SLO)
    return att, att * result.n_requests / run.end_s, run.sim.gpu_seconds()
