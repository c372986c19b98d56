"""The prefill side of the ``tcp`` and ``grpc`` backends: layers cut into spans, dealt to
the push's streams, written by a thread per stream.

``send_layer`` keeps the layer's K and V tensors in host memory (the engine hands over
fresh ones; a view is copied; a device layer is copied into pinned memory on a side
stream, :mod:`.staging`, which the engine thread does not wait for), takes their crc32
when checksums are on (every span, or the one span in N a :class:`SpanSampler` picks;
waiting for that copy: checksums cost a pass over what they cover), and queues spans of about
4 MiB (:data:`~.layout.CHUNK_BYTES`) on bounded queues, one per stream, in turn: the push
overlaps the next layer's compute, and a slow receiver holds the engine back instead of
buffering without bound. Each stream (a connection, a gRPC call: :class:`Stream`) writes
its spans from the tensors themselves, once their copy is done, then ends its part of the
push and reports the layers the decode side holds.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve_worker.kv.faults import FaultInjector, InjectedFault
from splitserve_worker.kv.layout import as_bytes, token_chunks
from splitserve_worker.kv.staging import DONE, HostStaging, Ready, Stager
from splitserve_worker.kv.transport import BackendContext, SendStats, TransferError, TransferTarget

QUEUE_DEPTH = 16
"""Spans (~4 MiB each) queued between the engine thread and the wire, all streams
together."""
PUT_TIMEOUT_S = 15.0
"""Longest the engine thread waits for room on a queue before declaring the push dead."""
POLL_S = 0.05


class SpanSampler:
    """Which spans carry a crc32 when checksums are sampled: one in ``every`` (0: none),
    counted over every push of one backend, so pushes shorter than ``every`` spans are
    checked in turn. Safe from any thread."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"checksum_every must be >= 0, got {every}")
        self.every = every
        self._count = itertools.count()

    def take(self) -> bool:
        return self.every > 0 and next(self._count) % self.every == 0


@dataclass(frozen=True)
class SpanOut:
    """One span waiting for the wire: tokens ``[start, start + count)`` of ``layer``, its
    K and V bytes (views of the tensors), their crc32 when checksums are on, and when
    those bytes hold their values."""

    layer: int
    start: int
    count: int
    parts: tuple[memoryview | bytes, ...]
    crc32: int | None
    ready: Ready = DONE

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


class Stopped(TransferError):
    """The push was aborted or failed elsewhere: a stream stops without ending it."""

    def __init__(self) -> None:
        super().__init__("the push was stopped", "aborted")


class Stream(Protocol):
    """One connection or call of a push, driven by its own thread."""

    def run(self, spans: Iterator[SpanOut]) -> int:
        """Send every span, then end this part of the push: the layers the decode side
        reports complete. Raises TransferError (the peer's refusal, a broken connection,
        :class:`Stopped` from ``spans``)."""
        ...

    def cancel(self) -> None:
        """Stop now, from any thread (a write or read under way ends)."""
        ...


