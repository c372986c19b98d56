"""Typed spec parsing: defaults, camelCase fields, and errors that say what to fix."""

from __future__ import annotations

from typing import Any

import pytest
from splitserve_operator.api.parse import SpecError, check_name, parse_spec
from splitserve_operator.api.values import Dtype, KvBackend, Pool, ServiceType

pytestmark = pytest.mark.unit

MINIMAL: dict[str, Any] = {"model": {"name": "m"}, "image": "img:1"}


def problems(raw: Any, name: str = "demo") -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec(raw, name=name)
    return exc.value.problems


def test_defaults_match_the_crd() -> None:
    spec = parse_spec(MINIMAL, name="demo")
    assert spec.model.dtype == Dtype.AUTO and spec.model.weights == "m"
    assert (spec.prefill.replicas, spec.prefill.gpus) == (1, 1)
    assert (spec.decode.replicas, spec.decode.gpus) == (1, 1)
    assert (spec.router.replicas, spec.router.gpus) == (1, 0)
    assert spec.router.service_type == ServiceType.CLUSTER_IP
    assert spec.kv_transfer.backend == KvBackend.TCP and spec.kv_transfer.lease == 30
    assert spec.slo.percentile == 90 and spec.slo.quantile == 0.9 and spec.slo.ttft is None
    assert not spec.autoscaling.enabled and spec.autoscaling.interval == 30
    assert spec.prefill.accelerator_resource == "nvidia.com/gpu" and spec.prefill.rollout is None
    assert spec.model.cache is None and spec.pod_security_context is None
    assert spec.router.http_route is None
    assert (spec.autoscaling.prefill.min_replicas, spec.autoscaling.prefill.max_replicas) == (1, 8)
    assert spec.network_policy.enabled and spec.network_policy.metrics_from is None


def test_every_field_parses_from_camel_case() -> None:
    raw = {
        "model": {"name": "m", "source": "org/m", "dtype": "bfloat16"},
        "image": "img:1",
        "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "regcred"}],
        "prefill": {
            "replicas": 2,
            "gpus": 4,
            "resources": {"requests": {"cpu": "500m"}},
            "nodeSelector": {"a": "b"},
            "tolerations": [{"operator": "Exists"}],
            "affinity": {"nodeAffinity": {"x": 1}},
            "env": [{"name": "A", "value": "1"}],
        },
        "router": {"serviceType": "LoadBalancer"},
        "kvTransfer": {"backend": "nixl", "lease": "10s"},
        "slo": {"ttft": "500ms", "tpot": "50ms", "percentile": 99},
        "autoscaling": {
            "enabled": True,
            "prometheusUrl": "http://p:9090",
            "interval": "15s",
            "prefill": {"minReplicas": 0, "maxReplicas": 4},
        },
        "networkPolicy": {"enabled": False, "metricsFrom": []},
    }
    spec = parse_spec(raw, name="demo")
    assert spec.model.weights == "org/m"
    assert spec.image_pull_secrets == [{"name": "regcred"}]
    assert spec.prefill.gpus == 4 and spec.prefill.node_selector == {"a": "b"}
    assert spec.prefill.affinity is not None and spec.prefill.affinity.node_affinity == {"x": 1}
    assert spec.router.service_type == ServiceType.LOAD_BALANCER
    assert spec.kv_transfer.backend == KvBackend.NIXL
    assert spec.slo.tpot == 0.05 and spec.slo.quantile == 0.99
    assert spec.kv_transfer.lease == 10 and spec.autoscaling.interval == 15
    assert spec.autoscaling.bounds(Pool.PREFILL).clamp(9) == 4
    assert spec.network_policy.metrics_from == []
    assert spec.pool(Pool.ROUTER) is spec.router


def test_numbers_and_booleans_are_strict_as_in_the_schema() -> None:
    found = problems(
        {**MINIMAL, "prefill": {"replicas": "2", "gpus": 1.0}, "autoscaling": {"enabled": "yes"}}
    )
    assert any(
        p.startswith("spec.prefill.replicas: Input should be a valid integer") for p in found
    )
    assert any(p.startswith("spec.prefill.gpus") for p in found)
    assert any(p.startswith("spec.autoscaling.enabled") for p in found)
    assert parse_spec({**MINIMAL, "slo": {"ttftSeconds": 1}}).slo.ttft == 1.0
    # a duration is a string with its unit; a bare number's unit would be a guess
    assert any(
        p.startswith("spec.slo.ttft: must be a duration string")
        for p in problems({**MINIMAL, "slo": {"ttft": 1}})
    )


