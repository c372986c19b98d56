"""The CRD: one source, its shape, and a schema that rejects what it can (checked with
jsonschema for types and ranges and with a CEL interpreter for the cross-field rules)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import CRD_PATH, load_crd, problems, schema_of
from splitserve_operator.api.parse import SpecError, parse_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART_COPY = ROOT / "charts" / "splitserve" / "crds" / "inferenceservices.splitserve.io.yaml"
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
    assert CHART_COPY.read_bytes() == CRD_PATH.read_bytes(), (
        "charts/splitserve/crds/ must be a copy of crds/: cp crds/*.yaml charts/splitserve/crds/"
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


def test_the_schema_is_structural() -> None:
    assert _structural(schema_of(load_crd())) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted_by_the_schema_and_the_operator(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert problems(doc) == []
    parse_spec(doc["spec"], name=doc["metadata"]["name"])


def test_a_minimal_resource_is_accepted_and_defaulted() -> None:
    assert problems(resource()) == []


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
    ("bad quantity", {"prefill": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    (
        "gpu in resources",
        {"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
        "set GPUs with gpus",
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
    ("percentile as percent", {"slo": {"percentile": 90}}, "spec.slo.percentile"),
    (
        "autoscaling without prometheus",
        {"autoscaling": {"enabled": True}, "slo": {"ttftSeconds": 1, "tpotSeconds": 1}},
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
            "slo": {"ttftSeconds": 1, "tpotSeconds": 1},
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
