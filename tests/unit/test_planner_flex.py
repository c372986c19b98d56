"""The planner's tick for switchable workers: the same signals as scaling, a switch
instead of a scale-up when the policy picks one."""

from __future__ import annotations

import pytest
from splitserve.role_balance import BalanceConfig, BalanceMemory, Costs, Reason, Split
from splitserve.roles import Role
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.flex import rebalance
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    PlannerState,
    PoolStatus,
    Slo,
    Tick,
)

pytestmark = pytest.mark.unit

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
CALM: dict[str, float] = dict(ttft_s=0.2, tpot_s=0.02, request_rate=20.0,
                              prompt_token_rate=10240.0, generation_token_rate=2560.0,
                              prefill_queue=0.0, decode_queue=0.0, kv_utilization=0.3)  # fmt: skip
CFG = PlannerConfig()
BAL = BalanceConfig(min_dwell_s=60, sustain_s=0, comfort_band=0.8)
SPLIT = Split(prefill=1, decode=1, fixed_prefill=1, fixed_decode=1)
CHEAP = Costs(drain_s=5, prefix_hit_ratio=0.0, cold_start_s=300, can_scale=True)
TWO = PoolStatus(2, 2, Bounds(1, 10))


def tick(now: float, **change: float) -> Tick:
    return Tick(now, SLO, TWO, TWO, Observation(**{**CALM, **change}))  # type: ignore[arg-type]


def test_a_ttft_breach_switches_a_decode_worker_instead_of_adding_a_prefill_pod() -> None:
    t = tick(1000.0, ttft_s=2.0)  # 2x the TTFT SLO, decode at 0.4x its TPOT
    scaled = plan(PlannerState(), t, CFG)
    assert scaled.prefill.direction is Direction.UP  # what the planner alone would do
    got = rebalance(scaled, t, SPLIT, CHEAP, BalanceMemory(), CFG, BAL)
    assert (got.balance.switch_to, got.balance.reason) == (Role.PREFILL, Reason.SWITCH)
    assert got.plan.prefill.direction is Direction.HOLD
    assert got.plan.prefill.replicas == 2
    assert "switches instead" in got.plan.prefill.detail
    assert got.plan.decode == scaled.decode


def test_kv_pressure_switches_a_prefill_worker_to_decode() -> None:
    t = tick(1000.0, kv_utilization=0.97)
    got = rebalance(plan(PlannerState(), t, CFG), t, SPLIT, CHEAP, BalanceMemory(), CFG, BAL)
    assert got.balance.switch_to is Role.DECODE
    assert got.plan.decode.direction is not Direction.UP


def test_when_a_new_pod_is_cheaper_the_planner_scales() -> None:
    t = tick(1000.0, ttft_s=2.0)
    scaled = plan(PlannerState(), t, CFG)
    fast_pod = Costs(drain_s=5, prefix_hit_ratio=0.5, cold_start_s=10, can_scale=True)
    got = rebalance(scaled, t, SPLIT, fast_pod, BalanceMemory(), CFG, BAL)
    assert (got.balance.switch_to, got.balance.reason) == (None, Reason.SCALING_CHEAPER)
    assert got.plan == scaled


def test_missing_metrics_hold_everything() -> None:
    t = Tick(1000.0, SLO, TWO, TWO, None)
    scaled = plan(PlannerState(), t, CFG)
    got = rebalance(scaled, t, SPLIT, CHEAP, BalanceMemory(), CFG, BAL)
    assert (got.balance.switch_to, got.balance.reason) == (None, Reason.MISSING)


SLOW = BalanceConfig(min_dwell_s=60, sustain_s=10, comfort_band=0.8)


def test_a_switch_waiting_on_its_sustain_holds_the_scale_up_it_would_replace() -> None:
    """The first tick of a TTFT breach: the policy wants 10 s of it; a new pod (300 s)
    would come long after the switch, so prefill does not grow meanwhile."""
    t = tick(1000.0, ttft_s=2.0)
    scaled = plan(PlannerState(), t, CFG)
    assert scaled.prefill.direction is Direction.UP
    got = rebalance(scaled, t, SPLIT, CHEAP, BalanceMemory(), CFG, SLOW)
    assert (got.balance.switch_to, got.balance.reason) == (None, Reason.SUSTAIN)
    assert got.plan.prefill.direction is Direction.HOLD
    assert "a switch to prefill is due in 10 s" in got.plan.prefill.detail
    # 10 s on, the switch itself
    t2 = tick(1010.0, ttft_s=2.0)
    after = rebalance(plan(PlannerState(), t2, CFG), t2, SPLIT, CHEAP, got.balance.memory,
                      CFG, SLOW)  # fmt: skip
    assert (after.balance.switch_to, after.plan.prefill.direction) == (Role.PREFILL, Direction.HOLD)


def test_a_switch_held_by_the_dwell_holds_the_scale_up_too() -> None:
    t = tick(1000.0, kv_utilization=0.97)
    last = BalanceMemory(last_switch_at=970.0)  # 30 s of a 60 s dwell
    got = rebalance(plan(PlannerState(), t, CFG), t, SPLIT, CHEAP, last, CFG, BAL)
    assert got.balance.reason is Reason.DWELL
    assert got.plan.decode.direction is Direction.HOLD
    assert "due in 30 s" in got.plan.decode.detail


def test_the_planner_scales_when_no_switch_is_coming() -> None:
    """Waiting does not hold a scale-up when the wait and the switch cost more than a
    new pod, nor when the donor has no worker to give."""
    t = tick(1000.0, ttft_s=2.0)
    scaled = plan(PlannerState(), t, CFG)
    quick_pod = Costs(drain_s=5, prefix_hit_ratio=0.0, cold_start_s=12, can_scale=True)
    got = rebalance(scaled, t, SPLIT, quick_pod, BalanceMemory(), CFG, SLOW)  # 10 + 5 >= 12
    assert (got.balance.reason, got.plan) == (Reason.SUSTAIN, scaled)
    fixed_only = Split(prefill=0, decode=0, fixed_prefill=1, fixed_decode=1)
    got = rebalance(scaled, t, fixed_only, CHEAP, BalanceMemory(), CFG, SLOW)
    assert (got.balance.reason, got.plan) == (Reason.SUSTAIN, scaled)