def test_every_problem_is_listed_with_its_path_and_value() -> None:
    found = problems(
        {**MINIMAL, "decode": {"replicas": -1}, "kvTransfer": {"backend": "x"}, "extra": 1},
        name="Bad_Name",
    )
    assert "spec.decode.replicas: Input should be greater than or equal to 0 (got -1)" in found
    assert any(
        p.startswith("spec.kvTransfer.backend: Input should be 'tcp', 'grpc' or 'nixl'")
        for p in found
    )
    assert "spec.extra: Extra inputs are not permitted (got 1)" in found
    assert any(p.startswith("metadata.name") for p in found)
    assert str(SpecError(found)) == "; ".join(found)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (None, "spec: must be an object (got NoneType)"),
        ([], "spec: must be an object (got list)"),
        ({"image": "x"}, "spec.model: Field required"),
        ({**MINIMAL, "image": "two words"}, "spec.image"),
        ({**MINIMAL, "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "gpus field"),
        (
            {
                **MINIMAL,
                "decode": {
                    "acceleratorResource": "amd.com/gpu",
                    "resources": {"requests": {"amd.com/gpu": 2}},
                },
            },
            "resources.requests['amd.com/gpu']",
        ),
        ({**MINIMAL, "decode": {"resources": {"limits": {"memory": "4 GB"}}}}, "not a quantity"),
        ({**MINIMAL, "decode": {"resources": {"limits": {"cpu": -1}}}}, "must not be negative"),
        ({**MINIMAL, "decode": {"env": [{"name": "1A"}]}}, "not a valid environment variable"),
        ({**MINIMAL, "decode": {"env": [{"name": "A"}, {"name": "A"}]}}, "listed twice"),
        ({**MINIMAL, "decode": {"tolerations": [{"value": "v"}]}}, "operator Exists"),
        ({**MINIMAL, "decode": {"nodeSelector": {"bad key!": "v"}}}, "not a valid label key"),
        ({**MINIMAL, "decode": {"nodeSelector": {"k": "bad value!"}}}, "not a valid label value"),
        ({**MINIMAL, "imagePullSecrets": [{"secret": "x"}]}, "{name: SECRET}"),
        (
            {**MINIMAL, "autoscaling": {"enabled": True, "prometheusUrl": "ftp://x"}},
            "is not an http(s) URL",
        ),
        (
            {
                **MINIMAL,
                "autoscaling": {
                    "enabled": True,
                    "prometheusUrl": "http://p",
                    "decode": {"minReplicas": 0},
                },
                "slo": {"ttft": "1s", "tpot": "1s"},
            },
            "decode.minReplicas must be at least 1",
        ),
        ({**MINIMAL, "slo": {"percentile": 100}}, "spec.slo.percentile"),
        ({**MINIMAL, "slo": {"percentile": 1.5}}, "spec.slo.percentile"),
        (
            {**MINIMAL, "slo": {"ttftSeconds": -1}},
            "spec.slo.ttftSeconds: Input should be greater than 0",
        ),
        (
            {**MINIMAL, "slo": {"ttft": "1s", "ttftSeconds": 1}},
            "spec.slo: set ttft or the deprecated",
        ),
        ({**MINIMAL, "slo": {"ttft": "1 s"}}, "is not a duration such as 500ms"),
        ({**MINIMAL, "kvTransfer": {"lease": "2h"}}, "at least 1s and at most 3600s"),
        ({**MINIMAL, "model": {"name": "m", "source": "pvc://w/../etc"}}, "(no '..')"),
        ({**MINIMAL, "model": {"name": "m", "source": "pvc://"}}, "pvc://CLAIM/PATH"),
        (
            {**MINIMAL, "decode": {"podAnnotations": {"splitserve.io/config-hash": "x"}}},
            "are the operator's",
        ),
        ({**MINIMAL, "decode": {"podAnnotations": {"bad key!": "x"}}}, "not a valid annotation"),
    ],
)
def test_invalid_specs_say_what_to_fix(raw: Any, fragment: str) -> None:
    assert any(fragment in p for p in problems(raw)), problems(raw)


