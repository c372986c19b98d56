"""The ``grpc`` KV backend: layers streamed over a client-streaming ``PushKV`` call.

Prefill side: ``send_layer`` keeps the layer's K and V tensors (the engine hands over
fresh ones; a view is copied) and queues spans of about 4 MiB on bounded queues; a thread
per stream writes each span to the socket as one gRPC message whose payload frames point
at the tensors (:mod:`.push_client`: no copy in this process), so the push overlaps the
next layer's compute, and a slow receiver holds the engine back instead of buffering
without bound. A push runs as ``streams`` concurrent calls, each on its own connection,
the spans dealt to them in turn (:func:`default_streams`).

Decode side: the push port (:mod:`.push_server`, named in the Reserve answer) reads each
message's fields, then receives its payload straight into the reserved blocks of the pool
(:meth:`GrpcReceiver.views`); the worker's own gRPC server serves the same call for any
other client, parsing each message without copying its payload (:func:`kvwire.decode`)
and copying it once into the blocks (:meth:`GrpcReceiver.write`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass

import grpc
import torch
from splitserve.grpc_options import auth_metadata
from splitserve.v1 import worker_pb2

from splitserve_worker.kv import kvwire
from splitserve_worker.kv.faults import FaultInjector, InjectedFault
from splitserve_worker.kv.grpc_receiver import GrpcReceiver, push_port
from splitserve_worker.kv.layout import as_bytes, owned, token_chunks
from splitserve_worker.kv.push_client import Call, CallError, Connection
from splitserve_worker.kv.transport import (
    MAX_STREAMS,
    BackendContext,
    SendStats,
    TransferError,
    TransferTarget,
)

QUEUE_DEPTH = 16
"""Messages (~4 MiB each) queued between the engine thread and the wire, all streams
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


def push_address(decode_address: str, metadata: bytes) -> tuple[str, int]:
    """Where a push goes: the decode worker's push port when its handle names one, else
    its gRPC port (any gRPC server serving PushKV takes the same calls)."""
    host, _, port = decode_address.rpartition(":")
    host = host.strip("[]")
    port_of_push = push_port(metadata)
    if port_of_push is not None:
        return host, port_of_push
    return host, int(port)


class _Connections:
    """``streams`` connections per decode push address, shared by every push to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, int, int], Connection] = {}

    def get(self, host: str, port: int, i: int) -> Connection:
        key = (host, port, i)
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and conn.usable:
                return conn
            # connections that broke (a decode worker gone) are let go here
            gone = [k for k, c in self._conns.items() if c.broken is not None and k != key]
            stale = [self._conns.pop(k) for k in gone]
        for c in stale:
            c.close()
        fresh = Connection(host, port)  # outside the lock: a dead host stalls no other push
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and conn.usable:
                fresh.close()
                return conn
            self._conns[key] = fresh
        if conn is not None:
            conn.close()
        return fresh

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.close()


class GrpcSender:
    def __init__(
        self, target: TransferTarget, ctx: BackendContext, conns: _Connections, streams: int
    ) -> None:
        self._t = target
        self._ctx = ctx
        self._faults = FaultInjector(ctx.faults)
        depth = max(2, QUEUE_DEPTH // streams)
        self._queues: list[queue.Queue[_Out | None]] = [queue.Queue(depth) for _ in range(streams)]
        self._turn = 0
        self._closed = threading.Event()
        self._error: str | None = None
        self._reason = "error"
        self.stats = SendStats()
        n = ctx.compat.num_layers
        self._crc = [0] * (2 * n) if ctx.checksums else []
        self._timeout = (
            max(5.0, target.deadline_unix - time.time() + 5.0) if target.deadline_unix else 600
        )
        self._calls: list[Call] = []
        try:
            host, port = push_address(target.decode_address, target.backend_metadata)
            for i in range(streams):
                conn = conns.get(host, port, i)
                self._calls.append(conn.call(PUSH_METHOD, auth_metadata(ctx.token), self._timeout))
        except (CallError, ValueError) as e:
            self._fail(f"cannot open the KV stream to {target.decode_address}: {e}", "stream")
            return
        for q, call in zip(self._queues, self._calls, strict=True):
            threading.Thread(target=self._pump, args=(q, call), daemon=True,
                             name=f"kv-send-{target.request_id}").start()  # fmt: skip

    def _pump(self, q: queue.Queue[_Out | None], call: Call) -> None:
        """Writes this stream's messages to the wire until the end marker (or a failure,
        which ``_put`` and ``finish`` see on the call)."""
        try:
            while True:
                try:
                    item = q.get(timeout=0.05)
                except queue.Empty:
                    if self._closed.is_set():
                        return
                    continue
                if item is None:
                    call.close_send()
                    return
                size = sum(len(p) for p in item.parts)
                call.send([kvwire.encode_head(item.span, size), *item.parts], self._timeout)
        except CallError:
            return

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
            if self._calls[i].done():
                why = self._calls[i].error or "it answered before the end"
                self._fail(f"the decode worker ended the KV stream: {why}", "stream")
                return False
            try:
                self._queues[i].put(out, timeout=0.05)
                return True
            except queue.Full:
                continue
        self._fail(f"no room on the KV stream for {PUT_TIMEOUT_S:.0f} s", "timeout")
        return False

    def _end_streams(self, deadline: float) -> None:
        for q, call in zip(self._queues, self._calls, strict=True):
            while time.monotonic() < deadline and not call.done():
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
            for call in self._calls:
                try:
                    raw = call.result(timeout=max(0.0, deadline - time.monotonic()))
                except CallError as err:
                    if err.code is grpc.StatusCode.DEADLINE_EXCEEDED and not call.done():
                        msg = f"the decode worker did not acknowledge within {timeout} s"
                        self._fail(msg, "timeout")
                    else:
                        self._fail(f"KV push failed: {err}", "stream")
                    break
                # each stream reports the layers complete when it ended; the last one all
                layers = max(layers, worker_pb2.PushKVAck.FromString(raw).layers_received)
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
        for call in self._calls:
            call.cancel()


class GrpcSenderBackend:
    name = "grpc"

    def __init__(self, ctx: BackendContext) -> None:
        self._ctx = ctx
        self._conns = _Connections()
        self.streams = ctx.streams or default_streams()
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"KV streams must be 1 to {MAX_STREAMS}, got {self.streams}")

    def open(self, target: TransferTarget) -> GrpcSender:
        return GrpcSender(target, self._ctx, self._conns, self.streams)

    def close(self) -> None:
        self._conns.close()


def make_sender_backend(ctx: BackendContext) -> GrpcSenderBackend:
    return GrpcSenderBackend(ctx)


def make_receiver_backend(ctx: BackendContext) -> GrpcReceiver:
    return GrpcReceiver(ctx)
