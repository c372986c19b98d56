"""The pure parts of the test API emulator, against what kube-apiserver does: canonical
quantities (apimachinery's rules), field ownership under server-side apply and updates
(structured-merge-diff's), label selectors, defaults. If these are wrong, the operator
tests built on the emulator prove nothing."""

from __future__ import annotations

import copy
from typing import Any

import api_defaults
import field_managers as fm
import label_selectors
import pytest
from quantities import QuantityError, canonical, canonicalize_quantities

pytestmark = pytest.mark.unit

TYPES = fm.ListTypes()
REPLICAS = (("f", "spec"), ("f", "replicas"))


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        (1, "1"),
        ("0.5", "500m"),
        ("1.5", "1500m"),
        ("2000m", "2"),
        ("1000", "1k"),
        ("1500", "1500"),
        ("1024Mi", "1Gi"),
        ("1536Mi", "1536Mi"),
        ("2048Ki", "2Mi"),
        ("0.5Gi", "512Mi"),
        ("1.5Ki", "1536"),  # BinarySI below a whole suffix reads as decimal
        ("0.5Ki", "512"),
        ("0.1Ki", "102400m"),
        ("1e3", "1e3"),
        ("12e6", "12e6"),
        ("0Gi", "0"),
        ("0.0000000001", "1n"),  # rounded up to nano
        ("1000k", "1M"),
        ("-1", "-1"),
    ],
)
def test_quantities_are_stored_in_canonical_form(sent: object, stored: str) -> None:
    assert canonical(sent) == stored


@pytest.mark.parametrize("bad", ["lots", "1.2.3", "", True, None, "Gi"])
def test_a_non_quantity_is_refused(bad: object) -> None:
    with pytest.raises(QuantityError):
        canonical(bad)


def test_only_quantity_fields_are_rewritten() -> None:
    pod = {
        "containers": [
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}, "args": ["1"]}
        ],
        "volumes": [{"name": "v", "emptyDir": {"sizeLimit": "1024Mi"}}],
        "terminationGracePeriodSeconds": 60,
    }
    out = canonicalize_quantities(pod)
    assert out["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert out["volumes"][0]["emptyDir"]["sizeLimit"] == "1Gi"
    assert out["containers"][0]["args"] == ["1"] and out["terminationGracePeriodSeconds"] == 60


def _deployment(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "replicas": 2,
        "template": {
            "spec": {
                "nodeSelector": {"gpu": "a"},
                "containers": [
                    {
                        "name": "c",
                        "image": "i:1",
                        "ports": [{"containerPort": 1, "protocol": "TCP"}],
                    }
                ],
            }
        },
    }
    body.update(spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "labels": {"ours": "1"}},
        "spec": body,
    }


def _stored(outcome: fm.Outcome, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    fm.write_managers(outcome.obj, outcome.managers, previous, "2026-12-01T00:00:00Z")
    return outcome.obj


def _apply(live: dict[str, Any] | None, config: dict[str, Any], manager: str = "op",
           force: bool = False) -> dict[str, Any]:  # fmt: skip
    return _stored(fm.apply(live, config, manager=manager, force=force, types=TYPES), live)


def _update(
    old: dict[str, Any], new: dict[str, Any], manager: str, sub: str = ""
) -> dict[str, Any]:
    managers = fm.record_update(old, new, manager=manager, types=TYPES, subresource=sub)
    fm.write_managers(new, managers, old, "2026-12-01T00:00:01Z")
    return new


def test_apply_creates_and_records_what_the_manager_owns() -> None:
    obj = _apply(None, _deployment())
    (entry,) = obj["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"], entry["fieldsType"]) == (
        "op",
        "Apply",
        "FieldsV1",
    )
    tree = entry["fieldsV1"]
    assert tree["f:spec"]["f:replicas"] == {}
    container = tree["f:spec"]["f:template"]["f:spec"]["f:containers"]['k:{"name":"c"}']
    assert "." in container and "f:image" in container
    assert 'k:{"containerPort":1,"protocol":"TCP"}' in container["f:ports"]
    assert fm.decode(tree) == fm.fieldset(
        fm.tracked(obj, status_only=False, has_status=True), TYPES
    )
    assert obj["metadata"]["name"] == "d" and "f:name" not in tree.get("f:metadata", {})


def test_reapplying_the_same_configuration_changes_nothing() -> None:
    obj = _apply(None, _deployment())
    again = _apply(copy.deepcopy(obj), _deployment())
    assert again == obj


