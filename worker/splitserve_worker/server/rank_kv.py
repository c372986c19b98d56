"""A decode worker over tensor-parallel ranks: each rank receives its own KV heads.

Rank 0 owns the scheduler, the leases and the gRPC server, as with one rank; its pool
and each other rank's pool hold only that rank's KV heads, at the same block ids. So:

- every rank ``r > 0`` listens on its own ``tcp`` KV port (:class:`RankReceiver`, in the
  rank's process) and names it in the worker's store (``kv-port/<r>``);
- Reserve's answer lists every rank's KV heads and port (``TransferHandle.kv_ranks``);
  a prefill worker pushes each rank exactly its heads (:mod:`splitserve_worker.kv.head_split`);
- rank 0 tells the other ranks of each reservation before answering Reserve
  (:class:`ExpectKV`, a step on the ranks' own channel, with a barrier: a rank knows the
  lease before any byte for it can arrive) and of its end (:class:`ForgetKV`, once no
  write into its blocks is under way there);
- a rank whose part of a lease has landed whole says so in the store
  (``kv-placed/<lease>/<r>``); Commit admits the request only once rank 0's own part and
  every other rank's are placed (:meth:`RankKV.wait_placed`), else the blocks are freed
  as for any incomplete push.

Only ``tcp`` reaches the ranks' pools directly; a Reserve for another backend on such a
worker is refused with FAILED_PRECONDITION naming the layout. A rank that dies takes the
worker down as any lost rank does (:mod:`splitserve_worker.parallel.launch`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.engine import identity
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.model_runner import model_shape
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseError, LeaseTable
from splitserve_worker.kv.span_receiver import SpanReceiver
from splitserve_worker.kv.tcp_server import Refused, TcpServer
from splitserve_worker.kv.tcp_wire import Frame, Refusal, Status, handle_metadata
from splitserve_worker.kv.transport import BackendContext, TransferError
from splitserve_worker.models import LoadedModel, torch_dtype
from splitserve_worker.parallel.collectives import RankGroup, RankLost
from splitserve_worker.parallel.layout import TPLayout
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.tcp_sink import check_budget, refusal_of

log = logging.getLogger(__name__)

RANK_BACKENDS = ("tcp",)
"""The KV backends that reach every rank's pool directly."""
RANK_LEASE_S = 24 * 3600.0
"""A rank's copy of a lease never expires by itself: rank 0 ends it (:class:`ForgetKV`)."""
PLACED_POLL_S = 0.002
"""How often Commit looks for a rank's acknowledgement that has not come yet (it has,
in the normal run: the prefill worker commits only after every rank acknowledged its
push)."""
STORE_TIMEOUT_S = 300.0


def port_key(rank: int) -> str:
    return f"kv-port/{rank}"


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
    """Rank 0's ``--kv-port``: rank ``r`` listens on ``port + r`` (0: any free port)."""
    token: str
    tls: TlsConfig


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
    """Rank ``r > 0`` of a decode worker: its KV port into its own pool, and its copies of
    rank 0's leases."""

    def __init__(self, pool: Any, rank: int, store_port: int, spec: RankKVSpec,
                 compat: Compat) -> None:  # fmt: skip
        self.rank = rank
        self.leases = LeaseTable()
        ctx = BackendContext(compat=compat, pool=PoolView(pool), leases=self.leases)
        self.receiver = SpanReceiver(ctx, "tcp")
        self._store = _client(store_port)
        self._store_lock = threading.Lock()
        port = spec.port + rank if spec.port else 0
        tls = spec.tls.server_context() if spec.tls.serves else None
        self.server = TcpServer(spec.host, port, token=spec.token, compat_hash=compat.hash,
                                sinks=lambda abort: RankSink(self, abort), tls=tls)  # fmt: skip
        with self._store_lock:
            self._store.set(port_key(rank), handle_metadata(self.server.port, tls is not None))

    def placed(self, lease: Lease) -> None:
        """This rank's part of ``lease`` is whole: tell rank 0."""
        with self._store_lock:
            self._store.set(placed_key(lease.lease_id, self.rank), b"1")

    def handle(self, step: object, group: RankGroup) -> bool:
        """A step of rank 0's about leases (True), after which every rank meets at a
        barrier; anything else is not this one's (False)."""
        if isinstance(step, ExpectKV):
            self.leases.add(step.request_id, list(step.block_ids), num_tokens=step.num_tokens,
                            num_layers=step.num_layers, ttl=RANK_LEASE_S, backend="tcp",
                            lease_id=step.lease_id)  # fmt: skip
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
        self.server.close()


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
            return self._rx.leases.find(lease_id)
        except LeaseError as e:
            raise Refused(Refusal(Status.NOT_FOUND, str(e))) from None

    def target(self, frame: Frame) -> list[memoryview]:
        lease = self._lease(frame.lease_id)
        rx = self._rx.receiver
        try:
            views = rx.views(lease, frame.layer, frame.start, frame.count, frame.nbytes)
            check_budget(lease, frame)
        except (RpcFailure, TransferError) as e:
            raise Refused(refusal_of(e)) from None
        if views is None:  # a pool off the host: staged here, then copied in
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
                rx.write(lease, frame.layer, frame.start, frame.count, data, frame.crc32)
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

    def end(self, lease_id: str) -> tuple[int, int]:
        lease = self._lease(lease_id)
        return lease.layers_complete, lease.bytes_received

    def close(self, error: BaseException | None) -> None:
        # a broken push leaves its lease incomplete: rank 0's Commit fails and frees it
        self._end_placing()


class RankKV:
    """Rank 0's side: every rank's heads and port for Reserve answers, the other ranks
    told of each lease, and their acknowledgements awaited at Commit."""

    def __init__(self, engine: Any, call: Callable[..., Any], layout: TPLayout,
                 store_port: int) -> None:  # fmt: skip
        """``engine``: rank 0's engine (its ``group`` sends the steps); ``call``: runs a
        function on the engine thread (the async engine's ``call``)."""
        self._engine = engine
        self._call = call
        self.layout = layout
        self._store = _client(store_port)
        self._lock = threading.Lock()
        self._metadata = {r: bytes(self._store.get(port_key(r))) for r in range(1, layout.world)}

    def describe(self) -> str:
        return self.layout.describe()

    def check_backend(self, backend: str) -> None:
        if backend not in RANK_BACKENDS:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this decode worker holds its KV over {self.layout.world} tensor-parallel "
                f"ranks ({self.layout.describe()}): KV reaches each rank's pool over "
                f"{', '.join(RANK_BACKENDS)} only, not {backend!r}; Reserve with "
                f"kv_backend=tcp, or serve {backend} with --tensor-parallel-size 1",
            )

    def handle_ranks(self, own_metadata: bytes) -> list[pb.KVRank]:
        out = []
        for r in range(self.layout.world):
            heads = self.layout.kv_heads(r)
            meta = own_metadata if r == 0 else self._metadata[r]
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
                        lease.num_tokens, lease.num_layers)  # fmt: skip
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
