"""The prefill side of the ``grpc`` KV backend: grpcio's own client-streaming ``PushKV``
to the decode worker's gRPC port.

The portable path: any server of ``splitserve.v1.Worker/PushKV`` takes it, through
whatever proxies speak gRPC. Each span is one ``KVLayer`` message, built in one pass from
the K and V bytes (:func:`~.kvwire.encode`); grpcio copies it on its way, so this path
moves bytes at a fraction of ``tcp``'s speed. A push runs as ``streams`` calls, each on a
channel (a connection) of its own, the spans dealt to them in turn.

A push goes to the decode worker's own gRPC port, unless the handle's
``backend_metadata`` names another port on its host (:func:`rank_metadata`): that of a
tensor-parallel rank of the decode worker that receives its KV heads itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
from splitserve.tls import grpc_channel
from splitserve.v1 import worker_pb2

from splitserve_worker.kv import kvwire
from splitserve_worker.kv.span_sender import SpanOut, SpanSampler, SpanSender, default_streams
from splitserve_worker.kv.staging import HostStaging
from splitserve_worker.kv.transport import (
    MAX_STREAMS,
    BackendContext,
    TransferError,
    TransferTarget,
)

PUSH_METHOD = "/splitserve.v1.Worker/PushKV"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_IDLE_S = 600.0
"""A channel no push used for this long is closed (its decode worker may be gone)."""
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


PORT_KEY = "port"


def rank_metadata(port: int) -> bytes:
    """What a Reserve handle carries for a pool behind a gRPC port of its own on the
    decode worker's host (a rank ``r > 0``'s); empty: the worker's own gRPC port."""
    return f"{PORT_KEY}={port}".encode()


def push_address(target: TransferTarget) -> str:
    """Where a push to ``target`` goes: the decode worker's address, or the port its
    ``backend_metadata`` names on that host. Raises TransferError ``handle`` if neither."""
    if not target.decode_address:
        raise TransferError("the handle names no decode worker address", "handle")
    if not target.backend_metadata:
        return target.decode_address
    key, _, value = target.backend_metadata.decode("ascii", errors="replace").partition("=")
    if key != PORT_KEY or not value.isdigit() or not 0 < int(value) < 65536:
        raise TransferError(
            f"the handle's grpc KV metadata is malformed: {target.backend_metadata[:40]!r}",
            "handle",
        )
    host = target.decode_address.rpartition(":")[0]
    return f"{host}:{int(value)}"


def _encode(item: tuple[kvwire.KVSpan, tuple[memoryview | bytes, ...]]) -> bytes:
    span, parts = item
    return kvwire.encode(span, parts)


class GrpcStream:
    """One ``PushKV`` call's part of a push (a :class:`~.span_sender.Stream`)."""

    def __init__(self, channel: grpc.Channel, target: TransferTarget, token: str) -> None:
        self._push = channel.stream_unary(
            PUSH_METHOD,
            request_serializer=_encode,
            response_deserializer=worker_pb2.PushKVAck.FromString,
        )
        self._t = target
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._cancelled = False

    def _messages(
        self, spans: Iterator[SpanOut]
    ) -> Iterator[tuple[kvwire.KVSpan, tuple[memoryview | bytes, ...]]]:
        t = self._t
        heads = t.pool_heads or range(0)
        for s in spans:
            head = kvwire.KVSpan(t.request_id, t.lease_id, s.layer, s.start, s.count,
                                 crc32=s.crc32, compat_hash=t.compat_hash,
                                 kv_head_start=heads.start, kv_head_count=len(heads))  # fmt: skip
            yield head, s.parts

    def run(self, spans: Iterator[SpanOut]) -> int:
        t = self._t
        timeout = max(5.0, t.deadline_unix - time.time() + 5.0) if t.deadline_unix else 600.0
        with self._lock:
            if self._cancelled:
                raise TransferError("the push was cancelled", "aborted")
            call = self._push.future(self._messages(spans), metadata=self._metadata,
                                     timeout=timeout)  # fmt: skip
            self._call = call
        try:
            ack: worker_pb2.PushKVAck = call.result()
        except grpc.FutureCancelledError:
            raise TransferError("the push was cancelled", "aborted") from None
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            reason = "timeout" if code is grpc.StatusCode.DEADLINE_EXCEEDED else "stream"
            raise TransferError(f"the decode worker ended the KV push: {code.name}: {details}",
                                reason) from None  # fmt: skip
        return int(ack.layers_received)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()


class GrpcSenderBackend:
    name = "grpc"

    def __init__(self, ctx: BackendContext) -> None:
        self._ctx = ctx
        self.streams = ctx.streams or default_streams()
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"KV streams must be 1 to {MAX_STREAMS}, got {self.streams}")
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], tuple[grpc.Channel, float]] = {}
        self._staging = HostStaging()
        """Device layers to pinned host memory, one side stream per device for every push."""
        self._sampler = SpanSampler(0 if ctx.checksums else ctx.checksum_every)
        """The spans that carry a crc32 when checksums are sampled, over every push."""

    def _channel(self, address: str, i: int) -> grpc.Channel:
        """Channel ``i`` to ``address``: each of a push's calls on a connection of its own.
        Channels unused for :data:`CHANNEL_IDLE_S` (a decode worker gone) are closed."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, (_, used) in self._channels.items() if now - used > CHANNEL_IDLE_S]
            gone = [self._channels.pop(k)[0] for k in stale]
            got = self._channels.get((address, i))
            if got is None:
                options = [*CHANNEL_OPTIONS, ("splitserve.kv-stream", i)]
                ch = grpc_channel(address, self._ctx.tls, options)
            else:
                ch = got[0]
            self._channels[(address, i)] = (ch, now)
        for old in gone:
            old.close()
        return ch

    def open(self, target: TransferTarget) -> SpanSender:
        address = push_address(target)
        streams = [GrpcStream(self._channel(address, i), target, self._ctx.token)
                   for i in range(self.streams)]  # fmt: skip
        return SpanSender(target, self._ctx, list(streams), "grpc", self._staging, self._sampler)

    def close(self) -> None:
        with self._lock:
            channels = [ch for ch, _ in self._channels.values()]
            self._channels.clear()
        for ch in channels:
            ch.close()
