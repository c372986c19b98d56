"""The ``grpc`` KV backend: layers streamed over a client-streaming ``PushKV`` call.

Prefill side: ``send_layer`` keeps the layer's K and V tensors (the engine hands over
fresh ones; a view is copied) and queues spans of about 1 MiB on bounded queues; gRPC's
own sending threads drain them, building each wire message in one pass (:mod:`.kvwire`),
so the push overlaps the next layer's compute, and a slow receiver holds the engine back
instead of buffering without bound. A push runs as ``streams`` concurrent PushKV calls,
each on its own connection, the spans dealt to them in turn: one gRPC stream moves about
half of what a plain socket does, and on a host with cores to spare two move more
(:func:`default_streams`).

Decode side: each message is parsed without copying its payload (:func:`kvwire.decode`),
viewed in place with ``torch.frombuffer`` and copied once, by slot index, into the
reserved blocks of the pool (:meth:`GrpcReceiver.write`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import torch
from splitserve.v1 import worker_pb2

from splitserve_worker.kv import kvwire
from splitserve_worker.kv.faults import FaultInjector, InjectedFault
from splitserve_worker.kv.layout import PoolView, as_bytes, owned, token_chunks
from splitserve_worker.kv.lease import Lease, LeaseTable
from splitserve_worker.kv.transport import (
    MAX_STREAMS,
    BackendContext,
    SendStats,
    TransferError,
    TransferTarget,
)
from splitserve_worker.server.wire import CHANNEL_OPTIONS, auth_metadata

QUEUE_DEPTH = 16
"""Messages (~1 MiB each) buffered between the engine thread and the wire, all streams
together."""


def default_streams(cores: int | None = None) -> int:
    """Concurrent PushKV calls per push: 2 on hosts of 8 cores or more, else 1.

    Measured on 16 cores (``bench/kv_transfer.py --streams``): 2 streams moved 256 MiB
    about a fifth faster than 1; 4 and 8 were slower than 2, the receiving side spending
    more CPU per byte as streams contend for its interpreter. On a small host a second
    stream only takes CPU from the engines. Cores are those this process may run on."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return 2 if cores >= 8 else 1


PUT_TIMEOUT_S = 15.0
"""Longest the engine thread waits for room on the queue before declaring the push dead."""


PUSH_METHOD = "/splitserve.v1.Worker/PushKV"


@dataclass
class _Out:
    """One message waiting for the wire: its header and the K / V byte views."""

    span: kvwire.KVSpan
    parts: tuple[memoryview | bytes, ...]


def _serialize(out: _Out) -> bytes:
    # runs on gRPC's sending thread: the one copy that builds the wire message
    return kvwire.encode(out.span, out.parts)


