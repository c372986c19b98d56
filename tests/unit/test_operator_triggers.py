"""Which InferenceService watch events start a reconcile: the operator is level-triggered
(a spec generation its status has not observed, or a listing), so the echo of its own
status write, or of another writer's, starts none and a change of spec always does."""

from __future__ import annotations

from typing import Any

import pytest
from splitserve_operator.control.controller import Controller

pytestmark = pytest.mark.unit


def _body(generation: int, observed: int | None = None, **meta: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "demo", "namespace": "ns", "generation": generation, **meta},
        "spec": {},
    }
    if observed is not None:
        body["status"] = {"observedGeneration": observed}
    return body


@pytest.mark.parametrize(
    ("event_type", "body", "wanted"),
    [
        ("ADDED", _body(1), True),  # just made: no status yet
        ("MODIFIED", _body(1, observed=1), False),  # the echo of a status write
        ("MODIFIED", _body(2, observed=1), True),  # the spec changed
        (None, _body(3, observed=3), True),  # listed: start, new leader, relist
        ("MODIFIED", _body(2, observed=2, deletionTimestamp="2026-01-01T00:00:00Z"), False),
        (None, _body(2, observed=1, deletionTimestamp="2026-01-01T00:00:00Z"), False),
        ("DELETED", _body(2, observed=1), False),
    ],
)
def test_a_reconcile_follows_an_unobserved_generation_or_a_listing(
    event_type: str | None, body: dict[str, Any], wanted: bool
) -> None:
    assert Controller.wants_reconcile(event_type, body) is wanted
