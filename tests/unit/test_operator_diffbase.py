"""What kopf remembers of each object to tell a change from an echo: the operator's
lean builder gives kopf the essence kopf's own builder gives (so change handlers fire
exactly as before), and none for the kinds no change handler watches."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest
from splitserve_operator.control.cache import ServiceCache
from splitserve_operator.control.diffbase import LeanDiffBase

pytestmark = pytest.mark.unit

PREFIX, KEY = "kopf.splitserve.io", "last-handled-configuration"
TRACKED = ("splitserve.io/v1alpha1", "InferenceService")


def _service() -> dict[str, Any]:
    return {
        "apiVersion": TRACKED[0],
        "kind": TRACKED[1],
        "metadata": {
            "name": "demo",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "7",
            "generation": 2,
            "labels": {"team": "a"},
            "annotations": {
                f"{PREFIX}/{KEY}": '{"spec": {}}',
                f"{PREFIX}/kopf-managed": "yes",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "note": "kept",
            },
            "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {"f:model": {}}}}],
        },
        "spec": {"model": {"name": "m"}, "decode": {"replicas": 2}},
        "status": {"observedGeneration": 2, "conditions": [{"type": "Ready"}]},
    }


def _builders() -> tuple[LeanDiffBase, kopf.AnnotationsDiffBaseStorage]:
    lean = LeanDiffBase(prefix=PREFIX, key=KEY, changing_kinds=[TRACKED])
    return lean, kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key=KEY)


def test_the_essence_is_kopfs_own_for_a_watched_kind() -> None:
    lean, kopfs = _builders()
    body = kopf.Body(_service())  # type: ignore[arg-type]
    essence = lean.build(body=body)
    assert essence == kopfs.build(body=body)
    assert essence == {
        "spec": {"model": {"name": "m"}, "decode": {"replicas": 2}},
        "metadata": {"labels": {"team": "a"}, "annotations": {"note": "kept"}},
    }
    extra = ["status.observedGeneration"]
    assert lean.build(body=body, extra_fields=extra) == kopfs.build(body=body, extra_fields=extra)


def test_status_and_bookkeeping_do_not_change_it_a_spec_or_label_does() -> None:
    lean, _ = _builders()
    before = lean.build(body=kopf.Body(_service()))  # type: ignore[arg-type]
    echo = _service()
    echo["status"]["conditions"] = []
    echo["metadata"]["resourceVersion"] = "8"
    echo["metadata"]["managedFields"] = []
    assert lean.build(body=kopf.Body(echo)) == before  # type: ignore[arg-type]
    for path, value in ((("spec", "decode", "replicas"), 3), (("metadata", "labels", "team"), "b")):
        changed = _service()
        changed[path[0]][path[1]][path[2]] = value
        assert lean.build(body=kopf.Body(changed)) != before  # type: ignore[arg-type]


def test_the_essence_is_a_copy_the_body_can_change_under() -> None:
    lean, _ = _builders()
    raw = _service()
    essence = lean.build(body=kopf.Body(raw))  # type: ignore[arg-type]
    raw["spec"]["decode"]["replicas"] = 9
    raw["metadata"]["labels"]["team"] = "z"
    assert essence["spec"]["decode"]["replicas"] == 2
    assert essence["metadata"]["labels"]["team"] == "a"


def test_no_essence_for_kinds_only_event_handlers_see() -> None:
    lean, _ = _builders()
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "labels": {"a": "b"}},
        "spec": {"replicas": 1},
    }
    assert lean.build(body=kopf.Body(deployment)) == {}  # type: ignore[arg-type]


def test_the_cache_peek_is_the_stored_body_and_follows_each_new_one() -> None:
    cache = ServiceCache()
    key = cache.observe("ADDED", _service())
    peeked = cache.peek(key)
    assert peeked is not None and peeked == _service()
    assert cache.peek(key) is peeked  # no copy per look
    copied = cache.get(key)
    assert copied == peeked and copied is not peeked
    newer = copy.deepcopy(_service())
    newer["metadata"]["resourceVersion"] = "8"
    cache.observe("MODIFIED", newer)
    assert cache.peek(key) is not peeked  # replaced, not changed in place
    assert peeked["metadata"]["resourceVersion"] == "7"
    assert (cache.peek(key) or {})["metadata"]["resourceVersion"] == "8"
    cache.observe("DELETED", newer)
    assert cache.peek(key) is None
