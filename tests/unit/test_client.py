"""The one worker client: a method for every RPC of the contract (so a new RPC cannot be
left to raw stubs), the router's port implemented by it, and the per-address cache the
prefill server calls decode workers through, closed whole."""

from __future__ import annotations

import inspect
import re

import grpc
import pytest
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient, WorkerClients
from splitserve_worker.router.worker_conn import WorkerConn

pytestmark = pytest.mark.unit


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def test_every_rpc_of_the_contract_has_a_client_method() -> None:
    rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["Worker"].methods]
    assert "Commit" in rpcs and "PushKV" in rpcs
    missing = [r for r in rpcs if not callable(getattr(WorkerClient, snake(r), None))]
    assert not missing, f"WorkerClient has no method for {missing}"


def test_the_client_implements_the_routers_port() -> None:
    port = {n for n, _ in inspect.getmembers(WorkerConn) if not n.startswith("_")}
    for name in port - {"address"}:
        want = inspect.signature(getattr(WorkerConn, name)).parameters
        got = inspect.signature(getattr(WorkerClient, name)).parameters
        assert list(want) == list(got)[: len(want)], name


async def test_clients_are_one_per_address_and_close_together() -> None:
    clients = WorkerClients("token")
    a = clients.get("127.0.0.1:9")
    assert clients.get("127.0.0.1:9") is a
    b = clients.get("127.0.0.1:10")
    assert b is not a and len(clients) == 2
    await clients.close()
    assert len(clients) == 0
    for closed in (a, b):
        with pytest.raises(grpc.aio.UsageError, match="closed"):
            await closed.health(timeout=1)
    fresh = clients.get("127.0.0.1:9")  # a later call opens a new one
    assert fresh is not a
    await clients.close()
