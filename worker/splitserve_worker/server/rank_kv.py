"""A decode worker over tensor-parallel ranks: each rank receives its own KV heads.

Rank 0 owns the scheduler, the leases and the gRPC server, as with one rank; its pool
and each other rank's pool hold only that rank's KV heads, at the same block ids. So:

- every rank ``r > 0`` serves both span backends into its own pool, in the rank's
  process (:class:`RankReceiver`): a ``tcp`` KV port and a gRPC port of its own that
  takes ``PushKV`` (:class:`RankPushKV`), each with rank 0's checks (the worker token,
  the lease, the span against its reservation before any byte is written, the crc32
  when one comes), and, when the worker takes ``nixl``, a NIXL agent of its own that
  registers its pool (NIXL writes land straight in it, each layer's notification marks
  it arrived); it names each in the worker's store (``kv-port/<r>/<backend>``);
- Reserve's answer lists every rank's KV heads and, for the backend reserved, where the
  rank receives them (``TransferHandle.kv_ranks``); a prefill worker pushes each rank
  exactly its heads (:mod:`splitserve_worker.kv.head_split`);
- rank 0 tells the other ranks of each reservation before answering Reserve
  (:class:`ExpectKV`, a step on the ranks' own channel, with a barrier: a rank knows the
  lease before any byte for it can arrive) and of its end (:class:`ForgetKV`, once no
  write into its blocks is under way there, whichever port it came through);
- a rank whose part of a lease has landed whole says so in the store
  (``kv-placed/<lease>/<r>``); Commit admits the request only once rank 0's own part and
  every other rank's are placed (:meth:`RankKV.wait_placed`), else the blocks are freed
  as for any incomplete push.

Why a gRPC server per rank rather than rank 0 relaying: the bytes go straight into the
pool that holds them, as over ``tcp``, and the rank's server is rank 0's (the same
interceptor, TLS, limits and message decoding), on a thread of the rank's own
(:class:`~.grpc_listen.ServerThread`) since its main thread runs the forwards.

A Reserve for a backend the ranks do not serve is refused with FAILED_PRECONDITION
naming the layout. A rank that dies takes the worker down as any lost rank does
(:mod:`splitserve_worker.parallel.launch`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.engine import identity
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.model_runner import model_shape
from splitserve_worker.kv.grpc_sender import rank_metadata
from splitserve_worker.kv.kvwire import KVSpan
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseError, LeaseTable
from splitserve_worker.kv.nixl_receiver import NixlReceiver
from splitserve_worker.kv.span_receiver import SpanReceiver
from splitserve_worker.kv.tcp_server import Refused, TcpServer
from splitserve_worker.kv.tcp_wire import Frame, Refusal, Status, handle_metadata
from splitserve_worker.kv.transport import SPAN_BACKENDS, BackendContext, TransferError
from splitserve_worker.models import LoadedModel, torch_dtype
from splitserve_worker.parallel.collectives import RankGroup, RankLost
from splitserve_worker.parallel.layout import TPLayout
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.grpc_listen import ServerThread
from splitserve_worker.server.handoff import check_heads, compat_mismatch, wrong_backend
from splitserve_worker.server.service import add_to_server
from splitserve_worker.server.tcp_sink import check_budget, refusal_of

log = logging.getLogger(__name__)

RANK_LEASE_S = 24 * 3600.0
"""A rank's copy of a lease never expires by itself: rank 0 ends it (:class:`ForgetKV`)."""
PLACED_POLL_S = 0.002
"""How often Commit looks for a rank's acknowledgement that has not come yet (it has,
in the normal run: the prefill worker commits only after every rank acknowledged its
push)."""
STORE_TIMEOUT_S = 300.0


def port_key(rank: int, backend: str) -> str:
    return f"kv-port/{rank}/{backend}"


def rank_port(kv_port: int, rank: int, world: int, backend: str) -> int:
    """Where rank ``rank > 0`` of a worker over ``world`` ranks whose ``--kv-port`` is
    ``kv_port`` receives ``backend``'s pushes: ``tcp`` on ``kv_port + rank``, ``grpc`` on
    the ports after all the ranks' ``tcp`` ones (``kv_port + world - 1 + rank``); any free
    port when ``kv_port`` is 0."""
    if not kv_port:
        return 0
    return kv_port + rank + (world - 1 if backend == "grpc" else 0)


def placed_key(lease_id: str, rank: int) -> str:
    return f"kv-placed/{lease_id}/{rank}"


