"""What the operator's field manager owns of a live object, and when an apply is due:
against objects the emulator's field-ownership model stored (as an API server would),
not hand-written managedFields. (The checks of the three-way merge this replaces live
here: drift is set back, fields no longer wanted go, others' fields and server defaults
are left alone.)"""

from __future__ import annotations

import copy
from typing import Any

import api_defaults
import field_managers as fm
import pytest
from quantities import canonicalize_quantities
from splitserve_operator.control.ownership import needs_apply, owned, owners

pytestmark = pytest.mark.unit

TYPES = fm.ListTypes()
ME = "splitserve-operator"


def _manifest(**pod: Any) -> dict[str, Any]:
    container = {
        "name": "decode",
        "image": "w:1",
        "resources": {"requests": {"nvidia.com/gpu": 1, "cpu": "0.5", "memory": "1024Mi"}},
        "ports": [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "labels": {"ours": "1"}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"spec": {"containers": [container], **pod}},
        },
    }


def _server(
    live: dict[str, Any] | None, manifest: dict[str, Any], manager: str = ME
) -> dict[str, Any]:
    """What the API server stores after ``manager`` applies ``manifest``."""

    def default(obj: dict[str, Any]) -> dict[str, Any]:
        api_defaults.deployment(obj)
        return obj

    out = fm.apply(live, manifest, manager=manager, force=True, types=TYPES, has_status=True,
                   canonicalize=canonicalize_quantities, default=default)  # fmt: skip
    fm.write_managers(out.obj, out.managers, live, "2026-12-01T00:00:00Z")
    return out.obj


def _edit(live: dict[str, Any], manager: str, change: Any) -> dict[str, Any]:
    new = copy.deepcopy(live)
    change(new)
    managers = fm.record_update(live, new, manager=manager, types=TYPES, has_status=True)
    fm.write_managers(new, managers, live, "2026-12-01T00:00:01Z")
    return new


def test_what_the_server_stores_needs_no_apply() -> None:
    """Canonical quantities ("1", "500m", "1Gi") and defaults are not drift."""
    live = _server(None, _manifest())
    resources = live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert resources == {"nvidia.com/gpu": "1", "cpu": "500m", "memory": "1Gi"}
    assert live["spec"]["progressDeadlineSeconds"] == 600  # a default, owned by nobody
    assert not needs_apply(_manifest(), live, ME)


def test_an_object_never_applied_or_absent_needs_one() -> None:
    assert needs_apply(_manifest(), None, ME)
    live = _server(None, _manifest(), manager="someone-else")
    assert needs_apply(_manifest(), live, ME)
    assert owned(live, ME) is None


def test_a_change_by_another_writer_is_drift() -> None:
    live = _server(None, _manifest())
    evil = _edit(live, "kubectl", lambda o: o["spec"]["template"]["spec"]["containers"][0]
                 .update(image="evil:latest"))  # fmt: skip
    assert needs_apply(_manifest(), evil, ME)
    scaled = _edit(live, "kubectl", lambda o: o["spec"].update(replicas=7))
    assert owners(scaled, ("spec", "replicas")) == ["kubectl"]
    assert needs_apply(_manifest(), scaled, ME)


def test_others_fields_and_server_defaults_are_not_drift() -> None:
    live = _server(None, _manifest())
    labelled = _edit(live, "team", lambda o: o["metadata"]["labels"].update(team="a"))
    sidecar = _edit(labelled, "injector", lambda o: o["spec"]["template"]["spec"]["containers"]
                    .append({"name": "mesh", "image": "m:1"}))  # fmt: skip
    assert not needs_apply(_manifest(), sidecar, ME)


def test_a_spec_change_or_a_field_no_longer_wanted_needs_an_apply() -> None:
    live = _server(None, _manifest(nodeSelector={"gpu": "h100"}))
    assert not needs_apply(_manifest(nodeSelector={"gpu": "h100"}), live, ME)
    assert needs_apply(_manifest(), live, ME)  # nodeSelector no longer wanted
    assert needs_apply(_manifest(nodeSelector={"gpu": "a100"}), live, ME)
    after = _server(live, _manifest())
    assert "nodeSelector" not in after["spec"]["template"]["spec"]
    assert not needs_apply(_manifest(), after, ME)


def test_quantities_compare_by_value_and_only_where_they_are_quantities() -> None:
    live = _server(None, _manifest())
    bigger = _manifest()
    bigger["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "2Gi"
    assert needs_apply(bigger, live, ME)
    as_text = _manifest()
    as_text["spec"]["replicas"] = "2"  # not a quantity field: "2" is not 2
    assert needs_apply(as_text, live, ME)


def test_status_ownership_is_per_subresource() -> None:
    crd = fm.ListTypes(crd_keys={("status", "conditions"): ("type",)}, builtin=False)
    base: dict[str, Any] = {"apiVersion": "x/v1", "kind": "X",
                            "metadata": {"name": "x", "namespace": "ns"}}  # fmt: skip
    mine: dict[str, Any] = {
        **base,
        "status": {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    theirs: dict[str, Any] = {
        **base,
        "status": {"conditions": [{"type": "ScalingActive", "status": "True"}]},
    }
    live: dict[str, Any] = {**base, "spec": {}}
    for manifest, manager in ((mine, ME), (theirs, "planner")):
        out = fm.apply(live, manifest, manager=manager, force=True, types=crd,
                       subresource="status", has_status=True)  # fmt: skip
        fm.write_managers(out.obj, out.managers, live, "t")
        live = out.obj
    assert not needs_apply(mine, live, ME, "status")
    assert needs_apply(mine, live, ME)  # nothing applied to the main resource
    flipped = copy.deepcopy(mine)
    flipped["status"]["conditions"][0]["status"] = "False"
    assert needs_apply(flipped, live, ME, "status")


def test_only_an_object_a_merging_version_made_is_upgraded() -> None:
    from splitserve_operator.control.ownership import upgrade_patch

    live = _server(None, _manifest())
    assert upgrade_patch(live, ME) is None  # applied already: nothing to upgrade
    legacy = _manifest()
    legacy["metadata"]["annotations"] = {"splitserve.io/last-applied": "{}"}
    merged = copy.deepcopy(legacy)
    managers = fm.record_update(None, merged, manager=ME, types=TYPES, has_status=True)
    fm.write_managers(merged, managers, None, "t")
    merged["metadata"]["resourceVersion"] = "7"
    ops = upgrade_patch(merged, ME)
    assert ops is not None and ops[0] == {"op": "test", "path": "/metadata/resourceVersion",
                                          "value": "7"}  # fmt: skip
    (entry,) = ops[1]["value"]
    assert (entry["manager"], entry["operation"]) == (ME, "Apply")
    assert upgrade_patch(merged, "someone-else") is None
