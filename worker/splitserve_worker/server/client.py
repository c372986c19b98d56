"""Async client for a worker's ``splitserve.v1.Worker`` service: the router's, the tests'
and the benches' one way to call a worker.

    client = WorkerClient("127.0.0.1:7001", token)
    h = await client.health()
    handle = await client.reserve("req-1", len(prompt), compat=h.compat)    # decode worker
    first = await prefill_client.prefill("req-1", prompt, sampling, handle)  # prefill worker
    async for chunk in client.generate("req-1", prompt, sampling, expect_remote_kv=True):
        ...  # the first chunk carries first.first_token again; the last has finish_reason
    await client.close()

Every call carries the shared token and a deadline: the ``timeout`` given, else the
client's default (unary calls), a longer one for Prefill, none for the streams. Failures
surface as ``grpc.aio.AioRpcError``; its ``code()`` says what to do (see the proto):
``RESOURCE_EXHAUSTED`` (no blocks: another worker or later), ``FAILED_PRECONDITION``
(compat mismatch: never retry on this pair), ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``
(worker gone or lease expired: retry elsewhere), ``UNAUTHENTICATED`` (wrong token),
``INVALID_ARGUMENT`` (bad request: tell the client). ``sampling`` may be the engine's
``SamplingParams``, the router's ``Sampling``, any object with their fields, or the proto
message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from splitserve.v1 import worker_pb2 as pb
from splitserve.v1 import worker_pb2_grpc

from splitserve_worker.server.convert import sampling_to_proto
from splitserve_worker.server.wire import CHANNEL_OPTIONS, auth_metadata

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of unary calls when none is given; streams (Generate, Events) have none."""

PREFILL_TIMEOUT_S = 120.0
"""Least deadline of a Prefill call when none is given: it runs the whole prompt."""


class WorkerClient:
    """One insecure gRPC channel to one worker (workers sit on the cluster network)."""

    def __init__(
        self, address: str, token: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._md = auth_metadata(token or "")
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def close(self, grace: float | None = None) -> None:
        """Close the channel: calls under way are cancelled, or with ``grace`` have that
        many seconds to end first."""
        await self._channel.close(grace=grace)

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def health(self, timeout: float | None = None) -> pb.HealthResponse:
        resp: pb.HealthResponse = await self._stub.Health(
            pb.HealthRequest(), metadata=self._md, timeout=timeout or self.timeout
        )
        return resp

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        compat: pb.CompatInfo | None = None,
        lease_seconds: float = 0.0,
        kv_backend: str = "",
        timeout: float | None = None,
    ) -> pb.TransferHandle:
        """Reserve blocks on a decode worker; ``compat`` (e.g. the prefill worker's
        ``health().compat``) is checked before anything is held. ``lease_seconds`` 0 and
        ``kv_backend`` "" take the worker's defaults."""
        req = pb.ReserveRequest(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            lease_seconds=lease_seconds,
            kv_backend=kv_backend,
        )
        if compat is not None:
            req.compat.CopyFrom(compat)
        resp: pb.ReserveResponse = await self._stub.Reserve(
            req, metadata=self._md, timeout=timeout or self.timeout
        )
        return resp.handle

    async def prefill(
        self,
        request_id: str,
        prompt: Iterable[int],
        sampling: Any,
        handle: pb.TransferHandle,
        timeout: float | None = None,
    ) -> pb.PrefillResponse:
        """Run the prompt on a prefill worker, pushing its KV into ``handle``'s blocks."""
        req = pb.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling=sampling_to_proto(sampling),
            handle=handle,
        )
        resp: pb.PrefillResponse = await self._stub.Prefill(
            req, metadata=self._md, timeout=timeout or max(self.timeout, PREFILL_TIMEOUT_S)
        )
        return resp

    async def generate(
        self,
        request_id: str,
        prompt: Iterable[int],
        sampling: Any,
        expect_remote_kv: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[pb.TokenChunk]:
        """Token chunks until one has ``finish_reason``. Leaving early cancels the call,
        and the worker then aborts the request and frees its blocks."""
        req = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling=sampling_to_proto(sampling),
            expect_remote_kv=expect_remote_kv,
        )
        call = self._stub.Generate(req, metadata=self._md, timeout=timeout)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def release(
        self, request_id: str, reason: str = "", timeout: float | None = None
    ) -> pb.ReleaseResponse:
        resp: pb.ReleaseResponse = await self._stub.Release(
            pb.ReleaseRequest(request_id=request_id, reason=reason),
            metadata=self._md,
            timeout=timeout or self.timeout,
        )
        return resp

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        resp: pb.CancelResponse = await self._stub.Cancel(
            pb.CancelRequest(request_id=request_id),
            metadata=self._md,
            timeout=timeout or self.timeout,
        )
        return bool(resp.found)

    async def events(self) -> AsyncIterator[pb.KVEvent]:
        """The worker's prefix-cache events (STORED / EVICTED block hashes) as they happen."""
        call = self._stub.Events(pb.EventsRequest(), metadata=self._md)
        try:
            async for ev in call:
                yield ev
        finally:
            call.cancel()
