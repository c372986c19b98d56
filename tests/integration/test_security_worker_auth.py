"""Every worker RPC needs the shared token; the router's API key is optional.

The RPC list comes from the service descriptor, so an RPC added later is covered too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from splitserve.grpc_options import auth_metadata
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.router.app import create_app
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery
from splitserve_worker.router.service import RouterService
from splitserve_worker.server.app import start_worker
from splitserve_worker.server.config import WorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "auth-test-token-5d1c"
METHODS = pb.DESCRIPTOR.services_by_name["Worker"].methods


async def call(channel: grpc.aio.Channel, method: Any, metadata: Any) -> grpc.StatusCode:
    """Calls ``method`` with an empty request; returns the status it ends with."""
    path = f"/splitserve.v1.Worker/{method.name}"
    request = getattr(pb, method.input_type.name)()
    ser, des = type(request).SerializeToString, getattr(pb, method.output_type.name).FromString

    async def one() -> AsyncIterator[Any]:
        yield request

    kind = (method.client_streaming, method.server_streaming)
    try:
        if kind == (False, False):
            await channel.unary_unary(path, ser, des)(request, metadata=metadata, timeout=5)
        elif kind == (False, True):
            async for _ in channel.unary_stream(path, ser, des)(
                request, metadata=metadata, timeout=1
            ):
                break
        elif kind == (True, False):
            await channel.stream_unary(path, ser, des)(one(), metadata=metadata, timeout=5)
        else:
            async for _ in channel.stream_stream(path, ser, des)(
                one(), metadata=metadata, timeout=1
            ):
                break
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("role", ["both", "prefill"])
def test_every_rpc_refuses_a_missing_or_wrong_token(tiny_model_path: Path, role: str) -> None:
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)

    async def scenario() -> None:
        cfg = WorkerConfig(role=role, model=str(tiny_model_path), token=TOKEN, num_blocks=64,  # type: ignore[arg-type]
                           threads=1)  # fmt: skip
        w = await start_worker(cfg, loaded=load_model(str(tiny_model_path)))
        try:
            async with grpc.aio.insecure_channel(w.address) as ch:
                assert len(METHODS) >= 9
                for m in METHODS:
                    for md in ((), auth_metadata("wrong"), auth_metadata(TOKEN + "x"),
                               (("authorization", TOKEN),), (("x-token", TOKEN),)):  # fmt: skip
                        code = await call(ch, m, md)
                        assert code is grpc.StatusCode.UNAUTHENTICATED, (m.name, md, code)
                    # with the token the call gets past authentication
                    code = await call(ch, m, auth_metadata(TOKEN))
                    assert code is not grpc.StatusCode.UNAUTHENTICATED, m.name
                h = await ch.unary_unary(
                    "/splitserve.v1.Worker/Health",
                    pb.HealthRequest.SerializeToString,
                    pb.HealthResponse.FromString,
                )(pb.HealthRequest(), metadata=auth_metadata(TOKEN), timeout=5)
                assert h.total_blocks == 64
        finally:
            await w.stop(0.2)

    asyncio.run(scenario())


class _Tok:
    """The least tokenizer the HTTP layer needs for auth and model checks."""

    chat_template = None

    def __len__(self) -> int:
        return 100


async def _get(app: Any, path: str, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        return await c.get(path, headers=headers)


async def _post(app: Any, path: str, headers: dict[str, str], body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        return await c.post(path, headers=headers, json=body)


def _app(api_key: str | None) -> Any:
    cfg = RouterConfig(model_name="m", api_key=api_key, worker_token=TOKEN)
    return create_app(RouterService(cfg, _Tok(), StaticDiscovery([])))


def test_router_api_key_on_refuses_without_it() -> None:
    key = "sk-test-4f9a"
    app = _app(key)

    async def scenario() -> None:
        for path in ("/v1/models",):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": key},
                            {"Authorization": f"Basic {key}"}, {"X-Api-Key": key}):  # fmt: skip
                r = await _get(app, path, headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and "API key" in err["message"]
                assert key not in r.text
            r = await _get(app, path, {"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await _post(app, path, {}, {"model": "m", "prompt": [1, 2], "messages": []})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"

    asyncio.run(scenario())


def test_router_api_key_off_is_open() -> None:
    app = _app(None)

    async def scenario() -> None:
        r = await _get(app, "/v1/models", {})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
        r = await _get(app, "/v1/models", {"Authorization": "Bearer anything"})
        assert r.status_code == 200

    asyncio.run(scenario())


BIG = 63 << 20
"""An unauthenticated caller's message: just under the server's receive limit."""


def test_a_call_without_the_token_is_refused_before_its_message_is_read() -> None:
    """The token is checked on the call's metadata; the refused call's 63 MB message is
    never received whole nor parsed (it was, before the refusal: a worker spent seconds
    and gigabytes on such calls, its Health late enough to be marked unhealthy)."""
    from splitserve.grpc_options import SERVER_OPTIONS
    from splitserve_worker.server.auth import TokenAuthInterceptor

    parsed: list[int] = []

    def deserialize(raw: bytes) -> pb.HealthRequest:
        parsed.append(len(raw))
        return pb.HealthRequest.FromString(raw)

    async def health(request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        return pb.HealthResponse(version="answered")

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)], options=SERVER_OPTIONS)
        handler = grpc.unary_unary_rpc_method_handler(
            health, deserialize, pb.HealthResponse.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("splitserve.v1.Worker", {"Health": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            from splitserve.grpc_options import CHANNEL_OPTIONS

            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=CHANNEL_OPTIONS
            ) as ch:
                raw = ch.unary_unary("/splitserve.v1.Worker/Health", lambda b: b,
                                     pb.HealthResponse.FromString)  # fmt: skip
                junk = b"\x42" * BIG  # any bytes: nothing may read them
                for md in ((), auth_metadata("wrong")):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await raw(junk, metadata=md, timeout=30)
                    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert parsed == [], f"a refused call's message was parsed: {parsed}"
                ok = await raw(b"", metadata=auth_metadata(TOKEN), timeout=5)
                assert ok.version == "answered" and parsed == [0]
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_a_request_larger_than_its_method_takes_is_refused_unparsed(tiny_model_path: Path) -> None:
    """With the token, a Generate or Prefill of two million token ids (the model takes
    4,096) is refused by its size before it is decoded; so is a Health of a megabyte."""
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)

    async def scenario() -> None:
        cfg = WorkerConfig(role="both", model=str(tiny_model_path), token=TOKEN, num_blocks=64,
                           threads=1)  # fmt: skip
        w = await start_worker(cfg, loaded=load_model(str(tiny_model_path)))
        md = auth_metadata(TOKEN)
        try:
            async with grpc.aio.insecure_channel(w.address) as ch:
                prompt = list(range(2_000_000))
                gen = pb.GenerateRequest(request_id="huge", prompt_token_ids=prompt)
                pre = pb.PrefillRequest(request_id="huge", prompt_token_ids=prompt)
                calls = [
                    ch.unary_stream("/splitserve.v1.Worker/Generate",
                                    pb.GenerateRequest.SerializeToString,
                                    pb.TokenChunk.FromString)(gen, metadata=md, timeout=30),
                    ch.unary_unary("/splitserve.v1.Worker/Prefill",
                                   pb.PrefillRequest.SerializeToString,
                                   pb.PrefillResponse.FromString)(pre, metadata=md, timeout=30),
                    ch.unary_unary("/splitserve.v1.Worker/Health", lambda b: b,
                                   pb.HealthResponse.FromString)(b"\x42" * (1 << 20), metadata=md,
                                                                 timeout=30),
                ]  # fmt: skip
                for name, call in zip(("Generate", "Prefill", "Health"), calls, strict=True):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        if name == "Generate":
                            async for _ in call:  # type: ignore[union-attr]
                                pass
                        else:
                            await call  # type: ignore[misc]
                    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, e.value)
                    details = str(e.value.details())
                    assert f"a {name} request of" in details and "takes at most" in details, details
                health = ch.unary_unary("/splitserve.v1.Worker/Health",
                                        pb.HealthRequest.SerializeToString,
                                        pb.HealthResponse.FromString)  # fmt: skip
                h = await health(pb.HealthRequest(), metadata=md, timeout=5)
                assert h.free_blocks == h.total_blocks == 64
        finally:
            await w.stop(0.2)

    asyncio.run(scenario())


def test_a_silent_or_trickling_connection_to_a_worker_is_let_go() -> None:
    """A peer that connects and says nothing, or sends the HTTP/2 preface a byte at a
    time, is dropped once the handshake timeout passes (it was held two minutes)."""
    import socket
    import time

    from splitserve.grpc_options import HANDSHAKE_TIMEOUT_MS, SERVER_OPTIONS
    from splitserve_worker.server.auth import TokenAuthInterceptor

    guard_s = 3 * HANDSHAKE_TIMEOUT_MS / 1000
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def held(port: int, trickle: bool) -> bool:
        """Whether the connection was still open when the guard ran out."""
        sock = socket.create_connection(("127.0.0.1", port))
        sock.settimeout(0.25)
        deadline = time.monotonic() + guard_s
        try:
            for i in range(10**6):
                if trickle:
                    try:
                        sock.sendall(preface[i % len(preface) : i % len(preface) + 1])
                    except (BrokenPipeError, ConnectionResetError):
                        return False
                try:
                    if sock.recv(4096) == b"":
                        return False
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    return False
                if time.monotonic() > deadline:
                    return True
            return True
        finally:
            sock.close()

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)], options=SERVER_OPTIONS)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            silent, trickling = await asyncio.gather(
                asyncio.to_thread(held, port, False), asyncio.to_thread(held, port, True)
            )
            assert not silent, "a silent connection outlived the handshake timeout"
            assert not trickling, "a preface trickling in outlived the handshake timeout"
        finally:
            await server.stop(None)

    asyncio.run(scenario())
