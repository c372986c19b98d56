"""The decode side of the ``grpc`` KV backend: spans into the reserved blocks.

Two ways in: :meth:`GrpcReceiver.write` places a whole received message (the worker's
gRPC server, or the push port's messages it could not place as they arrived), and
:meth:`GrpcReceiver.views` / :meth:`GrpcReceiver.placed` let the push port
(:mod:`.push_server`) receive a payload straight into the blocks. Writes off the event
loop are registered (:meth:`GrpcReceiver.begin_placing`) so that a lease dropped
meanwhile frees its blocks only once nothing can land in them any more.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Callable

import torch

from splitserve_worker.kv import kvwire
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseTable
from splitserve_worker.kv.transport import BackendContext, TransferError

PUSH_PORT_KEY = b"push-port="


def push_metadata(port: int) -> bytes:
    """What a Reserve handle carries for the ``grpc`` backend: the decode worker's push port."""
    return PUSH_PORT_KEY + str(port).encode()


def push_port(metadata: bytes) -> int | None:
    """The push port a Reserve handle names, if any."""
    if not metadata.startswith(PUSH_PORT_KEY):
        return None
    return int(metadata[len(PUSH_PORT_KEY) :])


PLACING_GRACE_S = 2.0
"""How long a dropped lease waits for a message being received into its blocks before
that message's connection is cut."""


class GrpcReceiver:
    """Writes pushed spans into the reserved blocks; layers are complete once all tokens came."""

    name = "grpc"

    def __init__(self, ctx: BackendContext) -> None:
        assert ctx.pool is not None and ctx.leases is not None
        self._ctx = ctx
        self._pool: PoolView = ctx.pool
        self._leases: LeaseTable = ctx.leases
        self._cond = threading.Condition()
        self._placing: dict[str, list[Callable[[], None]]] = {}
        self.push_port: int | None = None
        """The decode worker's push port, once it listens (named in Reserve answers)."""

    def backend_metadata(self) -> bytes:
        return push_metadata(self.push_port) if self.push_port else b""

    def _check(self, lease: Lease, msg: kvwire.KVSpan, size: int) -> None:
        """Whether ``size`` payload bytes of ``msg`` fit its reservation (TransferError
        ``shape`` if not): checked before any byte is written, since out-of-range indices
        would wrap around."""
        n = msg.num_tokens
        if not (0 <= msg.layer < lease.num_layers and msg.start_token >= 0
                and msg.start_token + max(n, 0) <= lease.num_tokens):  # fmt: skip
            raise TransferError(
                f"KV layer {msg.layer} tokens {msg.start_token}+{n} of request "
                f"{msg.request_id!r} fall outside its reservation ({lease.num_layers} layers, "
                f"{lease.num_tokens} tokens)",
                "shape",
            )
        expected = 2 * n * self._pool.token_bytes
        if size != expected:
            raise TransferError(
                f"KV layer {msg.layer}: {size} bytes for {n} tokens, expected "
                f"{expected} ([2, {n}, {self._pool.kv_heads}, {self._pool.head_dim}] "
                f"{self._pool.dtype})",
                "shape",
            )

    def _bad_checksum(self, msg: kvwire.KVSpan) -> TransferError:
        return TransferError(
            f"KV layer {msg.layer} tokens {msg.start_token}+{msg.num_tokens} of request "
            f"{msg.request_id!r} failed its checksum",
            "checksum",
        )

    def _landed(self, lease: Lease, msg: kvwire.KVSpan, size: int) -> None:
        self._leases.add_span(lease, msg.layer, msg.start_token, msg.num_tokens, size,
                              renew=True)  # fmt: skip
        if lease.complete:
            with self._cond:
                self._cond.notify_all()

    def write(self, lease: Lease, msg: kvwire.KVSpan) -> None:
        """Check and place one span. Raises TransferError (reason ``checksum``/``shape``)."""
        if msg.crc32 is not None and zlib.crc32(msg.data) != msg.crc32:
            raise self._bad_checksum(msg)
        self._check(lease, msg, len(msg.data))
        n = msg.num_tokens
        if n:
            with warnings.catch_warnings():
                # received bytes are immutable; the view over them is only ever read
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(msg.data, dtype=self._pool.dtype)
            kv = flat.view(2, n, self._pool.kv_heads, self._pool.head_dim)
            self._pool.write(msg.layer, lease.block_ids, msg.start_token, kv[0], kv[1])
        self._landed(lease, msg, len(msg.data))

    def views(self, lease: Lease, head: kvwire.KVSpan, size: int) -> list[memoryview] | None:
        """Where the ``size`` payload bytes of the message ``head`` go, in the reserved
        blocks (the push port receives them there); None if the pool cannot be written
        that way (not in host memory). Raises TransferError as :meth:`write` does."""
        self._check(lease, head, size)
        return self._pool.byte_views(head.layer, lease.block_ids, head.start_token,
                                     head.num_tokens)  # fmt: skip

    def placed(self, lease: Lease, head: kvwire.KVSpan, views: list[memoryview]) -> None:
        """The payload of ``head`` arrived in ``views`` (from :meth:`views`). A corrupt one
        raises TransferError: the blocks it landed in are freed with the lease."""
        if head.crc32 is not None:
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            if crc != head.crc32:
                raise self._bad_checksum(head)
        self._landed(lease, head, sum(len(v) for v in views))

    def wait_layers(self, lease: Lease, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: lease.complete, timeout=timeout)

    def forget(self, lease: Lease) -> None:
        return None

    # ---- writes off the event loop (the push port's connection threads) ----
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
