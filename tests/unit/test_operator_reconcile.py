"""Reconcile against an in-memory fake of the API (no HTTP): idempotence, the token,
ownership, and how each API failure is reported."""

from __future__ import annotations

import copy
import datetime as dt
import threading
from collections.abc import Mapping
from typing import Any

import field_managers as fm
import pytest
from splitserve_operator.control.k8s import (
    DEPLOYMENT,
    WORKER_POOL,
    AlreadyExists,
    ApiError,
    Applied,
    Conflict,
    Forbidden,
    Invalid,
    Kind,
    NotFound,
    kind_of,
)
from splitserve_operator.control.outcome import Action, RetryLater
from splitserve_operator.control.reconciler import Reconciler
from splitserve_operator.control.serializer import Serializer

pytestmark = pytest.mark.unit


CRD_TYPES = fm.ListTypes(crd_keys={("status", "conditions"): ("type",)}, builtin=False)
WITH_STATUS = {"InferenceService", "WorkerPool", "Deployment", "Service", "PodDisruptionBudget"}


class FakeCluster:
    """Objects in a dict, with field ownership as an API server keeps it (the emulator's
    model, :mod:`field_managers`); ``fail`` maps (verb, kind, name) to an error to raise."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.fail: dict[tuple[str, str, str], ApiError] = {}
        self.version = 0

    def _check(self, verb: str, kind: str, name: str) -> None:
        self.calls.append((verb, kind, name))
        error = self.fail.get((verb, kind, name))
        if error is not None:
            raise error

    @staticmethod
    def _types(kind: str) -> fm.ListTypes:
        return CRD_TYPES if kind in ("InferenceService", "WorkerPool") else fm.ListTypes()

    def _store(
        self, key: tuple[str, str, str], obj: dict[str, Any], managers: Any
    ) -> dict[str, Any]:
        old = self.objects.get(key)
        fm.write_managers(obj, managers, old, "2026-01-01T00:00:00Z")
        meta = obj.setdefault("metadata", {})
        meta.setdefault("generation", 1)
        if old is not None and {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        } != {k: v for k, v in obj.items() if k not in ("metadata", "status")}:
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def put(self, manifest: Mapping[str, Any], manager: str = "someone") -> None:
        """An object someone else made (recorded as theirs, as on a real server)."""
        kind = str(manifest["kind"])
        meta = manifest["metadata"]
        obj = copy.deepcopy(dict(manifest))
        managers = fm.record_update(None, obj, manager=manager, types=self._types(kind),
                                    has_status=kind in WITH_STATUS)  # fmt: skip
        self._store((kind, meta["namespace"], meta["name"]), obj, managers)

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("get", kind.kind, name)
        obj = self.objects.get((kind.kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(manifest)
        meta = manifest["metadata"]
        self._check("create", kind.kind, meta["name"])
        key = (kind.kind, meta["namespace"], meta["name"])
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        obj = copy.deepcopy(dict(manifest))
        managers = fm.record_update(None, obj, manager="splitserve-operator",
                                    types=self._types(kind.kind))  # fmt: skip
        return self._store(key, obj, managers)

    def apply(
        self,
        manifest: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = True,
        subresource: str | None = None,
    ) -> Applied:
        kind = kind_of(manifest)
        meta = manifest["metadata"]
        self._check("apply" if subresource is None else f"apply/{subresource}", kind.kind,
                    meta["name"])  # fmt: skip
        key = (kind.kind, meta["namespace"], meta["name"])
        live = self.objects.get(key)
        if live is None and subresource:
            raise NotFound(404, "NotFound", "gone")
        try:
            out = fm.apply(live, manifest, manager=field_manager, force=force,
                           types=self._types(kind.kind), subresource=subresource or "",
                           has_status=kind.kind in WITH_STATUS)  # fmt: skip
        except fm.ApplyConflict as exc:
            raise Conflict(409, "Conflict", str(exc)) from exc
        return Applied(self._store(key, out.obj, out.managers), created=live is None)

    def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        content_type: str = "",
    ) -> dict[str, Any]:
        from kube_emulator import merge_patch

        self._check("patch" if subresource is None else f"patch/{subresource}", kind.kind, name)
        key = (kind.kind, namespace, name)
        if key not in self.objects:
            raise NotFound(404, "NotFound", "gone")
        old = self.objects[key]
        new = merge_patch(old, patch)
        managers = fm.record_update(old, new, manager="someone", types=self._types(kind.kind),
                                    subresource=subresource or "",
                                    has_status=kind.kind in WITH_STATUS)  # fmt: skip
        return self._store(key, new, managers)

    def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def writes(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[0] != "get"]

    def ready(self) -> None:
        """Every Deployment's pods ready, as the Deployment controller would report."""
        for (kind, namespace, name), obj in list(self.objects.items()):
            if kind == "Deployment":
                n = obj["spec"]["replicas"]
                status = {
                    "observedGeneration": obj["metadata"]["generation"],
                    **{k: n for k in ("replicas", "readyReplicas", "updatedReplicas")},
                    "availableReplicas": n,
                }
                self.patch(DEPLOYMENT, namespace, name, {"status": status}, subresource="status")


NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def reconciler(cluster: FakeCluster) -> Reconciler:
    tokens = iter(f"token-{i}" for i in range(100))
    return Reconciler(cluster, clock=lambda: NOW, token_factory=lambda: next(tokens))


def service(cluster: FakeCluster, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"name": "m"}, "image": "img:1", **spec},
    }
    cluster.objects[("InferenceService", "ns", "demo")] = copy.deepcopy(body)
    return body


def latest(cluster: FakeCluster) -> dict[str, Any]:
    return copy.deepcopy(cluster.objects[("InferenceService", "ns", "demo")])


def test_first_reconcile_creates_without_reading_then_nothing_changes() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    outcome = rec.reconcile(service(cluster))
    assert len(outcome.created) == 16 and not outcome.problems
    assert not [c for c in cluster.calls if c[0] == "get"]
    assert cluster.events[0][:2] == ("Normal", "Created")
    cluster.calls.clear()
    again = rec.reconcile(latest(cluster))
    assert set(again.actions.values()) == {Action.UNCHANGED}
    assert [c for c in cluster.writes() if c[1] != "Secret"] == []
    assert cluster.events[1:] == []


def test_an_unchanged_ready_service_costs_reads_only() -> None:
    """Once every pool is ready, a reconcile of an unchanged service writes nothing, not
    even the token Secret's create."""
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    cluster.ready()
    rec.reconcile(latest(cluster))  # reports the pools ready
    cluster.calls.clear()
    rec.reconcile(latest(cluster))
    assert cluster.writes() == []


def test_a_field_the_spec_no_longer_asks_for_is_removed_and_others_kept() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster, decode={"nodeSelector": {"gpu": "h100"}}))
    key = ("Deployment", "ns", "demo-decode")
    assert cluster.objects[key]["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    cluster.patch(DEPLOYMENT, "ns", "demo-decode", {"metadata": {"labels": {"team": "a"}}})
    body = latest(cluster)
    body["spec"]["decode"] = {}  # nodeSelector gone from the spec
    body["metadata"]["generation"] = 2
    outcome = rec.reconcile(body)
    assert "Deployment/demo-decode" in outcome.patched
    deployment = cluster.objects[key]
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
    assert deployment["metadata"]["labels"]["team"] == "a"  # another writer's label stays


def test_a_pool_scaled_by_someone_else_keeps_its_size_until_the_spec_asks_anew() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    cluster.patch(WORKER_POOL, "ns", "demo-decode", {"spec": {"replicas": 5}}, subresource="scale")
    rec.reconcile(latest(cluster))
    assert cluster.objects[("Deployment", "ns", "demo-decode")]["spec"]["replicas"] == 5
    rec.reconcile(latest(cluster))  # again: nothing reverts it
    assert cluster.objects[("WorkerPool", "ns", "demo-decode")]["spec"]["replicas"] == 5
    body = latest(cluster)
    body["spec"]["decode"] = {"replicas": 2}
    rec.reconcile(body)
    assert cluster.objects[("WorkerPool", "ns", "demo-decode")]["spec"]["replicas"] == 2
    assert cluster.objects[("Deployment", "ns", "demo-decode")]["spec"]["replicas"] == 2


def test_the_status_holds_the_reconcilers_conditions_beside_others() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    planner = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "demo", "namespace": "ns"},
               "status": {"conditions": [{"type": "ScalingActive", "status": "True"}]}}  # fmt: skip
    cluster.apply(planner, field_manager="splitserve-planner", subresource="status")
    body = latest(cluster)
    body["spec"]["image"] = "img:2"
    body["metadata"]["generation"] = 2
    rec.reconcile(body)
    types = [c["type"] for c in latest(cluster)["status"]["conditions"]]
    assert sorted(types) == ["Degraded", "Progressing", "Ready", "ScalingActive"]


def test_the_token_is_never_regenerated() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    rec.reconcile(latest(cluster))
    rec.reconcile(latest(cluster) | {"status": {}})  # as after a restart
    secret = cluster.objects[("Secret", "ns", "demo-worker-token")]
    assert secret["stringData"] == {"token": "token-0"}
    assert not [c for c in cluster.calls if c[1] == "Secret" and c[0] in ("get", "patch")]


def test_spec_changes_are_patched() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    body = latest(cluster)
    body["spec"]["decode"] = {"replicas": 4}
    body["metadata"]["generation"] = 2
    outcome = rec.reconcile(body)
    assert sorted(outcome.patched) == ["Deployment/demo-decode", "WorkerPool/demo-decode"]
    assert cluster.objects[("Deployment", "ns", "demo-decode")]["spec"]["replicas"] == 4
    assert latest(cluster)["status"]["observedGeneration"] == 2


