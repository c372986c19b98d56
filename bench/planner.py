"""The planner in closed loop on a trace with a x3 load step.

Every ``INTERVAL_S`` the planner sees what Prometheus would show over the last
``WINDOW_S`` (rates, p90 TTFT and TPOT, queues, KV use), decides, and the pools
are resized (new replicas take 30 s to become ready). The trace is Poisson
arrivals at a base rate for ten minutes, three times that rate for ten minutes,
and the base rate again for ten minutes. The planner runs with its default
config (``PlannerConfig()``, windows as in the bench), as the operator ships it.

``--pools sim`` (default): the simulator (``splitserve_operator.sim``, see
``planner_sim.py``): Llama 3.1 8B on H100s, disaggregated over RoCE 400G,
2048-token prompts, 256-token outputs, 40 -> 120 -> 40 req/s, SLO TTFT p90 1 s,
TPOT p90 12 ms. ``--pools model``: the small queueing model of
``planner_model.py`` (20 -> 60 -> 20 req/s).

Reported:
- slo_attainment: requests that met both the TTFT and TPOT SLOs over all
  requests that arrived (unfinished ones count as misses);
- replica_seconds_vs_static_peak: replica-seconds the planner paid for
  (asked-for replicas, starting and draining ones included) over the
  replica-seconds of the smallest static prefill + decode sizes that meet the
  SLO (99 % attainment) at the peak load, held for the whole trace;
- flaps: a pool changing direction (up then down, or down then up) within
  ``FLAP_WINDOW_S``.

Run: ``python bench/planner.py`` (under a minute on two cores); it ends with
``RESULT slo_attainment=<a> replica_seconds_vs_static_peak=<r> flaps=<n>``.
Targets: a >= 0.90, r <= 0.7, n = 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Protocol

from planner_model import ModelParams, Phase, QueueModel
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    PlannerState,
    PoolDecision,
    PoolStatus,
    Slo,
    Tick,
)

INTERVAL_S = 10.0
"""Planner tick (the InferenceService's ``autoscaling.interval``)."""
WINDOW_S = 30.0
"""Rate and percentile window of the PromQL queries."""
FAST_WINDOW_S = 10.0
"""Short window of the fast arrival rate (see ``Observation.prompt_token_rate_fast``)."""
BOUNDS = Bounds(min_replicas=1, max_replicas=16)
FLAP_WINDOW_S = 300.0
PEAK_PROBE_S = 300.0
"""Length of each constant-peak run when searching the static peak sizes."""
STATIC_TARGET = 0.99
"""Attainment the static sizes must reach at the peak load."""
STEP = 3.0
PHASE_S = 600.0
"""Each of the three phases (base, x3, base) lasts this long."""
CONFIG = PlannerConfig(observation_window_s=WINDOW_S)


class Pools(Protocol):
    """What the bench drives: the simulator, or the small queueing model."""

    @property
    def end_s(self) -> float: ...
    def advance(self, t: float) -> None: ...
    def replicas(self) -> tuple[int, int, int, int]: ...
    def set_replicas(self, prefill: int, decode: int) -> None: ...
    def observe(self) -> Observation: ...
    def finish(self) -> tuple[float, float]: ...


@dataclass(frozen=True)
class Setup:
    """A set of pools, its SLO and the load it sees."""

    name: str
    slo: Slo
    base_rate: float
    start: tuple[int, int]
    """(prefill, decode) replicas at time zero: sized for the base load."""

    def phases(self) -> tuple[tuple[float, float], ...]:
        """(until_s, rate) of each phase: base, x3 step, base."""
        return (
            (PHASE_S, self.base_rate),
            (2 * PHASE_S, self.base_rate * STEP),
            (3 * PHASE_S, self.base_rate),
        )

    def pools(self, seed: int) -> Pools:
        if self.name == "sim":
            from planner_sim import RatePhase, SimPools
            from splitserve_operator.sim.config import Slo as SimSlo

            return SimPools(
                [RatePhase(u, r) for u, r in self.phases()],
                SimSlo(self.slo.ttft_s, self.slo.tpot_s),
                start=self.start,
                window_s=WINDOW_S,
                fast_window_s=FAST_WINDOW_S,
                seed=seed,
            )
        return ModelPools(
            QueueModel(
                tuple(Phase(u, r) for u, r in self.phases()),
                prefill_replicas=self.start[0],
                decode_replicas=self.start[1],
                seed=seed,
            ),
            self.slo,
        )

    def static_attainment(self, prefill: int, decode: int, rate: float, seed: int) -> float:
        if self.name == "sim":
            from planner_sim import static_attainment
            from splitserve_operator.sim.config import Slo as SimSlo

            slo = SimSlo(self.slo.ttft_s, self.slo.tpot_s)
            return static_attainment(prefill, decode, rate, slo, PEAK_PROBE_S, seed)
        model = QueueModel(
            (Phase(until_s=PEAK_PROBE_S, rate=rate),),
            prefill_replicas=prefill,
            decode_replicas=decode,
            params=ModelParams(),
            seed=seed,
        )
        model.run_until(PEAK_PROBE_S + 60.0)
        return model.attainment(self.slo.ttft_s, self.slo.tpot_s)


SETUPS = {
    # Llama 3.1 8B on H100s (roofline), 2048-token prompts, 256-token outputs.
    "sim": Setup("sim", Slo(ttft_s=1.0, tpot_s=0.012, percentile=0.9), 40.0, (3, 3)),
    # planner_model.py: 512-token prompts, 128-token outputs.
    "model": Setup("model", Slo(ttft_s=1.0, tpot_s=0.05, percentile=0.9), 20.0, (2, 2)),
}


class ModelPools:
    """planner_model.QueueModel behind the :class:`Pools` interface."""

    def __init__(self, model: QueueModel, slo: Slo) -> None:
        self.model = model
        self.slo = slo

    @property
    def end_s(self) -> float:
        return self.model.end_s

    def advance(self, t: float) -> None:
        self.model.run_until(t)

    def replicas(self) -> tuple[int, int, int, int]:
        return self.model.replicas()

    def set_replicas(self, prefill: int, decode: int) -> None:
        self.model.set_replicas(prefill, decode)

    def observe(self) -> Observation:
        return self.model.observe(WINDOW_S, self.slo.percentile, FAST_WINDOW_S)

    def finish(self) -> tuple[float, float]:
        self.model.run_until(self.model.end_s + 60.0)  # no new arrivals: let them finish
        return self.model.attainment(self.slo.ttft_s, self.slo.tpot_s), self.model.replica_seconds


@dataclass(frozen=True)
class Outcome:
    attainment: float
    replica_seconds: float
    decisions: list[tuple[float, PoolDecision]]


def run_closed_loop(
    setup: Setup, config: PlannerConfig = CONFIG, seed: int = 0, verbose: bool = False
) -> Outcome:
    pools = setup.pools(seed)
    state = PlannerState.initial(config.prefill_capacity_hint, config.decode_capacity_hint)
    decisions: list[tuple[float, PoolDecision]] = []
    t = 0.0
    while t < pools.end_s:
        t = min(t + INTERVAL_S, pools.end_s)
        pools.advance(t)
        p_asked, p_ready, d_asked, d_ready = pools.replicas()
        tick = Tick(
            now=t,
            slo=setup.slo,
            prefill=PoolStatus(p_asked, p_ready, BOUNDS),
            decode=PoolStatus(d_asked, d_ready, BOUNDS),
            observation=pools.observe(),
        )
        result = plan(state, tick, config)
        state = result.state
        for d in result.decisions():
            if d.changed:
                decisions.append((t, d))
                if verbose:
                    print(
                        f"t={t:6.0f}s {d.pool:7s} {d.previous:2d} -> {d.replicas:2d} "
                        f"{d.reason}: {d.detail}"
                    )
        pools.set_replicas(result.prefill.replicas, result.decode.replicas)
    attainment, replica_seconds = pools.finish()
    return Outcome(attainment, replica_seconds, decisions)


def count_flaps(
    decisions: list[tuple[float, PoolDecision]], window_s: float = FLAP_WINDOW_S
) -> int:
    flaps = 0
    last: dict[str, tuple[float, Direction]] = {}
    for t, d in decisions:
        prev = last.get(d.pool)
        if prev is not None and prev[1] is not d.direction and t - prev[0] < window_s:
            flaps += 1
        last[d.pool] = (t, d.direction)
    return flaps


def static_peak(setup: Setup, seed: int = 0) -> tuple[int, int]:
    """Smallest static (prefill, decode) meeting ``STATIC_TARGET`` at the peak rate.

    Searched one pool at a time with the other pool generously sized, then
    checked together (growing decode if the pair falls short).
    """
    rate = max(r for _, r in setup.phases())
    generous = BOUNDS.max_replicas

    def ok(p: int, d: int) -> bool:
        return setup.static_attainment(p, d, rate, seed) >= STATIC_TARGET

    prefill = next(p for p in range(1, generous + 1) if ok(p, generous))
    decode = next(d for d in range(1, generous + 1) if ok(generous, d))
    while not ok(prefill, decode):
        decode += 1
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pools",
        choices=sorted(SETUPS),
        default="sim",
        help="the simulator (default) or the small queueing model",
    )
    parser.add_argument("--verbose", action="store_true", help="print every scaling decision")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setup = SETUPS[args.pools]

    p_static, d_static = static_peak(setup, args.seed)
    out = run_closed_loop(setup, seed=args.seed, verbose=args.verbose)
    duration = setup.phases()[-1][0]
    static_rs = (p_static + d_static) * duration
    flaps = count_flaps(out.decisions)
    ratio = out.replica_seconds / static_rs
    trace = " -> ".join(f"{r:g} req/s until {u:g}s" for u, r in setup.phases())
    print(f"pools: {setup.name}; trace: {trace}")
    print(
        f"SLO: TTFT p{setup.slo.percentile * 100:g} <= {setup.slo.ttft_s}s, "
        f"TPOT <= {setup.slo.tpot_s}s"
    )
    print(
        f"static peak sizes: prefill {p_static}, decode {d_static} "
        f"({static_rs:.0f} replica-s); planner: {out.replica_seconds:.0f} replica-s"
    )
    print(f"scaling decisions: {len(out.decisions)}")
    print(
        f"RESULT slo_attainment={out.attainment:.3f} "
        f"replica_seconds_vs_static_peak={ratio:.3f} flaps={flaps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
