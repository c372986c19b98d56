"""Worker discovery: the static list and reading worker pods (kubernetes client objects)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)
from splitserve.roles import Role
from splitserve_worker.router.discovery import (
    DiscoveryError,
    WorkerEndpoint,
    endpoint_from_pod,
    parse_static,
)

pytestmark = pytest.mark.unit


def test_parse_static() -> None:
    eps = parse_static("prefill=127.0.0.1:7001, decode=127.0.0.1:7002,both=[::1]:7003")
    assert eps == [
        WorkerEndpoint("prefill@127.0.0.1:7001", Role.PREFILL, "127.0.0.1:7001"),
        WorkerEndpoint("decode@127.0.0.1:7002", Role.DECODE, "127.0.0.1:7002"),
        WorkerEndpoint("both@[::1]:7003", Role.BOTH, "[::1]:7003"),
    ]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", "no workers given"),
        ("127.0.0.1:7001", "must look like ROLE=HOST:PORT"),
        ("router=127.0.0.1:1", "unknown role"),
        ("decode=127.0.0.1", "must be HOST:PORT"),
        ("decode=127.0.0.1:99999", "must be HOST:PORT"),
        ("decode=h:1,prefill=h:1", "listed twice"),
    ],
)
def test_parse_static_errors_say_what_to_write(spec: str, words: str) -> None:
    with pytest.raises(DiscoveryError, match=words):
        parse_static(spec)


def pod(
    name: str = "w-0",
    role: str | None = "decode",
    phase: str = "Running",
    ready: str = "True",
    ip: str | None = "10.0.0.5",
    port: int | None = 50051,
    deleting: bool = False,
) -> V1Pod:
    labels = {"splitserve.io/role": role} if role else {}
    ports = [V1ContainerPort(name="metrics", container_port=9100)]
    if port is not None:
        ports.append(V1ContainerPort(name="grpc", container_port=port))
    return V1Pod(
        metadata=V1ObjectMeta(
            name=name,
            namespace="ns",
            labels=labels,
            deletion_timestamp=datetime(2026, 1, 1, tzinfo=UTC) if deleting else None,
        ),
        spec=V1PodSpec(containers=[V1Container(name="worker", ports=ports)]),
        status=V1PodStatus(
            phase=phase, pod_ip=ip, conditions=[V1PodCondition(type="Ready", status=ready)]
        ),
    )


def test_ready_worker_pod_becomes_an_endpoint() -> None:
    assert endpoint_from_pod(pod(port=6000)) == WorkerEndpoint(
        "ns/w-0", Role.DECODE, "10.0.0.5:6000"
    )
    assert endpoint_from_pod(pod(role="prefill", ip="fd00::1")) == WorkerEndpoint(
        "ns/w-0", Role.PREFILL, "[fd00::1]:50051"
    )


def test_pod_as_plain_dict_from_a_watch_is_read_too() -> None:
    raw = {
        "metadata": {"name": "w-1", "namespace": "ns", "labels": {"splitserve.io/role": "both"}},
        "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 7000}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.1.1.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert endpoint_from_pod(raw) == WorkerEndpoint("ns/w-1", Role.BOTH, "10.1.1.1:7000")


@pytest.mark.parametrize(
    "p",
    [
        pod(role=None),
        pod(role="router"),
        pod(phase="Pending"),
        pod(ready="False"),
        pod(ip=None),
        pod(deleting=True),
    ],
)
def test_pods_that_cannot_serve_are_skipped(p: V1Pod) -> None:
    assert endpoint_from_pod(p) is None