def default_streams(cores: int | None = None) -> int:
    """Connections per push: 2 on hosts of 8 cores or more, else 1.

    Measured on 16 cores (``bench/kv_transfer.py --streams``): 2 streams moved 256 MiB
    about a fifth faster than 1; 4 and 8 were slower than 2, the receiving side spending
    more CPU per byte as streams contend for its interpreter. On a small host a second
    stream only takes CPU from the engines. Cores are those this process may run on."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return 2 if cores >= 8 else 1


class SpanSender:
    """A :class:`~.transport.KVSender` over ``streams``."""

    def __init__(self, target: TransferTarget, ctx: BackendContext, streams: list[Stream],
                 name: str, stager: Stager | None = None,
                 sampler: SpanSampler | None = None) -> None:  # fmt: skip
        self._t = target
        self._sampler = sampler or SpanSampler(0 if ctx.checksums else ctx.checksum_every)
        self._ctx = ctx
        self._name = name
        self._streams = streams
        self._stager = stager or HostStaging()
        self._faults = FaultInjector(ctx.faults)
        depth = max(2, QUEUE_DEPTH // len(streams))
        self._queues: list[queue.Queue[SpanOut | None]] = [queue.Queue(depth) for _ in streams]
        self._done = [threading.Event() for _ in streams]
        self._layers = [0] * len(streams)
        self._turn = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._error: str | None = None
        self._reason = "error"
        self.stats = SendStats()
        self._crc = [0] * (2 * ctx.compat.num_layers) if ctx.checksums else []
        for i in range(len(streams)):
            threading.Thread(target=self._pump, args=(i,), daemon=True,
                             name=f"kv-{name}-{target.request_id}").start()  # fmt: skip

    # ---- the streams' threads ----
    def _spans(self, i: int) -> Iterator[SpanOut]:
        q = self._queues[i]
        while True:
            try:
                item = q.get(timeout=POLL_S)
            except queue.Empty:
                if self._closed.is_set():
                    raise Stopped() from None
                continue
            if item is None:
                return
            if self._closed.is_set():
                raise Stopped()
            item.ready.wait()  # a device layer's copy to the host: the wire reads it next
            yield item

    def _pump(self, i: int) -> None:
        try:
            self._layers[i] = self._streams[i].run(self._spans(i))
        except TransferError as e:
            if not isinstance(e, Stopped):
                self._fail(str(e), e.reason)
        finally:
            self._done[i].set()

    def _fail(self, message: str, reason: str) -> None:
        with self._lock:
            if self._error is None:
                self._error, self._reason = message, reason
        self.abort(message)

    # ---- the engine's thread ----
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
        # fresh host tensors are kept as they are; device ones are being copied to the host
        kt, vt, ready = self._stager.to_host(k, v)
        kall, vall = as_bytes(kt), as_bytes(vt)
        corrupt = self._faults.should_corrupt()
        if self._crc or corrupt:
            ready.wait()  # the checksum (or the injected corruption) reads the bytes here
        if self._crc:
            self._crc[2 * layer] = zlib.crc32(kall, self._crc[2 * layer])
            self._crc[2 * layer + 1] = zlib.crc32(vall, self._crc[2 * layer + 1])
        per_token = len(kall) // n if n else 1
        starts = token_chunks(n, 2 * per_token)
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else n
            lo, hi = s * per_token, end * per_token
            kb, vb = kall[lo:hi], vall[lo:hi]
            crc = None
            if self._ctx.checksums or self._sampler.take():
                ready.wait()  # a sampled span's bytes are read here
                crc = zlib.crc32(vb, zlib.crc32(kb))
            parts: tuple[memoryview | bytes, ...] = (kb, vb)
            if corrupt and i == 0:  # after the checksum: the receiver must notice
                parts = (self._faults.corrupt(bytes(kb)), vb)
            if not self._put(SpanOut(layer, start_token + s, end - s, parts, crc, ready)):
                return
            self.stats.bytes_sent += len(kb) + len(vb)
        self.stats.layers_sent = max(self.stats.layers_sent, layer + 1)

    def _put(self, out: SpanOut) -> bool:
        """Queue ``out`` on the next stream in turn (a layer's spans may arrive out of
        order; the receiver counts them, it does not expect them in sequence)."""
        i = self._turn
        self._turn = (i + 1) % len(self._queues)
        deadline = time.monotonic() + PUT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._error is not None:
                return False
            if self._done[i].is_set():
                self._fail("the decode worker ended the KV stream before the push did", "stream")
                return False
            try:
                self._queues[i].put(out, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        self._fail(f"no room on the KV stream for {PUT_TIMEOUT_S:.0f} s", "timeout")
        return False

    def finish(self, timeout: float) -> SendStats:
        deadline = time.monotonic() + timeout
        if self._error is None:
            for q, done in zip(self._queues, self._done, strict=True):
                while time.monotonic() < deadline and not done.is_set():
                    try:
                        q.put(None, timeout=POLL_S)
                        break
                    except queue.Full:
                        continue
            for done in self._done:
                if not done.wait(max(0.0, deadline - time.monotonic())):
                    self._fail(f"the decode worker did not acknowledge within {timeout} s",
                               "timeout")  # fmt: skip
                    break
        if self._error is None:
            self.stats.done = time.monotonic()
            layers = max(self._layers)  # each stream reports the layers complete at its end
            if layers < self._ctx.compat.num_layers:
                self._fail(f"the decode worker holds {layers} of "
                           f"{self._ctx.compat.num_layers} layers after the push",
                           "incomplete")  # fmt: skip
        self._closed.set()
        if self._error is not None:
            raise TransferError(self._error, self._reason)
        self.stats.layer_crc32 = list(self._crc)
        return self.stats

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._error is None:
                self._error, self._reason = f"aborted: {reason}", "aborted"
        for stream in self._streams:
            stream.cancel()
