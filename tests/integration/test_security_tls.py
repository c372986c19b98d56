"""A stack over mutual TLS: a router, a prefill and a decode worker (real processes on
127.0.0.1) given one CA and one certificate, as a cluster Secret gives them.

Greedy tokens through the API equal transformers' own ``generate`` with the KV pushed
over the ``tcp`` fast path and over gRPC's ``PushKV``, both over TLS; and every port
refuses a client that speaks plain, presents no certificate or one of another CA: the
workers' gRPC ports, the decode worker's KV port, and the router's path to the workers.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from splitserve.roles import Role
from splitserve.tls import TlsConfig
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.kv.tcp_sender import TcpConnection
from splitserve_worker.kv.transport import TransferError
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from splitserve_worker.router.service import RouterService
from stack_kit import (  # noqa: F401  (fixtures)
    MAX_TOKENS,
    PROMPTS,
    reference_fixture,
    tokenizer_fixture,
)
from tls_kit import SERVER_NAME, TlsFiles, make_tls_files

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(tiny_model_path: Path, tls_files: TlsFiles) -> Iterator[tuple[str, list[WorkerEndpoint]]]:
    token = secrets.token_hex(8)
    tls = tls_files.config(server_name=SERVER_NAME, mutual=True)
    with WorkerProcs(str(tiny_model_path), [Role.PREFILL, Role.DECODE], token, threads=1,
                     echo=False, tls=tls) as procs:  # fmt: skip
        yield token, procs.start(timeout_s=300)


def router(token: str, tokenizer: Any, eps: list[WorkerEndpoint], tls: TlsConfig,
           **cfg: Any) -> RouterThread:  # fmt: skip
    config = RouterConfig(model_name="tiny", worker_token=token, tls=tls,
                          disaggregation="always", **cfg)  # fmt: skip
    return RouterThread(RouterService(config, tokenizer, StaticDiscovery(eps)))


def completion(base: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def remote_decisions(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith('splitserve_disaggregation_decisions_total{decision="remote"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("kv_backend", ["tcp", "grpc"])
def test_greedy_tokens_over_mutual_tls_equal_transformers(
    kv_backend: str,
    stack: tuple[str, list[WorkerEndpoint]],
    tls_files: TlsFiles,
    tokenizer: Any,
    reference: list[list[int]],
) -> None:
    token, eps = stack
    tls = tls_files.config(server_name=SERVER_NAME)
    with router(token, tokenizer, eps, tls, kv_backend=kv_backend) as base:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert completion(base, prompt) == want
        assert remote_decisions(base) == len(PROMPTS)  # each one prefilled remotely


def refused_configs(files: TlsFiles) -> dict[str, TlsConfig | None]:
    return {
        "plain": None,
        "no client certificate": TlsConfig(ca_file=str(files.ca), server_name=SERVER_NAME),
        "another CA's certificate": files.stranger(),
    }


def test_worker_grpc_ports_refuse_plain_and_wrong_certificate_clients(
    stack: tuple[str, list[WorkerEndpoint]], tls_files: TlsFiles
) -> None:
    token, eps = stack

    async def scenario() -> None:
        for ep in eps:
            for what, tls in refused_configs(tls_files).items():
                async with WorkerClient(ep.address, token, tls=tls, timeout=5) as c:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await c.health()
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (ep.role, what)
            good = tls_files.config(server_name=SERVER_NAME)
            async with WorkerClient(ep.address, token, tls=good, timeout=30) as c:
                assert (await c.health()).total_blocks > 0

    asyncio.run(scenario())


def test_the_kv_port_refuses_plain_and_wrong_certificate_senders(
    stack: tuple[str, list[WorkerEndpoint]], tls_files: TlsFiles
) -> None:
    token, eps = stack
    decode = next(e for e in eps if e.role == Role.DECODE)
    good = tls_files.config(server_name=SERVER_NAME)

    async def scenario() -> None:
        async with WorkerClient(decode.address, token, tls=good, timeout=30) as c:
            h = await c.health()
            handle = await c.reserve("tls-kv-port", 8, h.compat, kv_backend="tcp")
            free = (await c.health()).free_blocks
            port, speaks_tls = wire.parse_metadata(handle.backend_metadata)
            assert speaks_tls
            compat_hash = h.compat.hash

            def attempt(tls: TlsConfig | None) -> str:
                context = tls.client_context() if tls is not None else None
                try:
                    conn = TcpConnection.open("127.0.0.1", port, token=token,
                                              compat_hash=compat_hash, tls=context,
                                              server_name=SERVER_NAME)  # fmt: skip
                except TransferError as e:
                    return str(e)
                conn.close()
                return "READY"

            # a plain sender: the port speaks TLS only and sends it no challenge
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"\x00" * 64)
                assert plain_answer(s) == b""  # closed (or reset) without a challenge
            for what, tls in refused_configs(tls_files).items():
                if tls is None:
                    continue  # the raw plain sender above
                said = await asyncio.to_thread(attempt, tls)
                assert "failed during the handshake" in said, (what, said)
            assert await asyncio.to_thread(attempt, good) == "READY"
            assert (await c.health()).free_blocks == free  # nothing was written or freed
            await c.release("tls-kv-port")

    asyncio.run(scenario())


def plain_answer(s: socket.socket) -> bytes:
    try:
        return s.recv(1 << 16)
    except ConnectionResetError:
        return b""


def test_routers_without_the_right_certificate_reach_no_worker(
    stack: tuple[str, list[WorkerEndpoint]], tls_files: TlsFiles, tokenizer: Any
) -> None:
    token, eps = stack
    for what, tls in refused_configs(tls_files).items():
        rt = router(token, tokenizer, eps, tls or TlsConfig())
        with pytest.raises(RuntimeError, match="no decode worker became healthy"):
            rt.start(ready_timeout_s=5)
        assert not any(w.healthy for w in rt.service.pool.snapshot()), what