@dataclass(frozen=True)
class ExpectKV:
    """Rank 0 reserved ``block_ids`` for a prompt's pushed KV under ``lease_id``."""

    request_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    num_layers: int
    backend: str
    """What the push comes over (a push over the other port is refused)."""


@dataclass(frozen=True)
class ForgetKV:
    """The reservation is over (committed and admitted, released, or expired)."""

    request_id: str
    lease_id: str


@dataclass(frozen=True)
class RankKVSpec:
    """What ranks ``r > 0`` need to receive KV (carried in the ranks' spec)."""

    host: str
    port: int
    """Rank 0's ``--kv-port``: each rank's ports follow it (:func:`rank_port`; 0: any free
    ports)."""
    token: str
    tls: TlsConfig
    world: int
    """The worker's ranks."""
    backends: tuple[str, ...] = SPAN_BACKENDS
    """What the worker takes KV over (``tcp`` and ``grpc`` always; ``nixl`` when its
    ``--kv-backend`` is)."""


def rank_compat(loaded: LoadedModel, config: EngineConfig) -> Compat:
    """The compatibility identity of the worker this rank is part of: the whole model's
    KV, as rank 0's engine states it (what every rank's KV port checks pushes against)."""
    dtype = loaded.dtype if config.dtype == "auto" else torch_dtype(config.dtype)
    shape = model_shape(loaded.model.config)
    info = identity.compat_info(loaded.name, loaded.model, shape, dtype, config.block_size)
    return Compat.from_mapping(info)


def _client(store_port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store_port, None, False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))  # fmt: skip


class RankReceiver:
    """Rank ``r > 0`` of a decode worker: its KV ports into its own pool (``tcp`` and
    ``grpc``), and its copies of rank 0's leases."""

    def __init__(self, pool: Any, rank: int, store_port: int, spec: RankKVSpec,
                 compat: Compat) -> None:  # fmt: skip
        self.rank = rank
        self.compat = compat
        self.leases = LeaseTable()
        self.pool = PoolView(pool)
        ctx = BackendContext(compat=compat, pool=self.pool, leases=self.leases)
        self.receiver = SpanReceiver(ctx, "rank")
        """Both ports' writes: a lease's end waits for those under way through either."""
        self._store = _client(store_port)
        self._store_lock = threading.Lock()
        tls = spec.tls.server_context() if spec.tls.serves else None
        self.server = TcpServer(spec.host, rank_port(spec.port, rank, spec.world, "tcp"),
                                token=spec.token, compat_hash=compat.hash,
                                sinks=lambda abort: RankSink(self, abort), tls=tls)  # fmt: skip
        try:
            push_kv = RankPushKV(self)
            self.grpc = ServerThread(
                lambda server: add_to_server(push_kv, server, methods=("PushKV",)),
                spec.host, rank_port(spec.port, rank, spec.world, "grpc"), spec.token,
                spec.tls, flag="--kv-port", name=f"splitserve-rank{rank}-grpc",
            )  # fmt: skip
        except BaseException:
            self.server.close()
            raise
        self.nixl: NixlReceiver | None = None
        if "nixl" in spec.backends:
            try:
                self.nixl = NixlReceiver(
                    BackendContext(compat=compat, pool=self.pool, leases=self.leases,
                                   name_hint=f"splitserve-rank{rank}"),
                    on_complete=self.placed,
                )  # fmt: skip
            except BaseException:
                self.close()
                raise
            self._publish("nixl", self.nixl.backend_metadata())
        self._publish("tcp", handle_metadata(self.server.port, tls is not None))
        self._publish("grpc", rank_metadata(self.grpc.port))

    def _publish(self, backend: str, metadata: bytes) -> None:
        with self._store_lock:
            self._store.set(port_key(self.rank, backend), metadata)

    def placed(self, lease: Lease) -> None:
        """This rank's part of ``lease`` is whole: tell rank 0."""
        with self._store_lock:
            self._store.set(placed_key(lease.lease_id, self.rank), b"1")

    def lease(self, lease_id: str, backend: str, request_id: str | None = None) -> Lease:
        """The live lease ``lease_id`` (of ``request_id`` when given), for a push over
        ``backend``; RpcFailure NOT_FOUND if there is none, FAILED_PRECONDITION if it was
        reserved for another backend."""
        try:
            if request_id is None:
                lease = self.leases.find(lease_id)
            else:
                lease = self.leases.get(request_id, lease_id)
        except LeaseError as e:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        if lease.backend != backend:
            raise wrong_backend(lease, backend)
        return lease

    def write(self, lease: Lease, span: KVSpan, abort: Callable[[], None]) -> None:
        """Place one span whose payload is in memory (a ``PushKV`` message) while the lease
        holds its blocks: checked against the reservation, and its crc32 when it carries
        one, before it is written. RpcFailure ABORTED if the lease was dropped, DATA_LOSS
        if the span is refused."""
        rx = self.receiver
        if not rx.begin_placing(lease, abort):
            raise RpcFailure(grpc.StatusCode.ABORTED, f"the reservation of request "
                             f"{lease.request_id!r} was dropped mid-push")  # fmt: skip
        try:
            rx.write(lease, span.layer, span.start_token, span.num_tokens, span.data, span.crc32,
                     span.head_range)  # fmt: skip
        except TransferError as e:
            raise RpcFailure(grpc.StatusCode.DATA_LOSS, str(e)) from None
        finally:
            rx.end_placing(lease, abort)
        if lease.complete:
            self.placed(lease)

    def handle(self, step: object, group: RankGroup) -> bool:
        """A step of rank 0's about leases (True), after which every rank meets at a
        barrier; anything else is not this one's (False)."""
        if isinstance(step, ExpectKV):
            self.leases.add(step.request_id, list(step.block_ids), num_tokens=step.num_tokens,
                            num_layers=step.num_layers, ttl=RANK_LEASE_S, backend=step.backend,
                            kv_heads=self.pool.kv_heads, lease_id=step.lease_id)  # fmt: skip
        elif isinstance(step, ForgetKV):
            lease = self.leases.pop(step.request_id)
            busy = lease is not None and self.receiver.placing(lease)
            if busy and lease is not None and not self.receiver.quiesce(lease):
                log.error("a KV write into %s's blocks did not stop", step.request_id)
            with self._store_lock:
                self._store.delete_key(placed_key(step.lease_id, self.rank))
        else:
            return False
        group.barrier()
        return True

    def close(self) -> None:
        if getattr(self, "nixl", None) is not None:
            assert self.nixl is not None
            self.nixl.close()
        self.grpc.close()
        self.server.close()


