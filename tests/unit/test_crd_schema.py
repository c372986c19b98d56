"""The CRDs: one source, their shape, and a schema that rejects what it can (checked with
jsonschema for types and ranges and with a CEL interpreter for the cross-field rules).
The InferenceService's is tested field by field; the rules every CRD must keep (one
source copied into the chart, structural, every field described) hold for the
WorkerPool's too."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import load_crd, problems, schema_of
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.values import Pool

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART_COPY = ROOT / "charts" / "splitserve" / "crds" / "inferenceservices.splitserve.io.yaml"
CRDS = sorted((ROOT / "crds").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "charts" / "splitserve" / "examples").glob("*.yaml"))


def resource(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": "m"}, "image": "img:1"}
    body.update(spec)
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": body,
    }


def test_the_chart_carries_an_identical_copy() -> None:
    assert [p.name for p in CRDS] == [
        "inferenceservices.splitserve.io.yaml",
        "workerpools.splitserve.io.yaml",
    ]
    for path in CRDS:
        assert (CHART_COPY.parent / path.name).read_bytes() == path.read_bytes(), (
            f"charts/splitserve/crds/{path.name} must be a copy of crds/{path.name}: "
            "cp crds/*.yaml charts/splitserve/crds/"
        )
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(
        p.name for p in CHART_COPY.parent.glob("*.yaml")
    )


def test_names_scope_and_version() -> None:
    crd = load_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferenceservices.splitserve.io"
    assert spec["group"] == "splitserve.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceService"
    assert spec["names"]["plural"] == "inferenceservices"
    assert spec["names"]["shortNames"] == ["sisvc"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    (version,) = load_crd()["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Prefill-Ready"] == ".status.pools.prefill.readyReplicas"
    assert columns["Prefill-Desired"] == ".status.pools.prefill.desiredReplicas"
    assert columns["Decode-Ready"] == ".status.pools.decode.readyReplicas"
    assert columns["Decode-Desired"] == ".status.pools.decode.desiredReplicas"
    assert columns["Age"] == ".metadata.creationTimestamp"


def _structural(schema: dict[str, Any], path: str = "") -> list[str]:
    """Every node has a type (or is int-or-string / preserve-unknown-fields)."""
    out = []
    if (
        "type" not in schema
        and not schema.get("x-kubernetes-int-or-string")
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out.append(path or "<root>")
    for name, sub in (schema.get("properties") or {}).items():
        out += _structural(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _structural(schema["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.name)
def test_the_schema_is_structural(path: Path) -> None:
    schema = schema_of(load_crd(path))
    assert _structural(schema) == []
    # the API server refuses anything at the root's metadata but its type (a description
    # included: "must not specify anything other than name and generateName")
    assert schema["properties"]["metadata"] == {"type": "object"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted_by_the_schema_and_the_operator(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert problems(doc) == []
    parse_spec(doc["spec"], name=doc["metadata"]["name"])


def test_a_minimal_resource_is_accepted_and_defaulted() -> None:
    assert problems(resource()) == []


@pytest.mark.parametrize(
    "pool",
    [{"gpus": 4, "tensorParallelSize": 2}, {"gpus": 4, "tensorParallelSize": 4},
     {"gpus": 8}, {"gpus": 0, "tensorParallelSize": 2}, {"gpus": 2, "tensorParallelSize": 1}],
)  # fmt: skip
def test_tensor_parallelism_that_divides_gpus_is_accepted(pool: dict[str, Any]) -> None:
    doc = resource(prefill=pool)
    assert problems(doc) == []
    spec = parse_spec(doc["spec"], name="demo")
    assert spec.prefill.tensor_parallel == pool.get("tensorParallelSize", pool["gpus"])


def test_the_operator_says_which_tensor_parallel_sizes_fit() -> None:
    raw = resource(decode={"gpus": 6, "tensorParallelSize": 4})["spec"]
    with pytest.raises(SpecError) as caught:
        parse_spec(raw, name="demo")
    (problem,) = caught.value.problems
    assert problem.startswith("spec.decode"), problem
    assert "tensorParallelSize 4 does not divide gpus 6: set it to one of 1, 2, 3, 6" in problem


@pytest.mark.parametrize(
    "decode",
    [{"gpus": 2}, {"gpus": 4, "tensorParallelSize": 2}, {"gpus": 0, "tensorParallelSize": 2}],
)
@pytest.mark.parametrize("kv", [{}, {"kvTransfer": {"backend": "grpc"}},
                                {"kvTransfer": {"backend": "nixl"}}])  # fmt: skip
def test_a_decode_pool_of_several_ranks_takes_every_kv_backend(
    decode: dict[str, Any], kv: dict[str, Any]
) -> None:
    """Each rank of a decode worker receives its own KV heads, over tcp (the default),
    grpc and nixl alike: the CRD's rules and the operator's spec check take such a pool
    with each."""
    doc = resource(decode=decode, **kv)
    assert problems(doc) == []
    assert parse_spec(doc["spec"], name="demo").decode.tensor_parallel == 2


@pytest.mark.parametrize(
    "decode", [{"gpus": 4, "tensorParallelSize": 1}, {"gpus": 0}, {"gpus": 1}, {}]
)
def test_a_decode_pool_of_one_rank_is_accepted(decode: dict[str, Any]) -> None:
    doc = resource(decode=decode)
    assert problems(doc) == []
    assert parse_spec(doc["spec"], name="demo").decode.tensor_parallel == 1


REJECTED: list[tuple[str, dict[str, Any], str]] = [
    ("missing model", {"model": None}, "model"),
    ("missing image", {"image": None}, "image"),
    ("empty model name", {"model": {"name": ""}}, "spec.model.name"),
    ("unknown dtype", {"model": {"name": "m", "dtype": "int4"}}, "spec.model.dtype"),
    ("image with spaces", {"image": "a b"}, "spec.image"),
    (
        "claim not a DNS label",
        {"model": {"name": "m", "source": "pvc://My_Claim/x"}},
        "pvc://CLAIM/PATH",
    ),
    ("negative replicas", {"decode": {"replicas": -1}}, "spec.decode.replicas"),
    ("replicas as text", {"decode": {"replicas": "2"}}, "spec.decode.replicas"),
    ("too many replicas", {"prefill": {"replicas": 5000}}, "spec.prefill.replicas"),
    ("fractional gpus", {"prefill": {"gpus": 1.5}}, "spec.prefill.gpus"),
    (
        "tensor parallelism that does not divide gpus",
        {"prefill": {"gpus": 4, "tensorParallelSize": 3}},
        "tensorParallelSize must divide gpus",
    ),
    (
        "tensor parallelism above the default gpus",
        {"decode": {"tensorParallelSize": 2}},
        "tensorParallelSize must divide gpus",
    ),
    ("zero tensor parallelism", {"decode": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ("bad quantity", {"prefill": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    (
        "gpu in resources",
        {"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
        "set accelerators with gpus",
    ),
    ("bad toleration operator", {"decode": {"tolerations": [{"operator": "Maybe"}]}}, "operator"),
    (
        "exists with value",
        {"decode": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        "must not set value",
    ),
    ("duplicate env", {"router": {"env": [{"name": "A"}, {"name": "A"}]}}, "duplicate entry"),
    (
        "env value and valueFrom",
        {"router": {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}},
        "not both",
    ),
    ("unknown backend", {"kvTransfer": {"backend": "rdma"}}, "spec.kvTransfer.backend"),
    ("zero lease", {"kvTransfer": {"leaseSeconds": 0}}, "spec.kvTransfer.leaseSeconds"),
    ("nine streams", {"kvTransfer": {"streams": 9}}, "spec.kvTransfer.streams"),
    ("zero ttft", {"slo": {"ttftSeconds": 0}}, "spec.slo.ttftSeconds"),
    ("percentile of 100", {"slo": {"percentile": 100}}, "whole percent"),
    ("percentile not whole", {"slo": {"percentile": 90.5}}, "whole percent"),
    ("percentile zero", {"slo": {"percentile": 0}}, "whole percent"),
    (
        "autoscaling without prometheus",
        {"autoscaling": {"enabled": True}, "slo": {"ttft": "1s", "tpot": "1s"}},
        "prometheusUrl is required",
    ),
    (
        "autoscaling without targets",
        {"autoscaling": {"enabled": True, "prometheusUrl": "http://p:9090"}},
        "needs its targets",
    ),
    (
        "min above max",
        {"autoscaling": {"decode": {"minReplicas": 4, "maxReplicas": 2}}},
        "minReplicas must not exceed maxReplicas",
    ),
    (
        "interval too short",
        {"autoscaling": {"intervalSeconds": 1}},
        "spec.autoscaling.intervalSeconds",
    ),
    (
        "decode scaled to zero",
        {
            "autoscaling": {
                "enabled": True,
                "prometheusUrl": "http://p",
                "decode": {"minReplicas": 0},
            },
            "slo": {"ttft": "1s", "tpot": "1s"},
        },
        "decode.minReplicas must be at least 1",
    ),
    (
        "bad prometheus url",
        {"autoscaling": {"prometheusUrl": "prometheus:9090"}},
        "spec.autoscaling.prometheusUrl",
    ),
    ("bad service type", {"router": {"serviceType": "Ingress"}}, "spec.router.serviceType"),
    (
        "bad disaggregation",
        {"router": {"settings": {"disaggregation": "sometimes"}}},
        "spec.router.settings.disaggregation",
    ),
    (
        "too many retries",
        {"router": {"settings": {"maxRetries": 11}}},
        "spec.router.settings.maxRetries",
    ),
    (
        "tiny request cap",
        {"router": {"settings": {"maxRequestBytes": 10}}},
        "spec.router.settings.maxRequestBytes",
    ),
    (
        "batch below its sequences",
        {"decode": {"engine": {"maxNumSeqs": 128, "maxBatchTokens": 64}}},
        "maxBatchTokens must be at least maxNumSeqs",
    ),
    (
        "batch below the default sequences",
        {"prefill": {"engine": {"maxBatchTokens": 32}}},
        "maxBatchTokens must be at least maxNumSeqs",
    ),
    ("kv cache as words", {"decode": {"engine": {"kvCacheMemory": "lots"}}}, "kvCacheMemory"),
    (
        "gpu share above one",
        {"decode": {"engine": {"gpuMemoryFraction": 1.5}}},
        "spec.decode.engine.gpuMemoryFraction",
    ),
    (
        "priority class with capitals",
        {"decode": {"priorityClassName": "High"}},
        "spec.decode.priorityClassName",
    ),
    ("annotation not text", {"router": {"podAnnotations": {"a": 1}}}, "spec.router.podAnnotations"),
    (
        "no queue wait",
        {"router": {"settings": {"queues": {"maxWaitSeconds": 0}}}},
        "spec.router.settings.queues.maxWaitSeconds",
    ),
    (
        "fractional queue depth",
        {"router": {"settings": {"queues": {"decodeMaxWaiting": 2.5}}}},
        "spec.router.settings.queues.decodeMaxWaiting",
    ),
    (
        "negative timeout",
        {"router": {"settings": {"timeouts": {"interTokenSeconds": -1}}}},
        "spec.router.settings.timeouts.interTokenSeconds",
    ),
    # durations: strings of Go's syntax, within bounds; an old and a new form never both
    ("ttft as a number", {"slo": {"ttft": 0.5}}, "spec.slo.ttft"),
    ("duration without a unit", {"slo": {"ttft": "500"}}, "spec.slo.ttft"),
    ("ttft too long", {"slo": {"ttft": "11m"}}, "ttft must be above 0 and at most 10m"),
    ("zero tpot", {"slo": {"tpot": "0s"}}, "tpot must be above 0"),
    ("both ttft forms", {"slo": {"ttft": "1s", "ttftSeconds": 1}}, "not both"),
    ("lease below a second", {"kvTransfer": {"lease": "500ms"}}, "lease must be between"),
    ("both lease forms", {"kvTransfer": {"lease": "10s", "leaseSeconds": 10}}, "not both"),
    ("interval too short", {"autoscaling": {"interval": "1s"}}, "interval must be between"),
    (
        "retryAfter not whole seconds",
        {"router": {"settings": {"queues": {"retryAfter": "1500ms"}}}},
        "spec.router.settings.queues.retryAfter",
    ),
    (
        "negative timeout duration",
        {"router": {"settings": {"timeouts": {"interToken": "-1s"}}}},
        "spec.router.settings.timeouts.interToken",
    ),
    (
        "timeout in two forms",
        {"router": {"settings": {"timeouts": {"request": "1m", "requestSeconds": 60}}}},
        "not both",
    ),
    (
        "zero queue wait",
        {"router": {"settings": {"queues": {"maxWait": "0s"}}}},
        "maxWait must be above 0",
    ),
    ("gpu percent zero", {"decode": {"engine": {"gpuMemoryPercent": 0}}}, "gpuMemoryPercent"),
    ("gpu percent over", {"decode": {"engine": {"gpuMemoryPercent": 101}}}, "gpuMemoryPercent"),
    (
        "gpu share in two forms",
        {"decode": {"engine": {"gpuMemoryPercent": 50, "gpuMemoryFraction": 0.5}}},
        "not both",
    ),
    # accelerators and RDMA
    (
        "accelerator without a domain",
        {"prefill": {"acceleratorResource": "gpu"}},
        "acceleratorResource",
    ),
    (
        "amd gpu in resources",
        {
            "decode": {
                "acceleratorResource": "amd.com/gpu",
                "resources": {"limits": {"amd.com/gpu": 1}},
            }
        },
        "set accelerators with gpus",
    ),
    ("rdma without its resource", {"decode": {"rdma": {"count": 1}}}, "resource"),
    ("rdma of no devices", {"decode": {"rdma": {"resource": "rdma/hca", "count": 0}}}, "count"),
    # the pod template overlay
    (
        "an operator label",
        {"prefill": {"podTemplate": {"labels": {"app.kubernetes.io/instance": "x"}}}},
        "operator's own",
    ),
    (
        "a label under splitserve.io",
        {"decode": {"podTemplate": {"labels": {"splitserve.io/role": "prefill"}}}},
        "operator's own",
    ),
    (
        "an annotation under splitserve.io",
        {"router": {"podTemplate": {"annotations": {"splitserve.io/config-hash": "x"}}}},
        "splitserve.io/ are the operator's",
    ),
    (
        "annotations in two places",
        {"decode": {"podAnnotations": {"a": "1"}, "podTemplate": {"annotations": {"b": "2"}}}},
        "not both",
    ),
    (
        "a hostPath volume",
        {"prefill": {"podTemplate": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}},
        "exactly one of",
    ),
    (
        "a volume of two sources",
        {"prefill": {"podTemplate": {"volumes": [{"name": "v", "emptyDir": {}, "secret": {}}]}}},
        "exactly one of",
    ),
    (
        "the operator's volume name",
        {"decode": {"podTemplate": {"volumes": [{"name": "cache", "emptyDir": {}}]}}},
        "operator's volume names",
    ),
    (
        "a mount over the operator's",
        {
            "decode": {
                "podTemplate": {
                    "volumes": [{"name": "v", "emptyDir": {}}],
                    "volumeMounts": [{"name": "v", "mountPath": "/tmp"}],
                }
            }
        },
        "mount elsewhere",
    ),
    (
        "a mount of no volume",
        {"decode": {"podTemplate": {"volumeMounts": [{"name": "v", "mountPath": "/data"}]}}},
        "must name a volume",
    ),
    (
        "a router service account",
        {"router": {"podTemplate": {"serviceAccountName": "reader"}}},
        "prefill and decode pools only",
    ),
    (
        "a scheduler with capitals",
        {"prefill": {"podTemplate": {"schedulerName": "Volcano"}}},
        "schedulerName",
    ),
    (
        "a claim of both sources",
        {
            "decode": {
                "podTemplate": {
                    "resourceClaims": [
                        {"name": "g", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}
                    ]
                }
            }
        },
        "one of them",
    ),
    (
        "a spread without its rule",
        {
            "decode": {
                "podTemplate": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "z"}]}
            }
        },
        "whenUnsatisfiable",
    ),
    # rollouts
    (
        "a rollout that cannot move",
        {"prefill": {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}},
        "cannot both be 0",
    ),
    (
        "a gpu rollout that cannot move",
        {"decode": {"rollout": {"maxUnavailable": 0}}},
        "maxSurge defaults to 0",
    ),
    ("a surge over 100%", {"prefill": {"rollout": {"maxSurge": "150%"}}}, "percent"),
    ("a negative surge", {"prefill": {"rollout": {"maxSurge": -1}}}, "number of pods"),
    (
        "a progress deadline under a minute",
        {"prefill": {"rollout": {"progressDeadline": "30s"}}},
        "progressDeadline must be between",
    ),
    # models
    (
        "a cache and a size limit",
        {"model": {"name": "m", "cache": {"claimName": "c"}, "downloadSizeLimit": "10Gi"}},
        "set one of them",
    ),
    (
        "a cache for a claim's folder",
        {"model": {"name": "m", "source": "pvc://w/m", "cache": {"claimName": "c"}}},
        "drop cache",
    ),
    (
        "a cache claim with capitals",
        {"model": {"name": "m", "cache": {"claimName": "C"}}},
        "claimName",
    ),
    (
        "a size limit in words",
        {"model": {"name": "m", "downloadSizeLimit": "big"}},
        "downloadSizeLimit",
    ),
    # pods' IDs
    ("running as root", {"podSecurityContext": {"runAsUser": 0}}, "runAsUser"),
    # the HTTPRoute
    ("a route to no gateway", {"router": {"httpRoute": {"parentRefs": []}}}, "parentRefs"),
    (
        "a route to a bad host",
        {"router": {"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["Bad_Host"]}}},
        "hostnames",
    ),
    (
        "a route timeout Gateway API cannot read",
        {"router": {"httpRoute": {"parentRefs": [{"name": "gw"}], "requestTimeout": "1.5s"}}},
        "requestTimeout",
    ),
]


@pytest.mark.parametrize(
    ("spec", "fragment"), [(s, f) for _, s, f in REJECTED], ids=[name for name, _, _ in REJECTED]
)
def test_the_schema_rejects(spec: dict[str, Any], fragment: str) -> None:
    doc = resource(**spec)
    for key in [k for k, v in doc["spec"].items() if v is None]:
        del doc["spec"][key]
    found = problems(doc)
    assert any(fragment in p for p in found), found


@pytest.mark.parametrize(
    ("spec", "fragment"), [(s, f) for _, s, f in REJECTED], ids=[name for name, _, _ in REJECTED]
)
def test_the_operator_rejects_what_the_schema_rejects(spec: dict[str, Any], fragment: str) -> None:
    raw = resource(**spec)["spec"]
    for key in [k for k, v in raw.items() if v is None]:
        del raw[key]
    with pytest.raises(SpecError):
        parse_spec(raw, name="demo")


@pytest.mark.parametrize("name", ["Demo", "a.b", "9x", "x" * 49, "trailing-"])
def test_names_that_cannot_name_services_are_rejected(name: str) -> None:
    doc = resource()
    doc["metadata"]["name"] = name
    assert any("metadata.name" in p for p in problems(doc))


def test_status_schema_carries_what_the_operator_writes() -> None:
    status = schema_of(load_crd())["properties"]["status"]["properties"]
    pool = status["pools"]["properties"]["decode"]["properties"]
    assert {"replicas", "readyReplicas", "updatedReplicas", "desiredReplicas"} <= set(pool)
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert status["autoscaling"]["x-kubernetes-preserve-unknown-fields"] is True
    crd_status = copy.deepcopy(resource())
    crd_status["status"] = {
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllPoolsReady",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": 1,
            }
        ],
        "pools": {
            "decode": {
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "desiredReplicas": 1,
            }
        },
    }
    assert problems(crd_status) == []


def _undescribed(schema: dict[str, Any], path: str) -> list[str]:
    """Every node under ``path`` that ``kubectl explain`` would show without a description:
    properties, list items and map values alike (but the root's metadata, which the API
    server describes as ObjectMeta and lets no schema describe)."""
    if path == "<root>.metadata":
        return []
    out = [] if str(schema.get("description") or "").strip() else [path]
    for name, sub in (schema.get("properties") or {}).items():
        out += _undescribed(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _undescribed(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _undescribed(schema["additionalProperties"], f"{path}{{}}")
    return out


def _strip_descriptions(schema: Any) -> Any:
    if isinstance(schema, dict):
        schema.pop("description", None)
        for value in schema.values():
            _strip_descriptions(value)
    elif isinstance(schema, list):
        for value in schema:
            _strip_descriptions(value)
    return schema


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.name)
def test_every_crd_field_has_a_description(path: Path) -> None:
    missing = _undescribed(schema_of(load_crd(path)), "<root>")
    assert missing == [], f"{len(missing)} schema nodes without a description: {missing}"


def test_every_field_has_a_description() -> None:
    schema = schema_of(load_crd())
    # the walk reaches every node (one that stopped early would find nothing), and
    # finds one without a description
    described = _undescribed(_strip_descriptions(copy.deepcopy(schema)), "<root>")
    assert len(described) > 300 and "<root>.spec.decode.podTemplate.volumes[].csi" in described
    assert _undescribed({"properties": {"x": {"type": "string"}}, "description": "d"}, "r") == [
        "r.x"
    ]


DEPRECATED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("ttftSeconds", {"slo": {"ttftSeconds": 0.5}}, {"slo": {"ttft": "500ms"}}),
    ("tpotSeconds", {"slo": {"tpotSeconds": 0.05}}, {"slo": {"tpot": "50ms"}}),
    ("percentile fraction", {"slo": {"percentile": 0.95}}, {"slo": {"percentile": 95}}),
    ("leaseSeconds", {"kvTransfer": {"leaseSeconds": 45}}, {"kvTransfer": {"lease": "45s"}}),
    (
        "intervalSeconds",
        {"autoscaling": {"intervalSeconds": 60}},
        {"autoscaling": {"interval": "60s"}},
    ),
    (
        "gpuMemoryFraction",
        {"decode": {"engine": {"gpuMemoryFraction": 0.85}}},
        {"decode": {"engine": {"gpuMemoryPercent": 85}}},
    ),
    (
        "maxWaitSeconds",
        {"router": {"settings": {"queues": {"maxWaitSeconds": 2.5}}}},
        {"router": {"settings": {"queues": {"maxWait": "2500ms"}}}},
    ),
    (
        "retryAfterSeconds",
        {"router": {"settings": {"queues": {"retryAfterSeconds": 4}}}},
        {"router": {"settings": {"queues": {"retryAfter": "4s"}}}},
    ),
    *[
        (
            f"{name}Seconds",
            {"router": {"settings": {"timeouts": {f"{name}Seconds": 1.5}}}},
            {"router": {"settings": {"timeouts": {name: "1500ms"}}}},
        )
        for name in ("connect", "prefill", "firstToken", "interToken", "request", "healthInterval")
    ],
    (
        "podAnnotations",
        {"prefill": {"podAnnotations": {"a": "1"}}},
        {"prefill": {"podTemplate": {"annotations": {"a": "1"}}}},
    ),
]


@pytest.mark.parametrize(
    ("old", "new"), [(o, n) for _, o, n in DEPRECATED], ids=[i for i, _, _ in DEPRECATED]
)
def test_deprecated_forms_are_accepted_read_as_the_new_ones_and_warned_of(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    from splitserve_operator.api.deprecations import deprecations

    assert problems(resource(**old)) == []
    assert problems(resource(**new)) == []
    old_spec, new_spec = resource(**old)["spec"], resource(**new)["spec"]
    assert parse_spec(old_spec, name="demo") == parse_spec(new_spec, name="demo")
    (warning,) = deprecations(old_spec)
    assert "deprecated" in warning and deprecations(new_spec) == []


def test_a_rounded_fraction_says_how_it_was_read() -> None:
    from splitserve_operator.api.deprecations import deprecations

    (warning,) = deprecations({"slo": {"percentile": 0.999}})
    assert "0.999 is read as 99" in warning
    assert (
        parse_spec(
            {"model": {"name": "m"}, "image": "i", "slo": {"percentile": 0.999}}
        ).slo.percentile
        == 99
    )


def test_examples_use_no_deprecated_field() -> None:
    from splitserve_operator.api.deprecations import deprecations

    for path in EXAMPLES:
        assert deprecations(yaml.safe_load(path.read_text())["spec"]) == [], path.name


def test_the_url_is_a_printer_column() -> None:
    (version,) = load_crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["URL"]["jsonPath"] == ".status.url" and "priority" not in columns["URL"]


def test_conditions_need_reason_message_time_and_generation() -> None:
    """As metav1.Condition asks, with observedGeneration as well: what every writer (the
    reconciler, the planner) sets, so that a reader never meets a half condition."""
    from datetime import UTC, datetime

    from splitserve_operator.api.status import PoolObservation, compute_status

    item = schema_of(load_crd())["properties"]["status"]["properties"]["conditions"]["items"]
    assert set(item["required"]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    status = compute_status(
        generation=3,
        pools={pool: PoolObservation(replicas=1, ready=1) for pool in Pool},
        desired={},
        problems=[],
        previous=None,
        now=datetime(2026, 1, 1, tzinfo=UTC),
        url="http://demo-router.ns.svc:8000",
        warnings=["spec.slo.ttftSeconds is deprecated"],
    )
    doc = resource()
    doc["status"] = status
    assert problems(doc) == []
    for field in item["required"]:
        half = copy.deepcopy(doc)
        del half["status"]["conditions"][0][field]
        assert any(field in p for p in problems(half)), field
