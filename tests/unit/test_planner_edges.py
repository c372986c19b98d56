"""The planner's smaller parts at their edges: the config's limits, the frozen values a
tick passes around, the shrink wish's reset, settling, learning on a clock below zero,
and what a tick records. Each test names the arithmetic it checks."""

from __future__ import annotations

import dataclasses

import pytest
from splitserve_operator.planner import model as planner_model
from splitserve_operator.planner.config import PlannerConfig, PlannerConfigError
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.decisions import break_shrink
from splitserve_operator.planner.learning import (
    learn_capacity,
    learn_output_ratio,
    track_settling,
)
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    PlannerState,
    Pool,
    PoolDecision,
    PoolMemory,
    PoolStatus,
    Reason,
    Slo,
    Tick,
)
from splitserve_operator.planner.signals import PoolSignals, decode_signals, prefill_signals
from splitserve_operator.planner.sizing import sizing

pytestmark = pytest.mark.unit

NOW = 1000.0
SLO = Slo(ttft_s=1.0, tpot_s=0.05)
WIDE = Bounds(1, 10)
CALM: dict[str, float] = dict(
    ttft_s=0.2,
    tpot_s=0.04,
    request_rate=20.0,
    prompt_token_rate=10240.0,
    generation_token_rate=2560.0,
    prefill_queue=0.0,
    decode_queue=0.0,
    kv_utilization=0.5,
)


def obs(**change: float | None) -> Observation:
    """The calm service of ``test_planner_core`` with ``change`` applied."""
    return Observation(**{**CALM, **change})  # type: ignore[arg-type]


TWO = PoolStatus(2, 2, WIDE)


@pytest.mark.parametrize(
    "fields",
    [
        {"capacity_alpha": 1.0},  # fractions may be 1
        {"kv_high": 1.0},
        {"queue_wait_budget": 1.0},
        {"scale_down_ratio": 0.01},
        {"cooldown_after_up_s": 0.0, "cooldown_after_down_s": 0.0},
    ],
)
def test_config_accepts_its_edges(fields: dict[str, float]) -> None:
    PlannerConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"capacity_alpha": 0.0}, "capacity_alpha"),
        ({"target_utilization": 1.1}, "target_utilization"),
        ({"scale_down_ratio": 0.0}, "scale_down_ratio"),
        ({"scale_down_ratio": 1.0}, "scale_down_ratio"),
        ({"quiet_queue_fraction": 0.5, "queue_wait_budget": 0.5}, "quiet_queue_fraction"),
        ({"panic_ratio": 1.0}, "panic_ratio"),
        ({"max_up_factor": 1.0}, "max_up_factor"),
        ({"kv_low": 0.75}, "kv_low"),
        ({"down_stabilization_s": 0.0}, "down_stabilization_s"),
        ({"cooldown_after_down_s": -1.0}, "cooldown_after_down_s"),
        ({"decode_capacity_hint": 0.0}, "decode_capacity_hint"),
    ],
)
def test_config_refuses_past_its_edges_naming_the_field(
    fields: dict[str, float], names: str
) -> None:
    with pytest.raises(PlannerConfigError, match=names):
        PlannerConfig(**fields)  # type: ignore[arg-type]


def test_what_a_tick_passes_around_is_frozen() -> None:
    """plan() is pure: nothing it takes or gives can be changed behind its back."""
    classes = [PlannerConfig] + [
        c
        for c in vars(planner_model).values()
        if isinstance(c, type)
        and dataclasses.is_dataclass(c)
        and c.__module__ == planner_model.__name__
    ]
    assert len(classes) >= 9
    for cls in classes:
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlannerConfig().target_utilization = 0.5  # type: ignore[misc]


def test_slo_defaults_to_the_90th_percentile() -> None:
    assert Slo(ttft_s=1.0, tpot_s=0.05).percentile == 0.9


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 3), (2, 2)])
def test_bounds_from_zero_up(lo: int, hi: int) -> None:
    assert Bounds(lo, hi).clamp(hi + 5) == hi


@pytest.mark.parametrize(("lo", "hi"), [(-1, 3), (3, 2)])
def test_bounds_refuse_a_negative_minimum_or_a_minimum_above_the_maximum(lo: int, hi: int) -> None:
    with pytest.raises(ValueError, match="bad bounds"):
        Bounds(lo, hi)


def test_a_decision_down_is_a_change() -> None:
    d = PoolDecision(Pool.DECODE, previous=3, replicas=2, direction=Direction.DOWN,
                     reason=Reason.SURPLUS, detail="x")  # fmt: skip
    assert d.changed
    assert not dataclasses.replace(d, replicas=3).changed


@pytest.mark.parametrize(
    "memory",
    [
        PoolMemory(shrink_since=5.0),
        PoolMemory(shrink_proposals=((5.0, 2),)),
        PoolMemory(shrink_since=5.0, shrink_proposals=((5.0, 2),)),
    ],
)
def test_breaking_a_shrink_wish_forgets_all_of_it(memory: PoolMemory) -> None:
    broken = break_shrink(memory)
    assert (broken.shrink_since, broken.shrink_proposals) == (None, ())


