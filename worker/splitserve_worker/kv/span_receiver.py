"""The decode side of the ``tcp`` and ``grpc`` backends: spans checked, then placed in the
reserved blocks.

A span is tokens ``[start, start + count)`` of one layer, K then V, in every KV head of
the pool or in some of them (``heads``: a prefill rank pushing its own heads into a pool
that holds more). Two ways in:

- :meth:`SpanReceiver.views` / :meth:`SpanReceiver.placed`: the ``tcp`` port receives a
  payload of every head straight into the pool's bytes (one copy, by the kernel);
- :meth:`SpanReceiver.write`: a payload already in memory (a ``PushKV`` message from the
  worker's gRPC server, a span of some heads, whose tokens are not contiguous in the
  pool, or a pool off the host that cannot be read into) is copied in.

Both check the span against its reservation before any byte moves, verify its crc32
when it carries one, and renew the lease (a push that keeps arriving stays alive; one
that stops for a lease's length is given up). Writes off the event loop are registered
(:meth:`begin_placing`) so that a lease dropped meanwhile frees its blocks only once
nothing can land in them any more (:meth:`quiesce`).
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Callable

import torch

from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseTable
from splitserve_worker.kv.transport import BackendContext, TransferError

PLACING_GRACE_S = 2.0
"""How long a dropped lease waits for a span being received into its blocks before that
span's connection is cut."""