def test_names_must_fit_in_service_names() -> None:
    assert check_name("demo") == []
    assert check_name("a" * 48) == []
    assert "at most 48 characters" in check_name("a" * 49)[0]
    assert check_name("9lives") and check_name("has.dot") and check_name("trailing-")
    assert check_name(None) == ["metadata.name: missing"]


def test_engine_settings_defaults_and_sizes() -> None:
    """A pool's ``engine`` is checked against the worker's own defaults, as the CRD's rule
    is; the KV size is a quantity, at least 1Mi."""
    from crd_validation import load_crd, schema_of
    from splitserve_operator.api.values import (
        ENGINE_MAX_BATCH_TOKENS,
        ENGINE_MAX_NUM_SEQS,
        quantity_bytes,
    )
    from splitserve_worker.engine.config import EngineConfig
    from splitserve_worker.server.config import WorkerConfig

    for cfg in (EngineConfig(), WorkerConfig(role="decode", model="m", token="t")):
        assert (cfg.max_num_seqs, cfg.max_batch_tokens) == (
            ENGINE_MAX_NUM_SEQS,
            ENGINE_MAX_BATCH_TOKENS,
        )
    pools = schema_of(load_crd())["properties"]["spec"]["properties"]
    rule, *_ = pools["decode"]["properties"]["engine"]["x-kubernetes-validations"]
    assert f": {ENGINE_MAX_BATCH_TOKENS})" in rule["rule"]
    assert f": {ENGINE_MAX_NUM_SEQS})" in rule["rule"]

    spec = parse_spec({**MINIMAL, "decode": {"engine": {"maxNumSeqs": 2048}}}, name="demo")
    assert spec.decode.engine is not None and spec.decode.engine.max_num_seqs == 2048
    assert spec.prefill.engine is None
    assert any(
        "maxBatchTokens (2048) must be at least maxNumSeqs (4096)" in p
        for p in problems({**MINIMAL, "decode": {"engine": {"maxNumSeqs": 4096}}})
    )
    assert any(
        "spec.prefill.engine.kvCacheMemory" in p and "at least 1Mi" in p
        for p in problems({**MINIMAL, "prefill": {"engine": {"kvCacheMemory": "512Ki"}}})
    )
    sizes = {"8Gi": 8 << 30, "500M": 500_000_000, "1e3": 1000, 4096: 4096, "1.5Ki": 1536,
             "100m": 1}  # fmt: skip
    assert {q: quantity_bytes(q) for q in sizes} == sizes
    for bad in ("lots", "1.5.2Gi", True):
        with pytest.raises(ValueError, match="not a quantity"):
            quantity_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30), ("2m", 120), ("1m30s", 90), ("1.5h", 5400), ("250us", 0.00025),
     ("250\u00b5s", 0.00025), ("100ns", 1e-7), (".5s", 0.5), ("1h2m3s4ms", 3723.004)],
)  # fmt: skip
def test_durations_read_as_go_writes_them(text: str, seconds: float) -> None:
    from splitserve_operator.api.durations import format_duration, parse_duration

    assert parse_duration(text) == pytest.approx(seconds)
    assert parse_duration(format_duration(parse_duration(text))) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "s", "-1s", "1 s", "1d", "1.2.3s", "5S", "1e3s"])
def test_what_is_not_a_duration(text: str) -> None:
    from splitserve_operator.api.durations import DURATION_PATTERN, parse_duration

    with pytest.raises(ValueError, match="is not a duration such as 500ms"):
        parse_duration(text)
    assert not DURATION_PATTERN.match(text)


def test_durations_are_written_back_in_their_shortest_plain_form() -> None:
    from splitserve_operator.api.durations import format_duration

    assert [format_duration(s) for s in (30, 0.5, 1.5, 0.00025, 3600)] == [
        "30s", "500ms", "1500ms", "0.00025s", "3600s"
    ]  # fmt: skip
    spec = parse_spec({**MINIMAL, "slo": {"ttft": "1m30s"}})
    assert spec.model_dump(by_alias=True, mode="json")["slo"]["ttft"] == "90s"
