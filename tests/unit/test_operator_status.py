"""Status from observations: conditions the Kubernetes way."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from splitserve_operator.api.status import (
    PoolObservation,
    Problem,
    Reason,
    compute_status,
    invalid_status,
)
from splitserve_operator.api.values import Pool

pytestmark = pytest.mark.unit

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def deployment(
    replicas: int, ready: int, generation: int = 1, observed: int = 1, **status: object
) -> dict[str, object]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            **status,
        },
    }


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def pools(**ready: int) -> dict[Pool, PoolObservation | None]:
    return {
        pool: PoolObservation.from_deployment(deployment(2, ready.get(pool.value, 2)))
        for pool in Pool
    }


def test_ready_when_every_pool_is_ready() -> None:
    status = compute_status(
        generation=3,
        pools=pools(),
        desired={p: 2 for p in Pool},
        problems=[],
        previous=None,
        now=T0,
    )
    c = conditions(status)
    assert status["observedGeneration"] == 3
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "AllPoolsReady")
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "RolloutComplete")
    assert c["Degraded"]["status"] == "False"
    assert c["Ready"]["observedGeneration"] == 3
    assert status["pools"]["decode"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "desiredReplicas": 2,
    }


def test_not_ready_while_a_pool_is_short() -> None:
    status = compute_status(
        generation=1, pools=pools(decode=1), desired={}, problems=[], previous=None, now=T0
    )
    c = conditions(status)
    assert c["Ready"]["status"] == "False" and "decode: 1/2 ready" in c["Ready"]["message"]
    assert c["Progressing"]["status"] == "True"
    assert "desiredReplicas" not in status["pools"]["decode"]  # no target given: none written


def test_a_missing_deployment_is_not_ready() -> None:
    observed = pools()
    observed[Pool.ROUTER] = None
    c = conditions(
        compute_status(generation=1, pools=observed, desired={}, problems=[], previous=None, now=T0)
    )
    assert c["Ready"]["status"] == "False" and "router: no Deployment" in c["Ready"]["message"]


def test_problems_and_stalled_rollouts_are_degraded() -> None:
    c = conditions(
        compute_status(
            generation=1,
            pools=pools(),
            desired={},
            problems=[Problem(Reason.APPLY_FAILED, "the API server rejected Deployment/x")],
            previous=None,
            now=T0,
        )
    )
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ApplyFailed")
    stalled = {
        p: PoolObservation.from_deployment(
            deployment(
                2,
                1,
                conditions=[
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": "ReplicaSet has timed out",
                    }
                ],
            )
        )
        for p in Pool
    }
    c = conditions(
        compute_status(generation=1, pools=stalled, desired={}, problems=[], previous=None, now=T0)
    )
    assert c["Degraded"]["reason"] == "RolloutStalled" and "timed out" in c["Degraded"]["message"]


def test_an_old_generation_is_still_rolling_out() -> None:
    obs = PoolObservation.from_deployment(deployment(2, 2, generation=4, observed=3))
    assert obs is not None and not obs.rolled_out
    surplus = PoolObservation.from_deployment(
        deployment(2, 2)
        | {
            "status": {
                "observedGeneration": 1,
                "replicas": 3,
                "readyReplicas": 3,
                "updatedReplicas": 2,
            }
        }
    )
    assert surplus is not None and not surplus.rolled_out


def test_transition_times_move_only_when_the_status_flips() -> None:
    first = compute_status(
        generation=1, pools=pools(decode=0), desired={}, problems=[], previous=None, now=T0
    )
    same = compute_status(
        generation=2, pools=pools(decode=1), desired={}, problems=[], previous=first, now=T1
    )
    assert conditions(same)["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    flipped = compute_status(
        generation=2, pools=pools(), desired={}, problems=[], previous=same, now=T1
    )
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_invalid_spec_status_says_what_to_fix_and_keeps_the_pools() -> None:
    previous = {
        "conditions": [{"type": "ScalingActive", "status": "True"}],
        "pools": {"decode": {"replicas": 2, "readyReplicas": 2}},
    }
    status = invalid_status(
        generation=7, problems=["spec.image: Field required"], previous=previous, now=T0
    )
    c = conditions(status)
    assert c["Degraded"]["message"] == "fix the spec: spec.image: Field required"
    assert c["Ready"]["reason"] == c["Progressing"]["reason"] == "InvalidSpec"
    assert status["observedGeneration"] == 7
    # the pools still run the last valid spec: reported as they were
    assert status["pools"] == previous["pools"]
    # only the reconciler's own conditions: the planner's merge in by type on the server
    assert "ScalingActive" not in c


def test_the_reconcilers_status_holds_its_own_conditions_only() -> None:
    """Each writer applies its own conditions (a list-map keyed by type in the CRD): a
    status built from a stale read cannot drop or revert another writer's."""
    previous = {
        "conditions": [
            {"type": "ScalingActive", "status": "True"},
            {"type": "Ready", "status": "False"},
        ]
    }
    status = compute_status(
        generation=1, pools=pools(), desired={}, problems=[], previous=previous, now=T0
    )
    types = [c["type"] for c in status["conditions"]]
    assert types == ["Ready", "Progressing", "Degraded"]


def test_url_and_warnings_are_reported_and_warnings_left_out_when_fixed() -> None:
    warned = compute_status(
        generation=1,
        pools=pools(),
        desired={},
        problems=[],
        previous=None,
        now=T0,
        url="http://demo-router.ns.svc:8000",
        warnings=["spec.slo.ttftSeconds is deprecated"],
    )
    assert warned["url"] == "http://demo-router.ns.svc:8000"
    assert warned["warnings"] == ["spec.slo.ttftSeconds is deprecated"]
    fixed = compute_status(
        generation=2,
        pools=pools(),
        desired={},
        problems=[],
        previous=warned,
        now=T1,
        url=warned["url"],
    )
    # left out of what the reconciler applies: the API server removes the field it owned
    assert "warnings" not in fixed
    assert fixed["url"] == warned["url"]
    invalid = invalid_status(
        generation=3, problems=["spec.x: bad"], previous=warned, now=T1, warnings=["w"]
    )
    assert invalid["warnings"] == ["w"]
    assert invalid["url"] == warned["url"]  # the router still serves the last valid spec
    quiet = invalid_status(generation=3, problems=["spec.x: bad"], previous=warned, now=T1)
    assert "warnings" not in quiet


def test_every_condition_carries_every_field() -> None:
    for status in (
        compute_status(generation=4, pools=pools(), desired={}, problems=[], previous=None, now=T0),
        invalid_status(generation=4, problems=["spec.x: bad"], previous=None, now=T0),
    ):
        for cond in status["conditions"]:
            assert set(cond) == {
                "type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"
            }  # fmt: skip
            assert cond["reason"] and cond["message"] and cond["observedGeneration"] == 4
