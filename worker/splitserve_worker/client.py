"""The one client of a worker's ``splitserve.v1.Worker`` service: the router's, the
prefill server's (Release and Commit on the decode worker), the tests' and the benches'.

    client = WorkerClient("127.0.0.1:7001", token)
    h = await client.health()
    handle = await client.reserve("req-1", len(prompt), h.compat)    # decode worker
    first = await prefill_client.prefill("req-1", prompt, sampling, handle)  # prefill worker
    async for chunk in client.generate("req-1", prompt, sampling, expect_remote_kv=True):
        ...  # the first chunk carries first.first_token again; the last has finish_reason
    await client.close()

It has a method for every RPC of the proto (a test holds it to that). Every call carries
the shared token and a deadline: the ``timeout`` given, else the client's default (unary
calls), a longer one for Prefill, none for the streams. Failures surface as
``grpc.aio.AioRpcError``; its ``code()`` says what to do (see the proto):
``RESOURCE_EXHAUSTED`` (no blocks: another worker or later), ``FAILED_PRECONDITION``
(compat mismatch: never retry on this pair), ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``
(worker gone or lease expired: retry elsewhere), ``UNAUTHENTICATED`` (wrong token),
``INVALID_ARGUMENT`` (bad request: tell the client). ``sampling`` is the contract's
:class:`~splitserve.sampling.SamplingParams` or the proto message, sent as it is.

Imports only the contract (``splitserve``) and grpcio: nothing of the worker's server,
engine, KV transports or router, so any of them can use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

from splitserve.grpc_options import CHANNEL_OPTIONS, auth_metadata
from splitserve.sampling import SamplingParams
from splitserve.tls import TlsConfig, grpc_aio_channel
from splitserve.v1 import worker_pb2 as pb
from splitserve.v1 import worker_pb2_grpc

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of unary calls when none is given; streams (Generate, Events) have none."""

PREFILL_TIMEOUT_S = 120.0
"""Least deadline of a Prefill call when none is given: it runs the whole prompt."""


def sampling_to_proto(sp: SamplingParams | pb.SamplingParams) -> pb.SamplingParams:
    """The wire form of ``sp`` (a proto is sent as it is)."""
    if isinstance(sp, pb.SamplingParams):
        return sp
    msg = pb.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=sp.stop_token_ids,
        stop=sp.stop,
        logprobs=sp.logprobs,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        resumed_tokens=sp.resumed_tokens,
        top_logprobs=sp.top_logprobs,
        logit_bias=dict(sp.logit_bias),
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    return msg


def top_from_proto(msg: pb.TopLogprobs) -> list[tuple[int, float]]:
    """The most likely tokens at one position, with their logprobs, best first."""
    return list(zip(msg.token_ids, msg.logprobs, strict=True))