class RankPushKV:
    """``PushKV`` on a rank's own gRPC port, into its pool: the checks of rank 0's (the
    token, by the port's interceptor before any message is read; the lease; the compat
    hash; each span by :meth:`RankReceiver.write`). Rank 0 owns the lease: a broken push
    leaves this rank's part incomplete, and rank 0's Commit fails and frees the blocks."""

    def __init__(self, rx: RankReceiver) -> None:
        self._rx = rx

    async def PushKV(self, messages: AsyncIterator[KVSpan],
                     context: grpc.aio.ServicerContext) -> pb.PushKVAck:  # fmt: skip
        def abort() -> None:
            """Nothing to cut: a span's write copies bytes already received and ends by
            itself (on this loop, with no await between its begin and end)."""

        lease: Lease | None = None
        heads: range | None = None
        try:
            async for msg in messages:
                if lease is None:
                    lease = self._rx.lease(msg.lease_id, "grpc", msg.request_id)
                    if msg.compat_hash != self._rx.compat.hash:
                        raise compat_mismatch(msg.compat_hash, self._rx.compat)
                else:
                    if msg.lease_id != lease.lease_id or msg.request_id != lease.request_id:
                        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                         "one PushKV stream carries one request")  # fmt: skip
                    check_heads(heads, msg)
                heads = msg.head_range
                self._rx.write(lease, msg, abort)
        except RpcFailure as e:
            await context.abort(e.code, e.message)
        if lease is None:
            return pb.PushKVAck()
        return pb.PushKVAck(
            layers_received=lease.layers_complete_over(heads), bytes_received=lease.bytes_received
        )


