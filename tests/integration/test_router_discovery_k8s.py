"""Kubernetes discovery against the API emulator: pods are listed, then watched."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from splitserve.roles import Role
from splitserve_worker.router.discovery import KubernetesDiscovery, WorkerEndpoint

pytestmark = pytest.mark.integration


def pod_body(name: str, role: str, ip: str, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "labels": {"splitserve.io/role": role, "app": "x"},
        },
        "spec": {
            "containers": [
                {"name": "w", "image": "i", "ports": [{"name": "grpc", "containerPort": 50051}]}
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


async def next_set(it: Any, want: list[WorkerEndpoint], timeout: float = 10.0) -> None:
    async def until() -> None:
        while True:
            got = await it.__anext__()
            if got == want:
                return

    await asyncio.wait_for(until(), timeout)


def add_pod(api: Any, name: str, role: str, ip: str, ready: bool) -> None:
    """Creates the pod, then sets its status (the API server ignores status on create)."""
    body = pod_body(name, role, ip, ready)
    api.create_namespaced_pod("llm", {k: v for k, v in body.items() if k != "status"})
    set_ready(api, name, ip, ready)


def set_ready(api: Any, name: str, ip: str, ready: bool) -> None:
    status = pod_body(name, "", ip, ready)["status"]
    api.patch_namespaced_pod_status(name, "llm", {"status": status})


async def test_pods_are_listed_then_watched(kube: Any) -> None:
    from kubernetes import client

    api = client.CoreV1Api(client.ApiClient(kube.configuration()))
    await asyncio.to_thread(add_pod, api, "p-0", "prefill", "10.0.0.1", True)
    disc = KubernetesDiscovery(api, "llm", "app=x", watch_timeout_s=1, retry_s=0.2)
    it = disc.watch().__aiter__()
    p0 = WorkerEndpoint("llm/p-0", Role.PREFILL, "10.0.0.1:50051")
    d0 = WorkerEndpoint("llm/d-0", Role.DECODE, "10.0.0.2:50051")
    try:
        await next_set(it, [p0])
        # a decode pod appears, not ready yet: not a worker until it is
        await asyncio.to_thread(add_pod, api, "d-0", "decode", "10.0.0.2", False)
        await asyncio.to_thread(set_ready, api, "d-0", "10.0.0.2", True)
        await next_set(it, [d0, p0])
        await asyncio.to_thread(api.delete_namespaced_pod, "p-0", "llm")
        await next_set(it, [d0])
    finally:
        await it.aclose()
