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
import math
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from splitserve import kv_compat as compat_mod
from splitserve import metric_names as names
from splitserve.kv_compat import Compat, CompatError
from splitserve.metric_registry import Metrics
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.client import top_from_proto
from splitserve_worker.kv.faults import Holds
from splitserve_worker.kv.kvwire import KVSpan
from splitserve_worker.kv.layout import PoolView, as_bytes
from splitserve_worker.kv.lease import Lease, LeaseError, LeaseTable, State
from splitserve_worker.kv.span_receiver import SpanReceiver
from splitserve_worker.kv.transport import SPAN_BACKENDS, ReceiverBackend, TransferError
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


class RankParts(Protocol):
    """The other tensor-parallel ranks of a decode worker whose pool is split over them
    (:class:`~splitserve_worker.server.rank_kv.RankKV`)."""

    def check_backend(self, backend: str) -> None: ...

    def handle_ranks(self, backend: str, own_metadata: bytes) -> list[pb.KVRank]: ...

    async def expect(self, lease: Lease) -> None: ...

    async def forget(self, lease: Lease) -> None: ...

    def wait_placed(self, lease: Lease, timeout: float) -> bool: ...


def check_heads(heads: range | None, msg: KVSpan) -> None:
    """A ``PushKV`` stream's spans after its first carry the first's KV heads: one push
    acknowledges one set of heads."""
    if msg.head_range != heads:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                         "one PushKV stream carries one set of KV heads")  # fmt: skip


def compat_mismatch(got: str, compat: Compat) -> RpcFailure:
    """The refusal of a ``PushKV`` stream whose compat hash is ``got``, not ``compat``'s."""
    return RpcFailure(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"KV stream compat hash {got[:16] or '(none)'} differs from this worker's "
        f"{compat.hash[:16]} ({compat.model}, {compat.dtype}, block {compat.block_size}): "
        "start both workers with the same model, --dtype and --block-size",
    )


def wrong_backend(lease: Lease, backend: str) -> RpcFailure:
    """The refusal of a push over ``backend`` into ``lease``, reserved for another one."""
    return RpcFailure(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"request {lease.request_id!r} was reserved for {lease.backend!r}, not {backend}",
    )