class SpanReceiver:
    """Writes pushed spans into the reserved blocks; a layer is complete once all its
    tokens came."""

    def __init__(self, ctx: BackendContext, name: str) -> None:
        assert ctx.pool is not None and ctx.leases is not None
        self.name = name
        self._pool: PoolView = ctx.pool
        self._leases: LeaseTable = ctx.leases
        self._cond = threading.Condition()
        self._placing: dict[str, list[Callable[[], None]]] = {}
        self.metadata = b""
        """What Reserve answers carry for this backend (the tcp port, once it listens)."""

    def backend_metadata(self) -> bytes:
        return self.metadata

    def check(self, lease: Lease, layer: int, start: int, count: int, nbytes: int,
              heads: range | None = None) -> None:  # fmt: skip
        """Whether ``nbytes`` of tokens ``[start, start + count)`` of ``layer`` in KV heads
        ``heads`` of the pool (None: all) fit the reservation (TransferError ``shape`` if
        not): checked before any byte is written, since out-of-range indices would wrap
        around."""
        if not (0 <= layer < lease.num_layers and start >= 0 and count >= 0
                and start + count <= lease.num_tokens):  # fmt: skip
            raise TransferError(
                f"KV layer {layer} tokens {start}+{count} of request {lease.request_id!r} "
                f"fall outside its reservation ({lease.num_layers} layers, "
                f"{lease.num_tokens} tokens)",
                "shape",
            )
        pool = self._pool
        nh = pool.kv_heads
        if heads is not None:
            if not 0 <= heads.start < heads.stop <= pool.kv_heads:
                raise TransferError(
                    f"KV layer {layer}: heads {heads.start}..{heads.stop} of a pool of "
                    f"{pool.kv_heads} (request {lease.request_id!r}): the prefill worker "
                    "pushes heads this worker does not hold",
                    "shape",
                )
            nh = len(heads)
        expected = 2 * count * nh * pool.head_dim * pool.pool.element_size()
        if nbytes != expected:
            raise TransferError(
                f"KV layer {layer}: {nbytes} bytes for {count} tokens, expected {expected} "
                f"([2, {count}, {nh}, {pool.head_dim}] {pool.dtype})",
                "shape",
            )

    def _bad_checksum(self, lease: Lease, layer: int, start: int, count: int) -> TransferError:
        return TransferError(
            f"KV layer {layer} tokens {start}+{count} of request {lease.request_id!r} failed "
            "its checksum",
            "checksum",
        )

    def _landed(self, lease: Lease, layer: int, start: int, count: int, nbytes: int,
                heads: range | None) -> None:  # fmt: skip
        self._leases.add_span(lease, layer, start, count, nbytes, renew=True, heads=heads)
        if lease.complete:
            with self._cond:
                self._cond.notify_all()

    def write(self, lease: Lease, layer: int, start: int, count: int, data: memoryview,
              crc32: int | None, heads: range | None = None) -> None:  # fmt: skip
        """Check and place one span (of KV heads ``heads`` of the pool, None: all) whose
        payload is ``data``. Raises TransferError (reason ``checksum`` or ``shape``)."""
        if crc32 is not None and zlib.crc32(data) != crc32:
            raise self._bad_checksum(lease, layer, start, count)
        self.check(lease, layer, start, count, len(data), heads)
        if count:
            with warnings.catch_warnings():
                # received bytes may be immutable; the view over them is only ever read
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(data, dtype=self._pool.dtype)
            nh = self._pool.kv_heads if heads is None else len(heads)
            kv = flat.view(2, count, nh, self._pool.head_dim)
            self._pool.write(layer, lease.block_ids, start, kv[0], kv[1], heads)
        self._landed(lease, layer, start, count, len(data), heads)

    def views(self, lease: Lease, layer: int, start: int, count: int, nbytes: int,
              heads: range | None = None) -> list[memoryview] | None:  # fmt: skip
        """Where the ``nbytes`` of the span go in the reserved blocks (K, then V); None if
        the pool cannot be written that way (not in host memory, or a span of some heads:
        :meth:`write` places it). Raises TransferError as :meth:`write` does."""
        self.check(lease, layer, start, count, nbytes, heads)
        if heads is not None and len(heads) != self._pool.kv_heads:
            return None
        return self._pool.byte_views(layer, lease.block_ids, start, count)

    def placed(self, lease: Lease, layer: int, start: int, count: int,
               views: list[memoryview], crc32: int | None) -> None:  # fmt: skip
        """The span's payload (of every head) arrived in ``views`` (from :meth:`views`). A
        corrupt one raises TransferError: the blocks it landed in are freed with the
        lease."""
        if crc32 is not None:
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            if crc != crc32:
                raise self._bad_checksum(lease, layer, start, count)
        self._landed(lease, layer, start, count, sum(len(v) for v in views), None)

    def wait_layers(self, lease: Lease, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: lease.complete, timeout=timeout)

    def forget(self, lease: Lease) -> None:
        return None

    # ---- writes off the event loop (the tcp port's connection threads) ----
    def begin_placing(self, lease: Lease, abort: Callable[[], None]) -> bool:
        """Mark a write into ``lease``'s blocks under way, if the lease still holds them
        (False: it is gone, write nothing). ``abort`` cuts the write short (it closes the
        connection the bytes come from)."""
        with self._cond:
            if not self._leases.holds(lease):
                return False
            self._placing.setdefault(lease.lease_id, []).append(abort)
            return True

    def end_placing(self, lease: Lease, abort: Callable[[], None]) -> None:
        with self._cond:
            aborts = self._placing.get(lease.lease_id, [])
            if abort in aborts:
                aborts.remove(abort)
            if not aborts:
                self._placing.pop(lease.lease_id, None)
            self._cond.notify_all()

    def placing(self, lease: Lease) -> bool:
        with self._cond:
            return lease.lease_id in self._placing

    def quiesce(self, lease: Lease, grace: float | None = None) -> bool:
        """For a lease just taken out of the table, before its blocks are freed: wait for
        the writes under way to end, cutting off their connections after ``grace``
        (default :data:`PLACING_GRACE_S`). Nothing lands in the blocks after this returns
        True."""
        grace = PLACING_GRACE_S if grace is None else grace

        def idle() -> bool:
            return lease.lease_id not in self._placing

        with self._cond:
            if self._cond.wait_for(idle, grace):
                return True
            aborts = list(self._placing.get(lease.lease_id, []))
        for abort in aborts:
            abort()
        with self._cond:
            return self._cond.wait_for(idle, grace)

    def close(self) -> None:
        return None


def make_tcp_receiver(ctx: BackendContext) -> SpanReceiver:
    return SpanReceiver(ctx, "tcp")


def make_grpc_receiver(ctx: BackendContext) -> SpanReceiver:
    return SpanReceiver(ctx, "grpc")
