"""The decode side of the KV handoff: Reserve, the incoming KV, Commit, and the lease reaper.

Blocks are held in the engine under the request id; this module tracks them in a
:class:`LeaseTable` and frees them (``engine.release``) on every way out: Release, Cancel,
a broken or corrupt push, a failed Commit, lease expiry, or an admit that fails. Once a
Generate stream admits the sequence, the engine owns the blocks and frees them when the
request finishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.client import top_from_proto
from splitserve_worker.kv import compat as compat_mod
from splitserve_worker.kv.compat import Compat, CompatError
from splitserve_worker.kv.faults import Holds
from splitserve_worker.kv.grpc_receiver import GrpcReceiver
from splitserve_worker.kv.kvwire import KVSpan
from splitserve_worker.kv.layout import PoolView, as_bytes
from splitserve_worker.kv.lease import Lease, LeaseError, LeaseTable, State
from splitserve_worker.kv.transport import ReceiverBackend, TransferError
from splitserve_worker.server.convert import compat_from_proto, compat_to_proto
from splitserve_worker.server.errors import RpcFailure

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.2
STALLED_PUSH_S = 5.0
"""A push that sent nothing this long past its lease's expiry loses the lease: its blocks
are freed though the call is still open (its next message is refused)."""
NIXL_GRACE_S = 5.0
"""A NIXL write cannot be recalled: blocks of an expired NIXL lease wait this much longer
(the sender stops posting at the lease's expiry) before they can be reused."""


class DecodeHandoff:
    def __init__(
        self,
        engine: Any,
        compat: Compat,
        pool: PoolView,
        leases: LeaseTable,
        receivers: dict[str, ReceiverBackend],
        *,
        default_backend: str,
        lease_seconds: float,
        address: str,
        metrics: Metrics,
        holds: Holds | None = None,
    ) -> None:
        self.engine = engine
        self.holds = holds or Holds()
        self.compat = compat
        self.pool = pool
        self.leases = leases
        self.receivers = receivers
        self.default_backend = default_backend
        self.lease_seconds = lease_seconds
        self.address = address
        self._committed: dict[str, asyncio.Event] = {}
        self._busy: dict[str, int] = {}
        self._background: set[asyncio.Future[int]] = set()
        self._bytes = metrics.counter(names.KV_TRANSFER_BYTES)
        self._failures = metrics.counter(names.KV_TRANSFER_FAILURES)

    # ---- Reserve / Release ----
    async def reserve(self, req: pb.ReserveRequest) -> pb.TransferHandle:
        if req.HasField("compat"):
            try:
                compat_mod.check(self.compat, compat_from_proto(req.compat), peer="the caller")
            except CompatError as e:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        backend = req.kv_backend or self.default_backend
        if backend not in self.receivers:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this worker accepts KV over {sorted(self.receivers)}, not {backend!r}",
            )
        if self.leases.contains(req.request_id):
            raise RpcFailure(
                grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id!r} is already reserved"
            )
        from splitserve_worker.engine.errors import NoCapacity, RequestError

        try:
            blocks = await self.engine.reserve(req.request_id, req.num_prompt_tokens)
        except NoCapacity as e:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except RequestError as e:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        ttl = req.lease_seconds if req.lease_seconds > 0 else self.lease_seconds
        lease = self.leases.add(
            req.request_id,
            blocks,
            num_tokens=req.num_prompt_tokens,
            num_layers=self.compat.num_layers,
            ttl=ttl,
            backend=backend,
        )
        self._committed[req.request_id] = asyncio.Event()
        return pb.TransferHandle(
            request_id=req.request_id,
            decode_address=self.address,
            block_ids=blocks,
            lease_id=lease.lease_id,
            lease_expires_unix=time.time() + ttl,
            kv_backend=backend,
            backend_metadata=self.receivers[backend].backend_metadata(),
            compat=compat_to_proto(self.compat),
            num_prompt_tokens=req.num_prompt_tokens,
        )

    async def drop(self, request_id: str, reason: str) -> int:
        """Forget the reservation (if any) and free whatever the request holds."""
        lease = self.leases.pop(request_id)
        ev = self._committed.pop(request_id, None)
        if ev is not None:
            ev.set()  # wake a waiting Generate: it finds the lease gone
        if lease is not None:
            self.receivers[lease.backend].forget(lease)
            if lease.backend == "grpc" and self.grpc_receiver().placing(lease):
                # a message is being received into the blocks off the loop: they are
                # freed once it has landed or its connection is cut
                quiet = await asyncio.to_thread(self.grpc_receiver().quiesce, lease)
                if not quiet:
                    log.error("a KV write into %s's blocks did not stop", request_id)
            if reason not in ("released", "finished"):
                self._failures.labels(lease.backend, reason).inc()
        freed: int = await self.engine.release(request_id)
        return freed

    # ---- the KV stream (backend grpc) ----
    def grpc_receiver(self) -> GrpcReceiver:
        r = self.receivers["grpc"]
        assert isinstance(r, GrpcReceiver)
        return r

    def check_next(self, lease: Lease, msg: KVSpan) -> None:
        """Whether a message after a push's first may still be written (any thread)."""
        if msg.lease_id != lease.lease_id or msg.request_id != lease.request_id:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT, "one PushKV stream carries one request"
            )
        if time.monotonic() >= lease.expires_at:
            raise RpcFailure(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the lease of request {lease.request_id!r} expired mid-push",
            )
        if not self.leases.holds(lease):
            # released, or dropped by another stream of the same push: its blocks may
            # already belong to someone else, so nothing more is written (each stream has
            # one writer: nothing lands between this check and its write)
            raise RpcFailure(
                grpc.StatusCode.ABORTED,
                f"the reservation of request {lease.request_id!r} was dropped mid-push",
            )

    def count_received(self, nbytes: int) -> None:
        self._bytes.labels("grpc", "received").inc(nbytes)

    async def push(self, messages: AsyncIterator[KVSpan]) -> pb.PushKVAck:
        lease: Lease | None = None
        try:
            async for msg in messages:
                if lease is None:
                    lease = self._open_push(msg)
                else:
                    self.check_next(lease, msg)
                self.grpc_receiver().write(lease, msg)
                self.count_received(len(msg.data))
                if self.holds.directory:
                    await self.holds.wait_async("receive")
        except TransferError as e:
            assert lease is not None
            await self.fail_push(lease, e)
            raise RpcFailure(grpc.StatusCode.DATA_LOSS, str(e)) from None
        except BaseException as e:
            # the sender died or the call was cancelled: free the blocks now, not at expiry
            if lease is not None:
                await asyncio.shield(self.fail_push(lease, e))
            raise
        if lease is None:
            return pb.PushKVAck()
        return await self.end_push(lease)

    async def fail_push(self, lease: Lease, error: BaseException | None) -> None:
        """A push broke: a corrupt one frees its blocks; otherwise they are freed unless the
        reservation is already gone (the request id may be reserved anew)."""
        await self._end_push(lease)
        if isinstance(error, TransferError):
            await self.drop(lease.request_id, error.reason)
        elif self.leases.holds(lease):
            await self.drop(lease.request_id, "stream")

    async def end_push(self, lease: Lease) -> pb.PushKVAck:
        await self._end_push(lease)
        return pb.PushKVAck(
            layers_received=lease.layers_complete, bytes_received=lease.bytes_received
        )

    async def open_push(self, msg: KVSpan) -> Lease:
        """:meth:`_open_push` for a push served off the event loop."""
        return self._open_push(msg)

    def _open_push(self, msg: KVSpan) -> Lease:
        try:
            lease = self.leases.get(msg.request_id, msg.lease_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        if msg.compat_hash != self.compat.hash:
            self._drop_soon(lease.request_id, "compat")
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV stream compat hash {msg.compat_hash[:16] or '(none)'} differs from this "
                f"worker's {self.compat.hash[:16]} ({self.compat.model}, {self.compat.dtype}, "
                f"block {self.compat.block_size}): start both workers with the same model, "
                "--dtype and --block-size",
            )
        if lease.backend != "grpc":
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {msg.request_id!r} was reserved for {lease.backend!r}, not grpc",
            )
        self._busy[lease.request_id] = self._busy.get(lease.request_id, 0) + 1
        return lease

    def _drop_soon(self, request_id: str, reason: str) -> None:
        task = asyncio.ensure_future(self.drop(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _end_push(self, lease: Lease) -> None:
        n = self._busy.get(lease.request_id, 0) - 1
        if n <= 0:
            self._busy.pop(lease.request_id, None)
        else:
            self._busy[lease.request_id] = n

    # ---- Commit ----
    async def commit(self, req: pb.CommitRequest) -> None:
        try:
            lease = self.leases.get(req.request_id, req.lease_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        receiver = self.receivers[lease.backend]
        wait = max(0.0, lease.expires_at - time.monotonic())
        arrived = await asyncio.to_thread(receiver.wait_layers, lease, wait)
        if not arrived:
            await self.drop(lease.request_id, "incomplete")
            raise RpcFailure(
                grpc.StatusCode.DATA_LOSS,
                f"request {req.request_id!r}: {lease.layers_complete} of {lease.num_layers} "
                "layers arrived before the lease expired; its blocks are freed",
            )
        if req.layer_crc32:
            bad = await asyncio.to_thread(self._bad_layers, lease, list(req.layer_crc32))
            if bad:
                await self.drop(lease.request_id, "checksum")
                raise RpcFailure(
                    grpc.StatusCode.DATA_LOSS,
                    f"request {req.request_id!r}: KV of layers {bad} failed its checksum; "
                    "its blocks are freed",
                )
        first_logprob = req.first_token_logprob
        # gRPC counts its bytes as they arrive; the others once, at their first Commit
        counted = lease.backend == "grpc" or lease.state is not State.RESERVED
        first_top = top_from_proto(req.first_top_logprobs)
        prompt = req.prompt_logprobs if req.HasField("prompt_logprobs") else None
        self.leases.commit(lease, req.first_token, first_logprob, first_top, prompt)
        if not counted:
            self._bytes.labels(lease.backend, "received").inc(lease.bytes_received)
        lease.expires_at = max(lease.expires_at, time.monotonic() + self.lease_seconds)
        ev = self._committed.get(req.request_id)
        if ev is not None:
            ev.set()

    def _bad_layers(self, lease: Lease, crcs: Sequence[int]) -> list[int]:
        if len(crcs) != 2 * lease.num_layers:
            return list(range(lease.num_layers))
        bad = []
        for layer in range(lease.num_layers):
            k, v = self.pool.read(layer, lease.block_ids, 0, lease.num_tokens)
            if zlib.crc32(as_bytes(k)) != crcs[2 * layer] or (
                zlib.crc32(as_bytes(v)) != crcs[2 * layer + 1]
            ):
                bad.append(layer)
        return bad

    # ---- Generate with remote KV ----
    async def admit(
        self, request_id: str, prompt: list[int], sampling: Any
    ) -> tuple[Lease, AsyncIterator[Any]]:
        """Wait for the Commit, then hand the blocks to the engine's decode batch."""
        try:
            lease = self.leases.get(request_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        ev = self._committed.get(request_id)
        remaining = max(0.0, lease.expires_at - time.monotonic())
        if ev is not None and lease.state is State.RESERVED:
            try:
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            except TimeoutError:
                await self.drop(request_id, "lease_expired")
                raise RpcFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {request_id!r}: no Commit before the lease expired",
                ) from None
        lease_now = self.leases.pop(request_id)
        self._committed.pop(request_id, None)
        if lease_now is None or lease_now.state is not State.COMMITTED:
            await self.engine.release(request_id)
            raise RpcFailure(
                grpc.StatusCode.ABORTED,
                f"request {request_id!r} was released before its KV was committed",
            )
        self.receivers[lease_now.backend].forget(lease_now)
        from splitserve_worker.engine.errors import RequestError, UnknownRequest

        try:
            stream = await self.engine.admit_prefilled(
                request_id, prompt, lease_now.first_token, lease_now.first_logprob, sampling
            )
        except (RequestError, UnknownRequest) as e:
            await self.engine.release(request_id)
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return lease_now, stream

    # ---- reaper ----
    async def reap_once(self) -> int:
        now = time.monotonic()
        n = 0
        for lease in self.leases.leases():
            grace = NIXL_GRACE_S if lease.backend == "nixl" else 0.0
            if lease.state is State.ATTACHED or now < lease.expires_at + grace:
                continue
            if self._busy.get(lease.request_id) and now < lease.expires_at + STALLED_PUSH_S:
                continue  # the push handler sees the expiry at its next message
            # (each span renews the lease: one this far past expiry has a sender that
            # stopped sending; a write under way into the blocks is waited for)
            await self.drop(lease.request_id, "lease_expired")
            n += 1
        return n

    async def reap_forever(self) -> None:
        while True:
            try:
                await self.reap_once()
            except Exception:  # keep reaping whatever one release did
                log.exception("lease reaper")
            await asyncio.sleep(REAP_INTERVAL_S)
