"""A thin async client over the splitserve.v1 gRPC stubs, as the router uses them.

Every call carries the worker token and a deadline. The router depends only on
the :class:`WorkerConn` protocol, so another client with the same methods can
replace this one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from splitserve.v1 import worker_pb2 as pb
from splitserve.v1 import worker_pb2_grpc as pb_grpc

from splitserve_worker.server.convert import sampling_to_proto
from splitserve_worker.server.wire import CHANNEL_OPTIONS, auth_metadata


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters as sent to workers (mirrors the engine's SamplingParams)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def to_pb(self) -> pb.SamplingParams:
        return sampling_to_proto(self)


class WorkerConn(Protocol):
    """What the router calls on one worker."""

    address: str

    async def health(self, timeout: float) -> pb.HealthResponse: ...

    def events(self) -> AsyncIterator[pb.KVEvent]: ...

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        compat: pb.CompatInfo,
        lease_s: float,
        kv_backend: str,
        timeout: float,
    ) -> pb.TransferHandle: ...

    async def release(self, request_id: str, reason: str, timeout: float) -> int: ...

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        handle: pb.TransferHandle,
        timeout: float,
    ) -> pb.PrefillResponse: ...

    def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        expect_remote_kv: bool,
        timeout: float,
    ) -> AsyncIterator[pb.TokenChunk]: ...

    async def cancel(self, request_id: str, timeout: float) -> bool: ...

    async def close(self) -> None: ...


class GrpcWorkerConn:
    """:class:`WorkerConn` over one insecure gRPC channel (workers sit on the cluster network)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._md = auth_metadata(token or "")

    async def health(self, timeout: float) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=timeout, metadata=self._md)

    async def events(self) -> AsyncIterator[pb.KVEvent]:
        call = self._stub.Events(pb.EventsRequest(), metadata=self._md)
        try:
            async for ev in call:
                yield ev
        finally:
            call.cancel()

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        compat: pb.CompatInfo,
        lease_s: float,
        kv_backend: str,
        timeout: float,
    ) -> pb.TransferHandle:
        resp = await self._stub.Reserve(
            pb.ReserveRequest(
                request_id=request_id,
                num_prompt_tokens=num_prompt_tokens,
                compat=compat,
                lease_seconds=lease_s,
                kv_backend=kv_backend,
            ),
            timeout=timeout,
            metadata=self._md,
        )
        return resp.handle

    async def release(self, request_id: str, reason: str, timeout: float) -> int:
        resp = await self._stub.Release(
            pb.ReleaseRequest(request_id=request_id, reason=reason),
            timeout=timeout,
            metadata=self._md,
        )
        return int(resp.blocks_freed)

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        handle: pb.TransferHandle,
        timeout: float,
    ) -> pb.PrefillResponse:
        return await self._stub.Prefill(
            pb.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling=sampling.to_pb(),
                handle=handle,
            ),
            timeout=timeout,
            metadata=self._md,
        )

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        expect_remote_kv: bool,
        timeout: float,
    ) -> AsyncIterator[pb.TokenChunk]:
        call = self._stub.Generate(
            pb.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling=sampling.to_pb(),
                expect_remote_kv=expect_remote_kv,
            ),
            timeout=timeout,
            metadata=self._md,
        )
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def cancel(self, request_id: str, timeout: float) -> bool:
        resp = await self._stub.Cancel(
            pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self._md
        )
        return bool(resp.found)

    async def close(self) -> None:
        await self._channel.close(None)