def test_a_pool_that_became_ready_is_settled_from_then() -> None:
    ready = PoolStatus(4, 4, WIDE)
    memory = track_settling(PoolMemory(pending=True), ready, NOW)
    assert (memory.pending, memory.settled_at) == (False, NOW)
    assert track_settling(PoolMemory(), PoolStatus(4, 2, WIDE), NOW).pending


def test_capacity_is_learned_on_a_clock_below_zero() -> None:
    """Only differences of time count: saturated since -200, at -100 a whole 60 s window
    has passed, so 2000 tok/s over 2 replicas is learned: 1000 per replica, trusted."""
    signals = decode_signals(obs(generation_token_rate=2000.0, tpot_s=0.1), SLO,
                             PlannerConfig(), None)  # fmt: skip
    assert isinstance(signals, PoolSignals) and signals.saturated
    memory = PoolMemory(saturated_since=-200.0)
    learned = learn_capacity(memory, signals, 2, -100.0, PlannerConfig())
    assert (learned.capacity, learned.capacity_trusted) == (1000.0, True)


def test_no_generated_tokens_teach_no_output_ratio() -> None:
    idle = obs(generation_token_rate=0.0)
    signals = decode_signals(idle, SLO, PlannerConfig(), None)
    assert learn_output_ratio(0.25, idle, signals, PlannerConfig()) == 0.25


def test_a_trickle_of_prompt_tokens_teaches_no_output_ratio() -> None:
    """Under MIN_LEARN_RATE (1 tok/s) of prompts, gen / prompt says nothing (here it
    would be 1 / 2e-311 = inf)."""
    trickle = obs(prompt_token_rate=2.225073858507e-311, generation_token_rate=1.0)
    signals = decode_signals(trickle, SLO, PlannerConfig(), None)
    assert learn_output_ratio(0.25, trickle, signals, PlannerConfig()) == 0.25
    assert learn_output_ratio(None, trickle, signals, PlannerConfig()) is None
    assert learn_output_ratio(None, obs(), signals, PlannerConfig()) == 0.25  # 2560 / 10240


def test_one_pools_missing_series_means_the_tick_lacked_metrics() -> None:
    for missing in ("prompt_token_rate", "generation_token_rate"):
        result = plan(PlannerState(), Tick(NOW, SLO, TWO, TWO, obs(**{missing: None})))
        assert not result.metrics_ok, missing
    assert plan(PlannerState(), Tick(NOW, SLO, TWO, TWO, obs())).metrics_ok


def test_a_queue_that_is_not_quiet_is_remembered_as_a_backlog() -> None:
    """6 queued at 20 req/s wait 0.3 s: above the quiet 0.1 s, below the 0.5 s budget (no
    step); the tick notes the backlog so that TTFT is not trusted for a window."""
    queued = plan(PlannerState(), Tick(NOW, SLO, TWO, TWO, obs(prefill_queue=6.0)))
    assert queued.prefill.replicas == 2
    assert queued.state.prefill.backlog_at == NOW
    quiet = plan(PlannerState(), Tick(NOW, SLO, TWO, TWO, obs()))
    assert quiet.state.prefill.backlog_at is None


def test_a_breach_names_the_latency_of_its_pool() -> None:
    # TPOT 1.5x on decode, TTFT 1.5x on prefill (no backlog ever): both step to 3
    result = plan(PlannerState(), Tick(NOW, SLO, TWO, TWO, obs(tpot_s=0.075, ttft_s=1.5)))
    for d, name in ((result.decode, "TPOT"), (result.prefill, "TTFT")):
        assert (d.replicas, d.reason) == (3, Reason.SLO_BREACH), d.detail
        assert d.detail.startswith(f"{name} "), d.detail


def test_replicas_still_starting_say_so() -> None:
    result = plan(PlannerState(), Tick(NOW, SLO, TWO, PoolStatus(4, 2, WIDE), obs(tpot_s=0.1)))
    assert result.decode.reason is Reason.PENDING
    assert "starting" in result.decode.detail, result.decode.detail


def test_sizing_shows_its_arithmetic() -> None:
    """A trusted capacity sizes at 0.8 with the backlog (6 queued, mean prompt 512, over
    30 s: 102.4 tok/s); a lower bound at 1 and without it."""
    queued = obs(prefill_queue=6.0)
    signals = prefill_signals(queued, SLO, PlannerConfig())
    assert isinstance(signals, PoolSignals)
    trusted = sizing(signals, PoolMemory(8000.0, True), PlannerConfig(), backlog=True)
    assert trusted == (2, "ceil((1.024e+04 + 102.4) / (capacity 8000 x 0.8)) = 2")
    bound = sizing(signals, PoolMemory(5120.0, False), PlannerConfig(), backlog=True)
    assert bound == (2, "ceil((1.024e+04 + 0) / (capacity lower bound 5120 x 1)) = 2")
    no_backlog = sizing(signals, PoolMemory(8000.0, True), PlannerConfig(), backlog=False)
    assert no_backlog == (2, "ceil((1.024e+04 + 0) / (capacity 8000 x 0.8)) = 2")
