"""Properties over random tick sequences: bounds hold, no scale-down inside a
cooldown, never a move on missing data; and the planner in closed loop with the
bench's queueing model meets the planner's targets on a x3 load step."""

from __future__ import annotations

from types import ModuleType

import pytest
from bench_modules import load_bench
from fuzz_profiles import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    PlannerState,
    PoolStatus,
    Slo,
    Tick,
)

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
CFG = PlannerConfig()
BOUNDS = Bounds(1, 12)
INTERVAL = 10.0

maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731
observations = st.one_of(
    st.none(),
    st.builds(
        Observation,
        ttft_s=maybe(st.floats(0.01, 20.0)),
        tpot_s=maybe(st.floats(0.005, 0.5)),
        request_rate=maybe(st.floats(0.0, 100.0)),
        prompt_token_rate=maybe(st.floats(0.0, 50000.0)),
        prompt_token_rate_fast=maybe(st.floats(0.0, 50000.0)),
        generation_token_rate=maybe(st.floats(0.0, 10000.0)),
        prefill_queue=maybe(st.floats(0.0, 500.0)),
        decode_queue=maybe(st.floats(0.0, 100.0)),
        kv_utilization=maybe(st.floats(0.0, 1.0)),
        prefill_served_token_rate=maybe(st.floats(0.0, 50000.0)),
        decode_served_token_rate=maybe(st.floats(0.0, 10000.0)),
    ),
)


@pytest.mark.unit
@settings(max_examples=scaled(150), deadline=None)
# found by the search: a prompt rate of 2e-311 tok/s taught an infinite output ratio, and
# the next tick's decode demand (0 x inf) was NaN
@example(
    [
        (Observation(generation_token_rate=2.0), 0),
        (Observation(prompt_token_rate=2.225073858507e-311, generation_token_rate=1.0), 0),
        (Observation(prompt_token_rate=0.0, generation_token_rate=0.0), 0),
    ]
)
@given(st.lists(st.tuples(observations, st.integers(0, 2)), min_size=1, max_size=60))
def test_random_ticks_respect_bounds_and_cooldowns(
    ticks: list[tuple[Observation | None, int]],
) -> None:
    state = PlannerState.initial()
    replicas = {"prefill": 2, "decode": 2}
    last: dict[str, tuple[float, Direction]] = {}
    for i, (obs, lag) in enumerate(ticks):
        now = i * INTERVAL
        # ready lags the asked size by 0..2 replicas
        statuses = {p: PoolStatus(n, max(0, n - lag), BOUNDS) for p, n in replicas.items()}
        result = plan(state, Tick(now, SLO, statuses["prefill"], statuses["decode"], obs), CFG)
        state = result.state
        for d in result.decisions():
            assert BOUNDS.min_replicas <= d.replicas <= BOUNDS.max_replicas
            if obs is None:
                assert not d.changed, "moved on missing metrics"
            if d.changed:
                prev = last.get(d.pool.value)
                if d.direction is Direction.DOWN and prev is not None:
                    gap = now - prev[0]
                    if prev[1] is Direction.UP:
                        assert gap >= CFG.cooldown_after_up_s, f"down {gap}s after an up"
                    else:
                        assert gap >= CFG.cooldown_after_down_s, f"down {gap}s after a down"
                last[d.pool.value] = (now, d.direction)
            replicas[d.pool.value] = d.replicas


def _bench() -> ModuleType:
    return load_bench("planner", "planner_model", "planner_sim")


@pytest.mark.unit
@pytest.mark.slow
@pytest.mark.parametrize("pools", ["sim", "model"])
def test_closed_loop_x3_step_meets_the_targets(pools: str) -> None:
    bench = _bench()
    setup = bench.SETUPS[pools]
    p_static, d_static = bench.static_peak(setup)
    out = bench.run_closed_loop(setup)
    static = (p_static + d_static) * setup.phases()[-1][0]
    assert out.attainment >= 0.90
    assert out.replica_seconds / static <= 0.70
    assert bench.count_flaps(out.decisions) == 0