class WorkerClient:
    """One gRPC channel to one worker: over TLS when ``tls`` has a CA (presenting
    ``tls``'s certificate, for mutual TLS, when it has one), else plain."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsConfig | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._md = auth_metadata(token or "")
        self._channel = grpc_aio_channel(address, tls, CHANNEL_OPTIONS)
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

    async def events(self) -> AsyncIterator[pb.KVEvent]:
        """The worker's prefix-cache events (STORED / EVICTED block hashes) as they happen."""
        call = self._stub.Events(pb.EventsRequest(), metadata=self._md)
        try:
            async for ev in call:
                yield ev
        finally:
            call.cancel()

    async def switch_role(
        self, role: int, drain_seconds: float = 0.0, timeout: float | None = None
    ) -> pb.SwitchRoleResponse:
        """Ask a ``--switchable`` worker to serve ``role`` (a ``pb.ROLE_*``); answers once
        the switch (its drain included) is over. ``timeout`` should cover the drain."""
        resp: pb.SwitchRoleResponse = await self._stub.SwitchRole(
            pb.SwitchRoleRequest(role=role, drain_seconds=drain_seconds),  # type: ignore[arg-type]
            metadata=self._md,
            timeout=timeout or self.timeout,
        )
        return resp

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        """End the request wherever it is on the worker (reserved, decoding); True when
        the worker knew it."""
        resp: pb.CancelResponse = await self._stub.Cancel(
            pb.CancelRequest(request_id=request_id),
            metadata=self._md,
            timeout=timeout or self.timeout,
        )
        return bool(resp.found)

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        compat: pb.CompatInfo,
        lease_seconds: float = 0.0,
        kv_backend: str = "",
        timeout: float | None = None,
    ) -> pb.TransferHandle:
        """Reserve blocks on a decode worker for KV of ``compat`` (the prefill worker's
        ``health().compat``), checked before anything is held. ``lease_seconds`` 0 and
        ``kv_backend`` "" take the worker's defaults; a lease longer than the worker's
        ``--max-lease-seconds`` is cut to it."""
        req = pb.ReserveRequest(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            compat=compat,
            lease_seconds=lease_seconds,
            kv_backend=kv_backend,
        )
        resp: pb.ReserveResponse = await self._stub.Reserve(
            req, metadata=self._md, timeout=timeout or self.timeout
        )
        return resp.handle

    async def release(
        self, request_id: str, reason: str = "", timeout: float | None = None
    ) -> pb.ReleaseResponse:
        """Free a decode worker's reservation for ``request_id`` (and any KV pushed so far)."""
        resp: pb.ReleaseResponse = await self._stub.Release(
            pb.ReleaseRequest(request_id=request_id, reason=reason),
            metadata=self._md,
            timeout=timeout or self.timeout,
        )
        return resp

    async def push_kv(
        self,
        layers: AsyncIterable[pb.KVLayer] | Iterable[pb.KVLayer],
        timeout: float | None = None,
    ) -> pb.PushKVAck:
        """Push KV spans into a decode worker's reserved blocks over its gRPC port (the
        interoperable path; prefill workers push through their KV backend)."""
        ack: pb.PushKVAck = await self._stub.PushKV(
            layers, metadata=self._md, timeout=timeout or self.timeout
        )
        return ack

    async def commit(
        self,
        request_id: str,
        lease_id: str,
        first_token: int,
        *,
        first_token_logprob: float = 0.0,
        layers_sent: int = 0,
        layer_crc32: Sequence[int] = (),
        first_top_logprobs: pb.TopLogprobs | None = None,
        prompt_logprobs: pb.PromptLogprobs | None = None,
        timeout: float | None = None,
    ) -> pb.CommitResponse:
        """Tell a decode worker every layer of ``request_id`` was pushed, with the first
        token: it checks the layers (and their crc32s, when sent) and starts decoding."""
        req = pb.CommitRequest(
            request_id=request_id,
            lease_id=lease_id,
            first_token=first_token,
            first_token_logprob=first_token_logprob,
            layers_sent=layers_sent,
            layer_crc32=layer_crc32,
        )
        if first_top_logprobs is not None:
            req.first_top_logprobs.CopyFrom(first_top_logprobs)
        if prompt_logprobs is not None:
            req.prompt_logprobs.CopyFrom(prompt_logprobs)
        resp: pb.CommitResponse = await self._stub.Commit(
            req, metadata=self._md, timeout=timeout or self.timeout
        )
        return resp

    async def generate(
        self,
        request_id: str,
        prompt: Iterable[int],
        sampling: SamplingParams | pb.SamplingParams,
        expect_remote_kv: bool = False,
        timeout: float | None = None,
        recompute_prompt: bool = False,
    ) -> AsyncIterator[pb.TokenChunk]:
        """Token chunks until one has ``finish_reason``. Leaving early cancels the call,
        and the worker then aborts the request and frees its blocks. ``recompute_prompt``:
        the worker prefills the whole prompt itself, reading no cached prefix block."""
        req = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling=sampling_to_proto(sampling),
            expect_remote_kv=expect_remote_kv,
            recompute_prompt=recompute_prompt,
        )
        call = self._stub.Generate(req, metadata=self._md, timeout=timeout)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def prefill(
        self,
        request_id: str,
        prompt: Iterable[int],
        sampling: SamplingParams | pb.SamplingParams,
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


class WorkerClients:
    """One :class:`WorkerClient` per address, opened on first use and all closed together
    (a prefill worker's clients of the decode workers it pushes to)."""

    def __init__(
        self,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsConfig | None = None,
    ) -> None:
        self._token = token
        self._timeout = timeout
        self._tls = tls
        self._clients: dict[str, WorkerClient] = {}

    def __len__(self) -> int:
        return len(self._clients)

    def get(self, address: str) -> WorkerClient:
        client = self._clients.get(address)
        if client is None:
            client = WorkerClient(address, self._token, timeout=self._timeout, tls=self._tls)
            self._clients[address] = client
        return client

    async def close(self, grace: float | None = None) -> None:
        """Close every client; calls under way are cancelled (or get ``grace`` seconds).
        A later :meth:`get` opens a new one."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close(grace)