def test_an_update_takes_the_fields_it_changes_and_apply_then_conflicts() -> None:
    obj = _apply(None, _deployment())
    scaled = copy.deepcopy(obj)
    scaled["spec"]["replicas"] = 5
    scaled = _update(obj, scaled, "kubectl", sub="scale")
    assert fm.owners(scaled, REPLICAS) == ["kubectl"]
    assert fm.owners(scaled, (("f", "metadata"), ("f", "labels"), ("f", "ours"))) == ["op"]
    with pytest.raises(fm.ApplyConflict) as exc:
        _apply(copy.deepcopy(scaled), _deployment())
    assert 'conflict with "kubectl": .spec.replicas' in str(exc.value)
    forced = _apply(copy.deepcopy(scaled), _deployment(), force=True)
    assert forced["spec"]["replicas"] == 2 and fm.owners(forced, REPLICAS) == ["op"]


def test_the_same_value_is_shared_not_a_conflict() -> None:
    obj = _apply(None, _deployment())
    other = _apply(copy.deepcopy(obj), {**_deployment(), "metadata": {"name": "d"}}, "other")
    assert fm.owners(other, REPLICAS) == ["op", "other"]


def test_fields_a_manager_stops_applying_are_removed_unless_others_own_them() -> None:
    obj = _apply(None, _deployment())
    labelled = copy.deepcopy(obj)
    labelled["metadata"]["labels"]["theirs"] = "2"
    labelled = _update(obj, labelled, "someone")
    config = _deployment()
    del config["spec"]["template"]["spec"]["nodeSelector"]
    del config["spec"]["replicas"]
    config["metadata"]["labels"] = {}
    after = _apply(copy.deepcopy(labelled), config)
    assert "nodeSelector" not in after["spec"]["template"]["spec"]
    assert "replicas" not in after["spec"]
    assert after["metadata"]["labels"] == {"theirs": "2"}  # theirs stays, ours went


def test_a_field_taken_by_an_update_is_not_removed_when_the_applier_drops_it() -> None:
    obj = _apply(None, _deployment())
    scaled = copy.deepcopy(obj)
    scaled["spec"]["replicas"] = 5
    scaled = _update(obj, scaled, "hpa", sub="scale")
    config = _deployment()
    del config["spec"]["replicas"]
    after = _apply(copy.deepcopy(scaled), config)
    assert after["spec"]["replicas"] == 5 and fm.owners(after, REPLICAS) == ["hpa"]


def test_list_map_items_merge_by_key() -> None:
    obj = _apply(None, _deployment())
    sidecar = copy.deepcopy(obj)
    sidecar["spec"]["template"]["spec"]["containers"].append({"name": "mesh", "image": "m:1"})
    sidecar = _update(obj, sidecar, "injector")
    changed = _deployment()
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "i:2"
    after = _apply(copy.deepcopy(sidecar), changed)
    names = [(c["name"], c["image"]) for c in after["spec"]["template"]["spec"]["containers"]]
    assert names == [("c", "i:2"), ("mesh", "m:1")]


def test_a_list_map_item_without_its_key_is_invalid() -> None:
    config = _deployment()
    del config["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(fm.InvalidApply):
        fm.apply(None, config, manager="op", force=False, types=TYPES)


def test_status_conditions_of_two_managers_merge_by_type() -> None:
    crd_types = fm.ListTypes(crd_keys={("status", "conditions"): ("type",)}, builtin=False)
    live = {"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "x"}, "spec": {}}

    def status(manager: str, *types_: str, base: dict[str, Any]) -> dict[str, Any]:
        conditions = [{"type": t, "status": "True"} for t in types_]
        config = {"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "x"},
                  "status": {"conditions": conditions}}  # fmt: skip
        out = fm.apply(base, config, manager=manager, force=True, types=crd_types,
                       subresource="status", has_status=True)  # fmt: skip
        return _stored(out, base)

    one = status("operator", "Ready", "Degraded", base=live)
    two = status("planner", "ScalingActive", base=one)
    three = status("operator", "Ready", base=two)  # Degraded no longer applied
    assert [c["type"] for c in three["status"]["conditions"]] == ["Ready", "ScalingActive"]


def test_managed_fields_round_trip() -> None:
    paths = fm.fieldset(fm.tracked(_deployment(), status_only=False, has_status=True), TYPES)
    assert fm.decode(fm.encode(paths)) == paths


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("a=b", {"a": "b"}, True),
        ("a==b,c", {"a": "b"}, False),
        ("a!=b", {}, True),
        ("a in (x, y),!z", {"a": "y"}, True),
        ("a notin (x)", {"a": "x"}, False),
        ("", {"any": "thing"}, True),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert label_selectors.parse(selector)(labels) is matches


def test_deployment_defaults_fill_only_what_is_missing() -> None:
    obj = _deployment(strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0}})
    api_defaults.deployment(obj)
    spec = obj["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": "25%"}
    assert (spec["progressDeadlineSeconds"], spec["revisionHistoryLimit"]) == (600, 10)
    container = spec["template"]["spec"]["containers"][0]
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["terminationMessagePath"] == "/dev/termination-log"
    once = copy.deepcopy(obj)
    api_defaults.deployment(obj)
    assert obj == once