def test_an_invalid_spec_is_reported_once_and_touches_nothing() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    body = service(cluster, decode={"replicas": -1})
    outcome = rec.reconcile(body)
    assert outcome.problems and not outcome.actions
    degraded = next(c for c in latest(cluster)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "spec.decode.replicas" in degraded["message"]
    rec.reconcile(latest(cluster))
    assert [e[1] for e in cluster.events] == ["InvalidSpec"]  # not repeated
    assert set(k[0] for k in cluster.objects) == {"InferenceService"}


def test_objects_being_deleted_are_left_to_the_garbage_collector() -> None:
    cluster = FakeCluster()
    body = service(cluster)
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert reconciler(cluster).reconcile(body).skipped
    assert cluster.calls == []


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Invalid(422, "Invalid", "spec.template.spec.affinity: Invalid value"), "ApplyFailed"),
        (Forbidden(403, "Forbidden", "cannot create deployments"), "Forbidden"),
    ],
)
def test_refusals_become_degraded_and_the_rest_is_applied(error: ApiError, reason: str) -> None:
    cluster = FakeCluster()
    cluster.fail[("apply", "Deployment", "demo-decode")] = error
    outcome = reconciler(cluster).reconcile(service(cluster))
    assert outcome.actions["Deployment/demo-decode"] == Action.FAILED
    assert ("Deployment", "ns", "demo-router") in cluster.objects
    degraded = next(c for c in latest(cluster)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == reason and error.message in degraded["message"]
    assert ("Warning", reason) in [e[:2] for e in cluster.events]


@pytest.mark.parametrize("status", [0, 409, 429, 500, 503])
def test_transient_failures_ask_for_a_retry(status: int) -> None:
    cluster = FakeCluster()
    hint = 7.0 if status == 429 else None
    cluster.fail[("apply", "ConfigMap", "demo-config")] = ApiError(status, "x", "later", hint)
    with pytest.raises(RetryLater) as exc:
        reconciler(cluster).reconcile(service(cluster))
    assert exc.value.retry_after == hint


def test_objects_of_others_are_not_taken_over_but_orphans_of_ours_are() -> None:
    cluster = FakeCluster()
    cluster.put(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": "demo-prefill",
                "namespace": "ns",
                "ownerReferences": [{"uid": "someone", "controller": True}],
            },
            "spec": {"replicas": 9},
        }
    )
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "demo-prefill",
                "namespace": "ns",
                "labels": {
                    "app.kubernetes.io/managed-by": "splitserve-operator",
                    "app.kubernetes.io/instance": "demo",
                },
            },
            "spec": {},
        }
    )
    outcome = reconciler(cluster).reconcile(service(cluster))
    assert outcome.actions["Deployment/demo-prefill"] == Action.FAILED
    assert outcome.problems[0].reason.value == "NameConflict"
    assert cluster.objects[("Deployment", "ns", "demo-prefill")]["spec"]["replicas"] == 9
    assert outcome.actions["Service/demo-prefill"] == Action.PATCHED
    adopted = cluster.objects[("Service", "ns", "demo-prefill")]
    assert adopted["metadata"]["ownerReferences"][0]["uid"] == "u1"


def test_serializer_runs_one_at_a_time_and_coalesces_nudges() -> None:
    serializer = Serializer()
    key = ("ns", "demo")
    inside = threading.Event()
    release = threading.Event()
    runs: list[str] = []

    def slow() -> None:
        runs.append("slow")
        inside.set()
        release.wait(5)

    thread = threading.Thread(target=lambda: serializer.run(key, slow))
    thread.start()
    assert inside.wait(5)
    for _ in range(3):
        assert serializer.nudge(key, lambda: runs.append("nudged")) is False
    release.set()
    thread.join(5)
    assert runs == ["slow", "slow"]  # the nudges became one more run of the running fn
    assert serializer.nudge(key, lambda: runs.append("now")) is True
    assert runs[-1] == "now"


def test_a_lasting_problem_is_announced_once() -> None:
    cluster = FakeCluster()
    cluster.fail[("apply", "Deployment", "demo-decode")] = Invalid(422, "Invalid", "bad")
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    rec.reconcile(latest(cluster))
    rec.reconcile(latest(cluster))
    assert [e[1] for e in cluster.events if e[0] == "Warning"] == ["ApplyFailed"]


def test_a_network_policy_turned_off_is_opened_not_left_closed() -> None:
    cluster = FakeCluster()
    rec = reconciler(cluster)
    key = ("NetworkPolicy", "ns", "demo-workers")
    # never enabled: nothing is made
    rec.reconcile(service(cluster, networkPolicy={"enabled": False}))
    assert key not in cluster.objects
    cluster = FakeCluster()
    rec = reconciler(cluster)
    rec.reconcile(service(cluster))
    assert len(cluster.objects[key]["spec"]["ingress"]) == 3
    body = service(cluster, networkPolicy={"enabled": False})
    body["status"] = {"observedGeneration": 1}
    outcome = rec.reconcile(body)
    assert outcome.actions["NetworkPolicy/demo-workers"] == Action.PATCHED
    assert cluster.objects[key]["spec"]["ingress"] == [{}]
    assert rec.reconcile(body).actions["NetworkPolicy/demo-workers"] == Action.UNCHANGED
