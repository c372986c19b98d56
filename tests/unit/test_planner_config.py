"""The planner's config refuses values that would make it flap or divide by zero."""

from __future__ import annotations

import pytest
from splitserve_operator.planner.config import PlannerConfig, PlannerConfigError
from splitserve_operator.planner.model import Bounds

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_utilization": 0.0},
        {"target_utilization": 1.5},
        {"target_utilization": 0.96},  # not below proactive_utilization 0.95
        {"scale_down_ratio": 1.0},  # no hysteresis band below breach_ratio 1.0
        {"kv_low": 0.8},  # kv_low must be < kv_target 0.75
        {"kv_high": 0.7},
        {"max_up_factor": 1.0},
        {"panic_ratio": 0.9},
        {"queue_drain_s": 0.0},
        {"down_stabilization_s": -1.0},
        {"cooldown_after_up_s": -1.0},
        {"quiet_queue_fraction": 0.6},  # not below queue_wait_budget 0.5
        {"decode_capacity_hint": 0.0},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(PlannerConfigError):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]


def test_defaults_are_valid() -> None:
    PlannerConfig()


def test_bounds() -> None:
    with pytest.raises(ValueError):
        Bounds(3, 2)
    assert Bounds(1, 4).clamp(0) == 1
    assert Bounds(1, 4).clamp(9) == 4
