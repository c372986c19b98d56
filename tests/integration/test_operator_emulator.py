"""The emulator fixture itself: what it adds to kmock must behave like an API server,
or the operator tests built on it prove nothing."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import urllib3
from kube_emulator import KubeEmulator, merge_patch
from splitserve_operator.control.k8s import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    JSON_PATCH,
    KINDS,
    AlreadyExists,
    ApiError,
    Invalid,
    NotFound,
)

pytestmark = pytest.mark.integration

CONFIGMAP = KINDS[("v1", "ConfigMap")]


def _cm(name: str, namespace: str = "ns", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, **extra},
        "data": {"a": "1"},
    }


def test_create_fills_server_metadata(kube_client) -> None:
    first = kube_client.create(_cm("x"))
    made = kube_client.create(_cm("y"))
    meta = made["metadata"]
    assert meta["namespace"] == "ns"
    assert meta["uid"] and meta["uid"] != first["metadata"]["uid"]
    assert meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    assert int(meta["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert kube_client.get(CONFIGMAP, "ns", "y") == made


def test_namespace_comes_from_the_url(kube_client) -> None:
    body = _cm("z")
    del body["metadata"]["namespace"]
    made = kube_client.request("POST", CONFIGMAP.path("from-url"), body=body)
    assert made["metadata"]["namespace"] == "from-url"


def test_duplicate_create_is_409_already_exists(kube_client) -> None:
    kube_client.create(_cm("dup"))
    with pytest.raises(AlreadyExists) as exc:
        kube_client.create(_cm("dup"))
    assert exc.value.status == 409


def test_create_answers_201(kube) -> None:
    http = urllib3.PoolManager()
    r = http.request(
        "POST",
        kube.url + CONFIGMAP.path("ns"),
        body=json.dumps(_cm("c201")),
        headers={"Content-Type": "application/json"},
    )
    assert r.status == 201


def test_writes_bump_resource_version_and_spec_changes_bump_generation(kube_client) -> None:
    made = kube_client.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"replicas": 1},
        }
    )
    rv0 = int(made["metadata"]["resourceVersion"])
    relabelled = kube_client.patch(DEPLOYMENT, "ns", "d", {"metadata": {"labels": {"a": "b"}}})
    assert int(relabelled["metadata"]["resourceVersion"]) > rv0
    assert relabelled["metadata"]["generation"] == 1
    scaled = kube_client.patch(DEPLOYMENT, "ns", "d", {"spec": {"replicas": 3}})
    assert scaled["metadata"]["generation"] == 2
    assert scaled["metadata"]["uid"] == made["metadata"]["uid"]
    same = kube_client.patch(DEPLOYMENT, "ns", "d", {"spec": {"replicas": 3}})
    assert same["metadata"]["resourceVersion"] == scaled["metadata"]["resourceVersion"]


def test_server_fields_cannot_be_patched(kube_client) -> None:
    made = kube_client.create(_cm("keep"))
    patched = kube_client.patch(
        CONFIGMAP, "ns", "keep", {"metadata": {"uid": "forged", "generation": 99}}
    )
    assert patched["metadata"]["uid"] == made["metadata"]["uid"]
    assert patched["metadata"]["generation"] == 1


def test_stale_resource_version_in_a_merge_patch_is_409(kube_client) -> None:
    made = kube_client.create(_cm("rv"))
    kube_client.patch(CONFIGMAP, "ns", "rv", {"data": {"a": "2"}})
    with pytest.raises(ApiError) as exc:
        kube_client.patch(
            CONFIGMAP,
            "ns",
            "rv",
            {
                "metadata": {"resourceVersion": made["metadata"]["resourceVersion"]},
                "data": {"a": "3"},
            },
        )
    assert exc.value.status == 409


def test_json_patch_test_failure_is_422_and_changes_nothing(kube_client) -> None:
    made = kube_client.create(_cm("jp"))
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "nope"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    with pytest.raises(Invalid):
        kube_client.patch(CONFIGMAP, "ns", "jp", ops, content_type=JSON_PATCH)
    assert kube_client.get(CONFIGMAP, "ns", "jp") == made
    rv = made["metadata"]["resourceVersion"]
    ops[0]["value"] = rv
    patched = kube_client.patch(CONFIGMAP, "ns", "jp", ops, content_type=JSON_PATCH)
    assert patched["metadata"]["finalizers"] == ["x"]


def test_status_subresource_separates_spec_and_status(kube_client, inference_service) -> None:
    made = kube_client.create(inference_service("s") | {"status": {"bogus": 1}})
    assert "status" not in made
    main = kube_client.patch(
        INFERENCE_SERVICE, "default", "s", {"spec": {"image": "other:1"}, "status": {"x": 1}}
    )
    assert main["spec"]["image"] == "other:1" and "status" not in main
    status = kube_client.patch(
        INFERENCE_SERVICE,
        "default",
        "s",
        {"spec": {"image": "ignored:1"}, "status": {"x": 2}},
        subresource="status",
    )
    assert status["status"] == {"x": 2} and status["spec"]["image"] == "other:1"
    assert status["metadata"]["generation"] == 2


def test_finalizers_delay_deletion(kube_client) -> None:
    kube_client.create(_cm("fin", finalizers=["test/hold"]))
    kube_client.delete(CONFIGMAP, "ns", "fin")
    held = kube_client.get(CONFIGMAP, "ns", "fin")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    kube_client.patch(CONFIGMAP, "ns", "fin", {"metadata": {"finalizers": None}})
    assert kube_client.get(CONFIGMAP, "ns", "fin") is None


def test_garbage_collection_follows_owner_uids(kube_client) -> None:
    owner = kube_client.create(_cm("owner"))
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    kube_client.create(_cm("child", ownerReferences=[ref]))
    kube_client.create(_cm("stranger", ownerReferences=[ref | {"uid": "someone-else"}]))
    kube_client.delete(CONFIGMAP, "ns", "owner")
    assert kube_client.get(CONFIGMAP, "ns", "child") is None
    assert kube_client.get(CONFIGMAP, "ns", "stranger") is not None
    # a dependent created after its owner went (a late writer) is collected too
    late = kube_client.create(_cm("late", ownerReferences=[ref]))
    assert late["metadata"]["uid"] and kube_client.get(CONFIGMAP, "ns", "late") is None


def test_watch_streams_added_modified_deleted(kube, kube_client) -> None:
    events: list[tuple[str, str]] = []
    got_three = threading.Event()
    http = urllib3.PoolManager()
    response = http.request(
        "GET", kube.url + CONFIGMAP.path() + "?watch=true", preload_content=False
    )

    def read() -> None:
        buffer = b""
        for chunk in response.stream(1024):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in filter(None, lines):
                event = json.loads(line)
                events.append((event["type"], event["object"]["metadata"]["resourceVersion"]))
                if len(events) >= 3:
                    got_three.set()
                    return

    threading.Thread(target=read, daemon=True).start()
    made = kube_client.create(_cm("w"))
    patched = kube_client.patch(CONFIGMAP, "ns", "w", {"data": {"a": "2"}})
    kube_client.delete(CONFIGMAP, "ns", "w")
    assert got_three.wait(5), events
    assert [e[0] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    assert events[0][1] == made["metadata"]["resourceVersion"]
    assert events[1][1] == patched["metadata"]["resourceVersion"]
    response.release_conn()


def test_faults_refuse_a_write_before_it_happens(kube, kube_client) -> None:
    import kmock

    kube.add_fault(
        lambda request: (
            kmock.KubernetesError(status=500, reason="InternalError", message="injected")
            if request.name == "x"
            or (
                isinstance(request.data, dict)
                and request.data.get("metadata", {}).get("name") == "x"
            )
            else None
        )
    )
    with pytest.raises(ApiError) as exc:
        kube_client.create(_cm("x"))
    assert exc.value.status == 500 and exc.value.transient
    assert kube_client.get(CONFIGMAP, "ns", "x") is None
    kube.clear_faults()
    kube_client.create(_cm("x"))


def test_discovery_declares_namespaces_and_the_crd(kube_client) -> None:
    core = kube_client.request("GET", "/api/v1")
    assert "namespaces" in {r["name"] for r in core["resources"]}
    group = kube_client.request("GET", "/apis/splitserve.io/v1alpha1")
    names = {r["name"] for r in group["resources"]}
    assert {"inferenceservices", "inferenceservices/status"} <= names
    with pytest.raises(NotFound):
        kube_client.request("GET", "/apis/splitserve.io/v1alpha1/namespaces/x/inferenceservices/y")


def test_request_log_records_every_request(kube, kube_client) -> None:
    kube_client.create(_cm("logged"))
    kube_client.get(CONFIGMAP, "ns", "logged")
    seen = kube.requests()
    assert [(s.method, s.path) for s in seen[-2:]] == [
        ("POST", "/api/v1/namespaces/ns/configmaps"),
        ("GET", "/api/v1/namespaces/ns/configmaps/logged"),
    ]


def test_merge_patch_is_rfc7386() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3},
        "l": [2],
    }
    assert merge_patch({"a": 1}, {"a": {"x": None}}) == {"a": {}}


def test_emulator_declares_resources_with_verbs() -> None:
    emulator = KubeEmulator()
    info = emulator.resources["apps/v1/deployments"]
    assert {"list", "watch", "patch"} <= info.verbs and "status" in info.subresources


# -- what a real API server does to what it stores -------------------------------------


def _deployment(name: str = "d", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "img:1",
                            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "1024Mi"}},
                        }
                    ]
                },
            },
        },
    }


def test_quantities_and_defaults_come_back_as_a_server_stores_them(kube_client) -> None:
    made = kube_client.create(_deployment())
    spec = made["spec"]
    assert spec["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1",
        "memory": "1Gi",
    }
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"},
    }
    assert (spec["progressDeadlineSeconds"], spec["revisionHistoryLimit"]) == (600, 10)
    (entry,) = made["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == ("splitserve-tests", "Update")
    with pytest.raises(Invalid):
        bad = _deployment("bad")
        bad["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "lots"
        kube_client.create(bad)


def test_apply_creates_changes_nothing_twice_and_conflicts_with_another_owner(
    kube, kube_client
) -> None:
    first = kube_client.apply(_deployment(), field_manager="op", force=False)
    assert first.created
    again = kube_client.apply(_deployment(), field_manager="op", force=False)
    assert not again.created
    assert again.obj["metadata"]["resourceVersion"] == first.obj["metadata"]["resourceVersion"]
    kube_client.request(
        "PATCH",
        DEPLOYMENT.path("ns", "d", "scale"),
        body={"spec": {"replicas": 4}},
        content_type="application/merge-patch+json",
    )
    with pytest.raises(ApiError) as exc:
        kube_client.apply(_deployment(), field_manager="op", force=False)
    assert exc.value.status == 409 and ".spec.replicas" in exc.value.message
    forced = kube_client.apply(_deployment(), field_manager="op", force=True)
    assert forced.obj["spec"]["replicas"] == 1
    with pytest.raises(Invalid, match="fieldManager"):
        kube_client.request(
            "PATCH",
            DEPLOYMENT.path("ns", "d"),
            body=_deployment(),
            content_type="application/apply-patch+yaml",
        )


def test_a_no_op_apply_changes_no_version(kube_client) -> None:
    def version() -> str:  # a list carries the store's latest resourceVersion
        listed = kube_client.request("GET", DEPLOYMENT.path("ns"))
        return str(listed["metadata"]["resourceVersion"])

    kube_client.apply(_deployment(), field_manager="op")
    before = version()
    kube_client.apply(_deployment(), field_manager="op")
    kube_client.patch(DEPLOYMENT, "ns", "d", {"spec": {"replicas": 1}})
    assert version() == before


def test_the_scale_subresource_reads_and_writes_replicas(kube_client) -> None:
    kube_client.create(_deployment())
    scale = kube_client.request("GET", DEPLOYMENT.path("ns", "d", "scale"))
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 1}
    assert scale["status"]["selector"] == "app=d"
    scale["spec"]["replicas"] = 3
    put = kube_client.request("PUT", DEPLOYMENT.path("ns", "d", "scale"), body=scale)
    assert put["spec"]["replicas"] == 3
    assert kube_client.get(DEPLOYMENT, "ns", "d")["spec"]["replicas"] == 3
    with pytest.raises(ApiError) as stale:
        kube_client.request("PUT", DEPLOYMENT.path("ns", "d", "scale"), body=scale)
    assert stale.value.status == 409  # the old resourceVersion


def test_lists_and_watches_filter_by_label_selector(kube, kube_client) -> None:
    kube_client.create(_deployment("ours", owner="us"))
    kube_client.create(_deployment("theirs"))
    listed = kube_client.list(DEPLOYMENT, "ns", label_selector="owner=us")
    assert [d["metadata"]["name"] for d in listed] == ["ours"]
    events: list[str] = []
    done = threading.Event()
    http = urllib3.PoolManager()
    response = http.request(
        "GET",
        kube.url + DEPLOYMENT.path() + "?watch=true&labelSelector=owner%3Dus",
        preload_content=False,
    )

    def read() -> None:
        buffer = b""
        for chunk in response.stream(1024):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in filter(None, lines):
                events.append(json.loads(line)["object"]["metadata"]["name"])
                if len(events) >= 2:
                    done.set()
                    return

    threading.Thread(target=read, daemon=True).start()
    kube_client.patch(DEPLOYMENT, "ns", "theirs", {"metadata": {"labels": {"x": "1"}}})
    kube_client.patch(DEPLOYMENT, "ns", "ours", {"metadata": {"labels": {"x": "1"}}})
    assert done.wait(5), events
    assert events == ["ours", "ours"]  # ADDED, then MODIFIED; theirs never
    response.release_conn()


def test_custom_resources_come_from_their_crds(kube_client) -> None:
    group = kube_client.request("GET", "/apis/splitserve.io/v1alpha1")
    names = {r["name"] for r in group["resources"]}
    assert {"workerpools", "workerpools/status", "workerpools/scale"} <= names


@pytest.fixture
def admitting_client() -> Any:
    """A client of an emulator that validates our custom resources as the API server does
    with the CRD installed (schema and CEL rules)."""
    from emulator_thread import EmulatorThread
    from splitserve_operator.control.k8s import KubeClient

    with EmulatorThread(KubeEmulator(admission=True)) as kube:
        client = KubeClient(kube.configuration(), timeout=10, user_agent="splitserve-tests")
        yield client
        client.close()


def test_admission_refuses_a_tensor_parallel_size_that_does_not_divide_gpus(
    admitting_client, inference_service
) -> None:
    client = admitting_client
    bad = inference_service("tp", prefill={"gpus": 4, "tensorParallelSize": 3})
    with pytest.raises(Invalid) as exc:
        client.create(bad)
    assert exc.value.status == 422
    assert "tensorParallelSize must divide gpus" in str(exc.value), exc.value
    assert client.get(INFERENCE_SERVICE, "default", "tp") is None
    made = client.create(inference_service("tp", prefill={"gpus": 4, "tensorParallelSize": 2}))
    assert made["spec"]["prefill"]["tensorParallelSize"] == 2
    # a patch, and a server-side apply, that would break the rule change nothing
    with pytest.raises(Invalid):
        client.patch(INFERENCE_SERVICE, "default", "tp", {"spec": {"prefill": {"gpus": 5}}})
    with pytest.raises(Invalid):
        client.apply(bad, field_manager="someone")
    assert client.get(INFERENCE_SERVICE, "default", "tp") == made
    # the status subresource is not held to the spec's rules
    status = client.patch_status("default", "tp", {"observedGeneration": 1})
    assert status["status"]["observedGeneration"] == 1


def test_admission_takes_a_decode_pool_of_several_ranks_over_every_kv_backend(
    admitting_client, inference_service
) -> None:
    """Each rank of a decode worker receives its own KV heads, over tcp, grpc or nixl:
    ``gpus: 2`` (two ranks by default) or an explicit ``tensorParallelSize: 2`` is taken
    with each, and a patch moves it from one backend to another."""
    client = admitting_client
    for i, decode in enumerate(({"gpus": 2}, {"gpus": 2, "tensorParallelSize": 2})):
        made = client.create(inference_service(f"dtp{i}", decode=decode,
                                               kvTransfer={"backend": "nixl"}))  # fmt: skip
        assert made["spec"]["decode"]["gpus"] == 2
        assert made["spec"]["kvTransfer"]["backend"] == "nixl"
        for backend in ("grpc", "tcp"):
            kv = {"spec": {"kvTransfer": {"backend": backend}}}
            taken = client.patch(INFERENCE_SERVICE, "default", f"dtp{i}", kv)
            assert taken["spec"]["kvTransfer"]["backend"] == backend