class _Awaited(asyncio.Event):
    """Set when a reservation is committed, or dropped (``dropped`` says why)."""

    dropped: str | None = None


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
        max_lease_seconds: float | None = None,
        ranks: RankParts | None = None,
    ) -> None:
        """``ranks``: the worker's other tensor-parallel ranks, each receiving its own KV
        heads (``pool`` is then rank 0's heads only)."""
        self.engine = engine
        self.ranks = ranks
        self.holds = holds or Holds()
        self.compat = compat
        self.pool = pool
        self.leases = leases
        self.receivers = receivers
        self.default_backend = default_backend
        self.lease_seconds = lease_seconds
        self.max_lease_seconds = max(max_lease_seconds or lease_seconds, lease_seconds)
        """Longest lease a Reserve gets, whatever it asks for."""
        self.address = address
        self._committed: dict[str, _Awaited] = {}
        self._awaiting: set[str] = set()
        """Request ids whose Generate is waiting for their Commit."""
        self._busy: dict[str, int] = {}
        self._background: set[asyncio.Future[int]] = set()
        self._bytes = metrics.counter(names.KV_TRANSFER_BYTES)
        self._failures = metrics.counter(names.KV_TRANSFER_FAILURES)

    # ---- Reserve / Release ----
    def lease_ttl(self, asked: float) -> float:
        """The lease a Reserve gets for ``asked`` seconds (0: this worker's default): at
        most :attr:`max_lease_seconds`, so no caller holds blocks until a restart."""
        if not (math.isfinite(asked) and asked >= 0):
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_seconds must be a finite number >= 0 (0: this worker's "
                f"{self.lease_seconds:g} s), got {asked}",
            )
        return min(asked or self.lease_seconds, self.max_lease_seconds)

    async def reserve(self, req: pb.ReserveRequest) -> pb.TransferHandle:
        if not req.request_id:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Reserve needs a request_id: the id its Generate and Commit will name",
            )
        if not req.HasField("compat"):
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Reserve needs the compat of the KV the caller will push (its prefill "
                "worker's Health().compat): blocks are held only for KV this worker can take",
            )
        try:
            compat_mod.check(self.compat, compat_from_proto(req.compat), peer="the caller")
        except CompatError as e:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        ttl = self.lease_ttl(req.lease_seconds)
        backend = req.kv_backend or self.default_backend
        if backend not in self.receivers:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this worker accepts KV over {sorted(self.receivers)}, not {backend!r}",
            )
        if self.ranks is not None:
            self.ranks.check_backend(backend)
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
        lease = self.leases.add(
            req.request_id,
            blocks,
            num_tokens=req.num_prompt_tokens,
            num_layers=self.compat.num_layers,
            ttl=ttl,
            backend=backend,
            kv_heads=self.pool.kv_heads,
        )
        kv_ranks: list[pb.KVRank] = []
        if self.ranks is not None:
            try:
                await self.ranks.expect(lease)
            except BaseException:
                await self.drop(req.request_id, "ranks")
                raise
            kv_ranks = self.ranks.handle_ranks(backend, self.receivers[backend].backend_metadata())
        self._committed[req.request_id] = _Awaited()
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
            kv_ranks=kv_ranks,
        )

    async def drop(self, request_id: str, reason: str) -> int:
        """Forget the reservation (if any) and free whatever the request holds."""
        lease = self.leases.pop(request_id)
        ev = self._committed.pop(request_id, None)
        if ev is not None:
            ev.dropped = reason
            ev.set()  # wake a waiting Generate: it finds the lease gone
        if lease is not None:
            receiver = self.receivers[lease.backend]
            receiver.forget(lease)
            if isinstance(receiver, SpanReceiver) and receiver.placing(lease):
                # a span is being received into the blocks off the loop: they are
                # freed once it has landed or its connection is cut
                quiet = await asyncio.to_thread(receiver.quiesce, lease)
                if not quiet:
                    log.error("a KV write into %s's blocks did not stop", request_id)
            if self.ranks is not None:
                await self.ranks.forget(lease)
            if reason not in ("released", "finished"):
                self._failures.labels(lease.backend, reason).inc()
        freed: int = await self.engine.release(request_id)
        return freed

    # ---- spans pushed over tcp or grpc ----
    def span_receiver(self, backend: str) -> SpanReceiver:
        r = self.receivers[backend]
        assert isinstance(r, SpanReceiver)
        return r

    def check_next(self, lease: Lease) -> None:
        """Whether a span after a push's first may still be written (any thread)."""
        if self.leases.now() >= lease.expires_at:
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

    def count_received(self, backend: str, nbytes: int) -> None:
        self._bytes.labels(backend, "received").inc(nbytes)

    async def push(self, messages: AsyncIterator[KVSpan]) -> pb.PushKVAck:
        """A ``PushKV`` call (backend ``grpc``), on the event loop."""
        lease: Lease | None = None
        heads: range | None = None
        try:
            async for msg in messages:
                if lease is None:
                    lease = self._open_push(msg)
                else:
                    if msg.lease_id != lease.lease_id or msg.request_id != lease.request_id:
                        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                         "one PushKV stream carries one request")  # fmt: skip
                    self.check_next(lease)
                    check_heads(heads, msg)
                heads = msg.head_range
                self.span_receiver("grpc").write(lease, msg.layer, msg.start_token,
                                                 msg.num_tokens, msg.data, msg.crc32,
                                                 heads)  # fmt: skip
                self.count_received("grpc", len(msg.data))
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
        return await self.end_push(lease, heads)

    async def fail_push(self, lease: Lease, error: BaseException | None) -> None:
        """A push broke: a corrupt one frees its blocks; otherwise they are freed unless the
        reservation is already gone (the request id may be reserved anew)."""
        await self._end_push(lease)
        if isinstance(error, TransferError):
            await self.drop(lease.request_id, error.reason)
        elif self.leases.holds(lease):
            await self.drop(lease.request_id, "stream")

    async def end_push(self, lease: Lease, heads: range | None) -> pb.PushKVAck:
        """One push of KV heads ``heads`` of the pool (None: all) ended: what its heads
        hold now."""
        await self._end_push(lease)
        return pb.PushKVAck(
            layers_received=lease.layers_complete_over(heads), bytes_received=lease.bytes_received
        )

    async def open_tcp_push(self, lease_id: str) -> Lease:
        """The first span of a lease on a tcp connection (whose hello proved the token and
        the compat hash), called on the loop from the connection's thread."""
        try:
            lease = self.leases.find(lease_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        return self._open(lease, "tcp")

    def _open(self, lease: Lease, backend: str) -> Lease:
        if lease.backend != backend:
            raise wrong_backend(lease, backend)
        self._busy[lease.request_id] = self._busy.get(lease.request_id, 0) + 1
        return lease

    def _open_push(self, msg: KVSpan) -> Lease:
        try:
            lease = self.leases.get(msg.request_id, msg.lease_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        if msg.compat_hash != self.compat.hash:
            self._drop_soon(lease.request_id, "compat")
            raise compat_mismatch(msg.compat_hash, self.compat)
        return self._open(lease, "grpc")

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
        wait = max(0.0, lease.expires_at - self.leases.now())
        arrived = await asyncio.to_thread(receiver.wait_layers, lease, wait)
        if arrived and self.ranks is not None:  # and every other rank's heads
            left = max(0.0, lease.expires_at - self.leases.now())
            arrived = await asyncio.to_thread(self.ranks.wait_placed, lease, left)
        if not arrived:
            await self.drop(lease.request_id, "incomplete")
            which = f"{lease.layers_complete} of {lease.num_layers} layers"
            if lease.complete:  # rank 0's: another rank's part is missing
                which = "not every tensor-parallel rank's KV heads"
            raise RpcFailure(
                grpc.StatusCode.DATA_LOSS,
                f"request {req.request_id!r}: {which} arrived before the lease expired; "
                "its blocks are freed",
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
        # spans are counted as they arrive; the others' bytes once, at their first Commit
        counted = lease.backend in SPAN_BACKENDS or lease.state is not State.RESERVED
        first_top = top_from_proto(req.first_top_logprobs)
        prompt = req.prompt_logprobs if req.HasField("prompt_logprobs") else None
        self.leases.commit(lease, req.first_token, first_logprob, first_top, prompt)
        if not counted:
            self._bytes.labels(lease.backend, "received").inc(lease.bytes_received)
        lease.expires_at = max(lease.expires_at, self.leases.now() + self.lease_seconds)
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
    def awaiting_commit(self, request_id: str) -> bool:
        """Whether a Generate for ``request_id`` is waiting for its Commit (it ends at the
        Commit, or when the reservation is dropped or its lease runs out)."""
        return request_id in self._awaiting

    async def admit(
        self, request_id: str, prompt: list[int], sampling: Any
    ) -> tuple[Lease, AsyncIterator[Any]]:
        """Wait for the Commit, then hand the blocks to the engine's decode batch."""
        try:
            lease = self.leases.get(request_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        ev = self._committed.get(request_id)
        expired = RpcFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request {request_id!r}: no Commit before the lease expired",
        )
        if ev is not None and lease.state is State.RESERVED:
            self._awaiting.add(request_id)
            try:
                # the lease's clock decides, and a push that keeps arriving renews the
                # lease: wait until the expiry as it stands then, not as it stood here
                while not ev.is_set():
                    remaining = lease.expires_at - self.leases.now()
                    if remaining <= 0:
                        await self.drop(request_id, "lease_expired")
                        raise expired
                    try:
                        await asyncio.wait_for(ev.wait(), timeout=remaining)
                    except TimeoutError:
                        continue
            finally:
                self._awaiting.discard(request_id)
        lease_now = self.leases.pop(request_id)
        self._committed.pop(request_id, None)
        if ev is not None and ev.dropped == "lease_expired":  # by the reaper
            await self.engine.release(request_id)
            raise expired
        if lease_now is None or lease_now.state is not State.COMMITTED:
            await self.engine.release(request_id)
            raise RpcFailure(
                grpc.StatusCode.ABORTED,
                f"request {request_id!r} was released before its KV was committed",
            )
        self.receivers[lease_now.backend].forget(lease_now)
        if self.ranks is not None:
            await self.ranks.forget(lease_now)
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
        """Drop every lease past its expiry (NIXL's after a grace; one with a push open
        only once that push has sent nothing for :data:`STALLED_PUSH_S` more): how many."""
        now = self.leases.now()
        n = 0
        for lease in self.leases.leases():
            grace = NIXL_GRACE_S if lease.backend == "nixl" else 0.0
            if lease.state is State.ATTACHED or now < lease.expires_at + grace:
                continue
            if self._busy.get(lease.request_id) and now < lease.expires_at + STALLED_PUSH_S:
                continue  # the push handler sees the expiry at its next span
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