class _Channels:
    """``streams`` channels (connections) per decode address, shared by every push to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], grpc.Channel] = {}

    def push_methods(self, address: str, streams: int) -> list[grpc.StreamUnaryMultiCallable]:
        return [self._push_method(address, i) for i in range(streams)]

    def _push_method(self, address: str, i: int) -> grpc.StreamUnaryMultiCallable:
        with self._lock:
            ch = self._channels.get((address, i))
            if ch is None:
                # a distinct option keeps gRPC from sharing one connection between them
                options = [*CHANNEL_OPTIONS, ("splitserve.kv_stream", i)]
                ch = grpc.insecure_channel(address, options=options)
                self._channels[(address, i)] = ch
        return ch.stream_unary(
            PUSH_METHOD,
            request_serializer=_serialize,
            response_deserializer=worker_pb2.PushKVAck.FromString,
        )

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


class GrpcSender:
    def __init__(
        self,
        target: TransferTarget,
        ctx: BackendContext,
        pushes: list[grpc.StreamUnaryMultiCallable],
    ) -> None:
        self._t = target
        self._ctx = ctx
        self._faults = FaultInjector(ctx.faults)
        depth = max(2, QUEUE_DEPTH // len(pushes))
        self._queues: list[queue.Queue[_Out | None]] = [queue.Queue(depth) for _ in pushes]
        self._turn = 0
        self._closed = threading.Event()
        self._error: str | None = None
        self._reason = "error"
        self.stats = SendStats()
        n = ctx.compat.num_layers
        self._crc = [0] * (2 * n) if ctx.checksums else []
        timeout = (
            max(5.0, target.deadline_unix - time.time() + 5.0) if target.deadline_unix else 600
        )
        self._futures = [
            push.future(self._messages(q), metadata=auth_metadata(ctx.token), timeout=timeout)
            for push, q in zip(pushes, self._queues, strict=True)
        ]

    def _messages(self, q: queue.Queue[_Out | None]) -> Iterator[_Out]:
        while True:
            try:
                item = q.get(timeout=0.05)
            except queue.Empty:
                if self._closed.is_set():
                    return
                continue
            if item is None:
                return
            yield item

    def _fail(self, message: str, reason: str) -> None:
        if self._error is None:
            self._error, self._reason = message, reason
        self.abort(message)

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_token: int) -> None:
        if self._error is not None or self._closed.is_set():
            return
        try:
            self._faults.maybe_fail(f"layer {layer}")
        except InjectedFault as e:
            self._fail(str(e), "injected")
            return
        if not self.stats.first_send:
            self.stats.first_send = time.monotonic()
        n = int(k.shape[0])
        # the engine hands over fresh tensors: keep them as they are (views are copied)
        kt, vt = owned(k).cpu(), owned(v).cpu()
        kall, vall = as_bytes(kt), as_bytes(vt)
        if self._crc:
            self._crc[2 * layer] = zlib.crc32(kall, self._crc[2 * layer])
            self._crc[2 * layer + 1] = zlib.crc32(vall, self._crc[2 * layer + 1])
        per_token = len(kall) // n if n else 1
        starts = token_chunks(n, 2 * per_token)
        corrupt = self._faults.should_corrupt()
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else n
            lo, hi = s * per_token, end * per_token
            kb, vb = kall[lo:hi], vall[lo:hi]
            span = kvwire.KVSpan(
                request_id=self._t.request_id,
                lease_id=self._t.lease_id,
                layer=layer,
                start_token=start_token + s,
                num_tokens=end - s,
                compat_hash=self._t.compat_hash,
            )
            if self._ctx.checksums:
                span.crc32 = zlib.crc32(vb, zlib.crc32(kb))
            parts: tuple[memoryview | bytes, ...] = (kb, vb)
            if corrupt and i == 0:
                parts = (self._faults.corrupt(bytes(kb)), vb)
            if not self._put(_Out(span, parts)):
                return
            self.stats.bytes_sent += len(kb) + len(vb)
        self.stats.layers_sent = max(self.stats.layers_sent, layer + 1)

    def _put(self, out: _Out) -> bool:
        """Queue ``out`` on the next stream in turn (spans of a layer may arrive out of
        order; the receiver counts them, it does not expect them in sequence)."""
        i = self._turn
        self._turn = (i + 1) % len(self._queues)
        deadline = time.monotonic() + PUT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._futures[i].done():
                why = self._describe(self._futures[i])
                self._fail(f"the decode worker ended the KV stream: {why}", "stream")
                return False
            try:
                self._queues[i].put(out, timeout=0.05)
                return True
            except queue.Full:
                continue
        self._fail(f"no room on the KV stream for {PUT_TIMEOUT_S:.0f} s", "timeout")
        return False

    @staticmethod
    def _describe(future: grpc.Future) -> str:
        try:
            exc = future.exception() if future.done() else None
        except grpc.FutureCancelledError:
            return "cancelled"
        except grpc.FutureTimeoutError:
            return "still running"
        if isinstance(exc, grpc.RpcError):
            return f"{exc.code().name}: {exc.details()}"
        return repr(exc) if exc else "ended early"

    def _end_streams(self, deadline: float) -> None:
        for q, future in zip(self._queues, self._futures, strict=True):
            while time.monotonic() < deadline and not future.done():
                try:
                    q.put(None, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def finish(self, timeout: float) -> SendStats:
        if self._error is None:
            deadline = time.monotonic() + timeout
            self._end_streams(deadline)
            layers = 0
            for future in self._futures:
                try:
                    ack = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except grpc.FutureTimeoutError:
                    msg = f"the decode worker did not acknowledge within {timeout} s"
                    self._fail(msg, "timeout")
                    break
                except grpc.RpcError as err:
                    self._fail(f"KV push failed: {err.code().name}: {err.details()}", "stream")
                    break
                # each stream reports the layers complete when it ended; the last one all
                layers = max(layers, ack.layers_received)
            else:
                self.stats.done = time.monotonic()
                if layers < self._ctx.compat.num_layers:
                    self._fail(
                        f"the decode worker holds {layers} of "
                        f"{self._ctx.compat.num_layers} layers after the push",
                        "incomplete",
                    )
        self._closed.set()
        if self._error is not None:
            raise TransferError(self._error, self._reason)
        self.stats.layer_crc32 = list(self._crc)
        return self.stats

    def abort(self, reason: str) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._error is None:
            self._error, self._reason = f"aborted: {reason}", "aborted"
        for future in self._futures:
            future.cancel()


class GrpcSenderBackend:
    name = "grpc"

    def __init__(self, ctx: BackendContext) -> None:
        self._ctx = ctx
        self._channels = _Channels()
        self.streams = ctx.streams or default_streams()
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"KV streams must be 1 to {MAX_STREAMS}, got {self.streams}")

    def open(self, target: TransferTarget) -> GrpcSender:
        pushes = self._channels.push_methods(target.decode_address, self.streams)
        return GrpcSender(target, self._ctx, pushes)

    def close(self) -> None:
        self._channels.close()


class GrpcReceiver:
    """Writes pushed spans into the reserved blocks; layers are complete once all tokens came."""

    name = "grpc"

    def __init__(self, ctx: BackendContext) -> None:
        assert ctx.pool is not None and ctx.leases is not None
        self._ctx = ctx
        self._pool: PoolView = ctx.pool
        self._leases: LeaseTable = ctx.leases
        self._cond = threading.Condition()

    def backend_metadata(self) -> bytes:
        return b""

    def write(self, lease: Lease, msg: kvwire.KVSpan) -> None:
        """Check and place one span. Raises TransferError (reason ``checksum``/``shape``)."""
        if msg.crc32 is not None and zlib.crc32(msg.data) != msg.crc32:
            raise TransferError(
                f"KV layer {msg.layer} tokens {msg.start_token}+{msg.num_tokens} of request "
                f"{msg.request_id!r} failed its checksum",
                "checksum",
            )
        n = msg.num_tokens
        if not (0 <= msg.layer < lease.num_layers and msg.start_token >= 0
                and msg.start_token + max(n, 0) <= lease.num_tokens):  # fmt: skip
            # checked before any byte is written: out-of-range indices would wrap around
            raise TransferError(
                f"KV layer {msg.layer} tokens {msg.start_token}+{n} of request "
                f"{msg.request_id!r} fall outside its reservation ({lease.num_layers} layers, "
                f"{lease.num_tokens} tokens)",
                "shape",
            )
        expected = 2 * n * self._pool.token_bytes
        if len(msg.data) != expected:
            raise TransferError(
                f"KV layer {msg.layer}: {len(msg.data)} bytes for {n} tokens, expected "
                f"{expected} ([2, {n}, {self._pool.kv_heads}, {self._pool.head_dim}] "
                f"{self._pool.dtype})",
                "shape",
            )
        if n:
            with warnings.catch_warnings():
                # received bytes are immutable; the view over them is only ever read
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(msg.data, dtype=self._pool.dtype)
            kv = flat.view(2, n, self._pool.kv_heads, self._pool.head_dim)
            self._pool.write(msg.layer, lease.block_ids, msg.start_token, kv[0], kv[1])
        self._leases.add_span(lease, msg.layer, msg.start_token, n, len(msg.data), renew=True)
        if lease.complete:
            with self._cond:
                self._cond.notify_all()

    def wait_layers(self, lease: Lease, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: lease.complete, timeout=timeout)

    def forget(self, lease: Lease) -> None:
        return None

    def close(self) -> None:
        return None


def make_sender_backend(ctx: BackendContext) -> GrpcSenderBackend:
    return GrpcSenderBackend(ctx)


def make_receiver_backend(ctx: BackendContext) -> GrpcReceiver:
    return GrpcReceiver(ctx)
