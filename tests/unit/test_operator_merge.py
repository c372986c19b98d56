"""Three-way merge patches: set what drifted, remove what we stopped wanting, keep the rest."""

from __future__ import annotations

import json

import pytest
from splitserve_operator.control.merge import (
    apply_patch,
    last_applied,
    matches,
    three_way,
    with_last_applied,
)
from splitserve_operator.render.names import ANNOTATION_LAST_APPLIED

pytestmark = pytest.mark.unit


def test_matches_allows_server_defaults_and_extra_keys() -> None:
    assert matches({"a": 1}, {"a": 1, "b": 2})
    assert matches([{"name": "c"}], [{"name": "c", "terminationMessagePath": "/dev/x"}])
    assert not matches([{"name": "c"}], [{"name": "c"}, {"name": "d"}])
    assert not matches({"a": True}, {"a": 1})  # bool is not int
    assert matches(2, 2.0) and not matches("2", 2)
    assert matches({}, None) and matches([], None)


def test_nothing_to_do_gives_an_empty_patch() -> None:
    desired = {"spec": {"replicas": 2}, "metadata": {"labels": {"a": "b"}}}
    actual = with_last_applied(desired) | {"status": {"x": 1}}
    assert apply_patch(desired, actual) == {}


def test_drift_is_set_back() -> None:
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"image": "a"}]}}}}
    actual = with_last_applied(desired)
    actual["spec"] = {"replicas": 5, "template": {"spec": {"containers": [{"image": "evil"}]}}}
    assert apply_patch(desired, actual) == {
        "spec": {"replicas": 2, "template": {"spec": {"containers": [{"image": "a"}]}}}
    }


def test_fields_no_longer_wanted_are_removed_and_others_kept() -> None:
    before = {
        "metadata": {"labels": {"ours": "1"}},
        "spec": {"nodeSelector": {"gpu": "a"}, "replicas": 1},
    }
    actual = with_last_applied(before)
    actual["metadata"]["labels"]["theirs"] = "2"
    actual["spec"]["schedulerName"] = "default-scheduler"  # a server default
    now = {"metadata": {"labels": {"ours": "1"}}, "spec": {"replicas": 1}}
    patch = apply_patch(now, actual)
    assert patch["spec"] == {"nodeSelector": None}
    assert "labels" not in patch["metadata"]
    assert json.loads(patch["metadata"]["annotations"][ANNOTATION_LAST_APPLIED]) == now


def test_three_way_without_history_never_removes() -> None:
    assert three_way(None, {"a": 1}, {"a": 1, "b": 2}) == {}


def test_last_applied_tolerates_garbage() -> None:
    assert last_applied({"metadata": {"annotations": {ANNOTATION_LAST_APPLIED: "{oops"}}}) is None
    assert last_applied({"metadata": {"annotations": {ANNOTATION_LAST_APPLIED: "[1]"}}}) is None
    assert last_applied({}) is None
