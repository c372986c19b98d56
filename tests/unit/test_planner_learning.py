"""Capacity and demand learning, and the signal arithmetic, each with the numbers worked out."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.learning import learn_capacity, learn_output_ratio
from splitserve_operator.planner.model import Observation, PoolMemory, Slo
from splitserve_operator.planner.signals import (
    Missing,
    PoolSignals,
    decode_signals,
    prefill_signals,
)

pytestmark = pytest.mark.unit

CFG = PlannerConfig()  # alpha 0.3, window 60 s, budget 0.5, quiet 0.05, drain 30 s
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def _signals(served: float, saturated: bool) -> PoolSignals:
    obs = Observation(prompt_token_rate=served, prefill_served_token_rate=served, request_rate=20)
    s = prefill_signals(obs, SLO, CFG)
    assert isinstance(s, PoolSignals)
    return replace(s, saturated=saturated)


@pytest.mark.parametrize(
    ("memory", "served", "ready", "saturated", "now", "want_capacity", "want_trusted"),
    [
        # saturated for 60 s >= window: 16000 / 2 = 8000 per replica, taken outright, trusted
        (PoolMemory(saturated_since=0.0), 16000, 2, True, 60.0, 8000.0, True),
        # trusted 8000, saturated again at 12000 / 2 = 6000: 8000 + 0.3 x (6000 - 8000) = 7400
        (PoolMemory(8000.0, True, saturated_since=0.0), 12000, 2, True, 100.0, 7400.0, True),
        # saturated for 30 s only (< 60): the window still mixes in what came before
        (PoolMemory(saturated_since=70.0), 16000, 2, True, 100.0, None, False),
        # saturated since before the pool last changed size (settled at 80): 100 - 80 < 60
        (PoolMemory(saturated_since=0.0, settled_at=80.0), 16000, 2, True, 100.0, None, False),
        # not saturated: 9000 / 3 = 3000 > 2500 is a better lower bound; trust unchanged
        (PoolMemory(2500.0, False), 9000, 3, False, 100.0, 3000.0, False),
        # not saturated: 6000 / 3 = 2000 < 2500 changes nothing
        (PoolMemory(2500.0, True), 6000, 3, False, 100.0, 2500.0, True),
        # replicas removed 30 s ago (< 60): the served rate still counts the removed ones
        (PoolMemory(2500.0, False, last_down_at=70.0), 9000, 2, False, 100.0, 2500.0, False),
        # nothing ready: nothing to learn
        (PoolMemory(), 9000, 0, False, 100.0, None, False),
    ],
)
def test_learn_capacity(
    memory: PoolMemory,
    served: float,
    ready: int,
    saturated: bool,
    now: float,
    want_capacity: float | None,
    want_trusted: bool,
) -> None:
    learned = learn_capacity(memory, _signals(served, saturated), ready, now, CFG)
    if want_capacity is None:
        assert learned.capacity is None
    else:
        assert learned.capacity == pytest.approx(want_capacity)
    assert learned.capacity_trusted is want_trusted


def test_saturation_start_is_remembered_and_cleared() -> None:
    m = learn_capacity(PoolMemory(), _signals(100, True), 1, 5.0, CFG)
    assert m.saturated_since == 5.0
    m = learn_capacity(m, _signals(100, True), 1, 15.0, CFG)
    assert m.saturated_since == 5.0  # the first moment, not the latest
    m = learn_capacity(m, _signals(100, False), 1, 25.0, CFG)
    assert m.saturated_since is None


@pytest.mark.parametrize(
    ("prev", "prompt", "gen", "want"),
    [
        (None, 10000, 2500, 0.25),  # first sample: 2500 / 10000
        (0.25, 10000, 2000, 0.235),  # 0.25 + 0.3 x (0.2 - 0.25)
        (0.25, 0, 2000, 0.25),  # no arrivals: keep
    ],
)
def test_output_per_prompt_token(
    prev: float | None, prompt: float, gen: float, want: float
) -> None:
    obs = Observation(prompt_token_rate=prompt, generation_token_rate=gen, tpot_s=0.01)
    dec = decode_signals(obs, SLO, CFG, prev)
    assert learn_output_ratio(prev, obs, dec, CFG) == pytest.approx(want)


def test_output_ratio_not_learned_while_decode_is_saturated() -> None:
    obs = Observation(prompt_token_rate=10000, generation_token_rate=1000, tpot_s=0.2)  # 4x
    dec = decode_signals(obs, SLO, CFG, 0.25)
    assert learn_output_ratio(0.25, obs, dec, CFG) == 0.25


def test_prefill_signal_arithmetic() -> None:
    obs = Observation(
        ttft_s=0.3,
        request_rate=20.0,
        prompt_token_rate=10240.0,
        prompt_token_rate_fast=15000.0,
        prefill_queue=30.0,
        prefill_served_token_rate=12000.0,
    )
    s = prefill_signals(obs, SLO, CFG)
    assert isinstance(s, PoolSignals)
    assert s.slo_ratio == pytest.approx(0.3)  # 0.3 s / 1 s
    assert s.demand == 15000.0  # max(10240, 15000): the fast window shows the step first
    assert s.queue_wait_s == pytest.approx(1.5)  # Little: 30 / 20 req/s
    assert s.queue_budget_s == pytest.approx(0.5)  # 0.5 x 1 s
    assert s.queue_pressure  # 1.5 > 0.5
    assert s.backlog_rate == pytest.approx(512.0)  # 30 x (10240 / 20) / 30 s
    assert not s.draining  # 12000 < 15000 x 1.1
    assert s.saturated and not s.quiet and not s.shrink_ok


def test_a_queue_of_one_at_high_rate_is_quiet() -> None:
    # 1 / 40 req/s = 25 ms <= 0.1 x 1 s = 100 ms
    obs = Observation(ttft_s=0.2, request_rate=40.0, prompt_token_rate=20000.0, prefill_queue=1.0)
    s = prefill_signals(obs, SLO, CFG)
    assert isinstance(s, PoolSignals)
    assert s.quiet and s.shrink_ok and not s.saturated


def test_a_queue_nothing_leaves_waits_forever() -> None:
    obs = Observation(request_rate=0.0, prompt_token_rate=100.0, prefill_queue=3.0)
    s = prefill_signals(obs, SLO, CFG)
    assert isinstance(s, PoolSignals)
    assert math.isinf(s.queue_wait_s) and s.queue_pressure


def test_decode_demand_from_arrivals_once_the_ratio_is_known() -> None:
    obs = Observation(prompt_token_rate=12000.0, generation_token_rate=2000.0, tpot_s=0.04)
    with_ratio = decode_signals(obs, SLO, CFG, 0.25)
    without = decode_signals(obs, SLO, CFG, None)
    assert isinstance(with_ratio, PoolSignals) and isinstance(without, PoolSignals)
    assert with_ratio.demand == pytest.approx(3000.0)  # 12000 x 0.25
    assert without.demand == 2000.0  # only what decode produced


def test_kv_and_nan_readings() -> None:
    obs = Observation(generation_token_rate=100.0, tpot_s=float("nan"), kv_utilization=0.92)
    s = decode_signals(obs, SLO, CFG, None)
    assert isinstance(s, PoolSignals)
    assert s.slo_ratio is None  # NaN (no request finished) is no reading, not a breach
    assert s.kv_pressure and s.saturated and not s.shrink_ok


def test_missing_series() -> None:
    assert isinstance(prefill_signals(Observation(), SLO, CFG), Missing)
    assert isinstance(decode_signals(Observation(), SLO, CFG, None), Missing)