class RankSink:
    """One connection on a rank's KV port: spans into that rank's reserved blocks."""

    def __init__(self, rx: RankReceiver, abort: Callable[[], None]) -> None:
        self._rx = rx
        self._abort = abort
        self._placing: Lease | None = None
        self._views: list[memoryview] = []
        self._staged: bytearray | None = None

    def _lease(self, lease_id: str) -> Lease:
        try:
            return self._rx.lease(lease_id, "tcp")
        except RpcFailure as e:
            raise Refused(refusal_of(e)) from None

    def target(self, frame: Frame) -> list[memoryview]:
        lease = self._lease(frame.lease_id)
        rx = self._rx.receiver
        try:
            views = rx.views(lease, frame.layer, frame.start, frame.count, frame.nbytes,
                             frame.head_range)  # fmt: skip
            check_budget(lease, frame)
        except (RpcFailure, TransferError) as e:
            raise Refused(refusal_of(e)) from None
        if views is None:  # a pool off the host, or some heads: staged, then copied in
            self._staged = bytearray(frame.nbytes)
            views = [memoryview(self._staged)]
        if not rx.begin_placing(lease, self._abort):
            raise Refused(Refusal(Status.ABORTED, f"the reservation of request "
                                  f"{lease.request_id!r} was dropped mid-push"))  # fmt: skip
        self._placing, self._views = lease, views
        return views

    def placed(self, frame: Frame) -> None:
        lease = self._placing
        assert lease is not None
        rx = self._rx.receiver
        try:
            if self._staged is not None:
                data, self._staged = memoryview(self._staged), None
                rx.write(lease, frame.layer, frame.start, frame.count, data, frame.crc32,
                         frame.head_range)  # fmt: skip
            else:
                rx.placed(lease, frame.layer, frame.start, frame.count, self._views, frame.crc32)
        except TransferError as e:
            raise Refused(refusal_of(e)) from None
        finally:
            self._end_placing()
        if lease.complete:
            self._rx.placed(lease)

    def _end_placing(self) -> None:
        if self._placing is not None:
            self._rx.receiver.end_placing(self._placing, self._abort)
            self._placing = None
        self._views = []

    def end(self, lease_id: str, heads: range | None) -> tuple[int, int]:
        lease = self._lease(lease_id)
        return lease.layers_complete_over(heads), lease.bytes_received

    def close(self, error: BaseException | None) -> None:
        # a broken push leaves its lease incomplete: rank 0's Commit fails and frees it
        self._end_placing()


class RankKV:
    """Rank 0's side: every rank's heads and port for Reserve answers, the other ranks
    told of each lease, and their acknowledgements awaited at Commit."""

    def __init__(self, engine: Any, call: Callable[..., Any], layout: TPLayout,
                 store_port: int, backends: tuple[str, ...] = SPAN_BACKENDS) -> None:  # fmt: skip
        """``engine``: rank 0's engine (its ``group`` sends the steps); ``call``: runs a
        function on the engine thread (the async engine's ``call``); ``backends``: what
        the other ranks take KV over (:attr:`RankKVSpec.backends`)."""
        self._engine = engine
        self._call = call
        self.layout = layout
        self.backends = backends
        self._store = _client(store_port)
        self._lock = threading.Lock()
        self._metadata = {(r, b): bytes(self._store.get(port_key(r, b)))
                          for r in range(1, layout.world) for b in backends}  # fmt: skip

    def describe(self) -> str:
        return self.layout.describe()

    def check_backend(self, backend: str) -> None:
        if backend not in self.backends:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this decode worker holds its KV over {self.layout.world} tensor-parallel "
                f"ranks ({self.layout.describe()}), which take KV over "
                f"{' or '.join(self.backends)}, not {backend!r}; Reserve with one of them, "
                f"or start the worker with --kv-backend {backend}",
            )

    def handle_ranks(self, backend: str, own_metadata: bytes) -> list[pb.KVRank]:
        """Every rank's heads and where it receives ``backend``'s pushes (rank 0's:
        ``own_metadata``)."""
        out = []
        for r in range(self.layout.world):
            heads = self.layout.kv_heads(r)
            meta = own_metadata if r == 0 else self._metadata[(r, backend)]
            out.append(pb.KVRank(rank=r, kv_head_start=heads.start, kv_head_stop=heads.stop,
                                 backend_metadata=meta))  # fmt: skip
        return out

    def _step(self, step: object) -> None:
        group = self._engine.group
        if group is None:
            raise RankLost("the tensor-parallel ranks are stopped")
        group.send_step(step)
        group.barrier()

    async def expect(self, lease: Lease) -> None:
        step = ExpectKV(lease.request_id, lease.lease_id, tuple(lease.block_ids),
                        lease.num_tokens, lease.num_layers, lease.backend)  # fmt: skip
        try:
            await self._call(self._step, step)
        except RankLost as e:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    async def forget(self, lease: Lease) -> None:
        """The other ranks drop their copy of ``lease`` (once nothing lands in its blocks
        there); a lost rank has nothing left to drop."""
        try:
            await self._call(self._step, ForgetKV(lease.request_id, lease.lease_id))
        except RankLost as e:
            log.warning("could not tell the ranks %s is over: %s", lease.request_id, e)

    def wait_placed(self, lease: Lease, timeout: float) -> bool:
        """Whether every other rank placed its whole part of ``lease`` within ``timeout``."""
        keys = [placed_key(lease.lease_id, r) for r in range(1, self.layout.world)]
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._store.check(keys):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(PLACED_POLL_S)
