"""A prefill worker over tensor-parallel ranks: each rank pushes its own KV heads.

Over the span backends (``tcp``, ``grpc``) no layer is gathered, whatever the decode
worker's layout: rank 0 sends the other ranks the prefill's forwards with a
:class:`PushOrder` (the handle's target and backend), and every rank that holds a
distinct set of heads (with replicated heads, the first of their ranks) pushes them
straight to the decode ranks holding them, or into the decode worker's one pool
(:mod:`splitserve_worker.kv.head_split`: a span names the heads of the pool it fills).
Each rank ``r > 0`` says in the worker's store how its push ended (``kv-sent/<lease>/<r>``:
``ok`` or the error); rank 0 commits only once its own push and every other rank's have
been acknowledged by the decode side.

Over NIXL, which writes whole blocks of a pool, each rank pushes its own heads only when
each decode rank's heads lie within one source rank's (P(TP2)->D(TP2), P(TP1)->D(TP2));
otherwise (a decode worker of one pool, or ranks that cut across) rank 0 gathers each
layer's heads through the group and writes each decode rank its part.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig

from splitserve_worker.engine.model_runner import RankPush
from splitserve_worker.kv.head_split import open_split, overlap
from splitserve_worker.kv.transport import (
    SPAN_BACKENDS,
    BackendContext,
    KVSender,
    SenderBackend,
    SendStats,
    TransferError,
    TransferTarget,
    create_sender_backend,
)
from splitserve_worker.parallel.layout import TPLayout

log = logging.getLogger(__name__)

SENT_POLL_S = 0.002
STORE_TIMEOUT_S = 300.0
OK = b"ok"


def sent_key(lease_id: str, rank: int) -> str:
    return f"kv-sent/{lease_id}/{rank}"


@dataclass(frozen=True)
class PushOrder:
    """Where every rank pushes its heads of one prefill."""

    target: TransferTarget
    backend: str


@dataclass(frozen=True)
class RankPushSpec:
    """What ranks ``r > 0`` of a prefill worker need to push KV (carried in the ranks'
    spec): the worker's own push settings."""

    token: str
    tls: TlsConfig
    streams: int
    checksums: bool
    checksum_every: int
    transfer_timeout_s: float


def pushes_directly(layout: TPLayout, target: TransferTarget, backend: str) -> bool:
    """Whether every rank pushes its own heads into ``target`` over ``backend`` (else
    rank 0 gathers): always over the span backends; over NIXL when each decode rank's
    heads lie within one source rank's (its blocks then come whole from that rank)."""
    if layout.world == 1:
        return False
    if backend in SPAN_BACKENDS:
        return True
    if not target.kv_ranks:
        return False
    for r in target.kv_ranks:
        want = range(r.kv_head_start, r.kv_head_stop)
        for s in layout.kv_owners():
            got = overlap(layout.kv_heads(s), want)
            if got and got != want:
                return False
    return True


def _client(store_port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store_port, None, False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))  # fmt: skip


class _Failed:
    """A push that could not open: it sends nothing and fails at ``finish``."""

    def __init__(self, error: str) -> None:
        self.error = error

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_token: int) -> None:
        return None

    def finish(self, timeout: float) -> SendStats:
        raise TransferError(self.error, "handle")

    def abort(self, reason: str) -> None:
        return None


class RankPusher:
    """Rank ``r > 0`` of a prefill worker: its heads of each prefill pushed to the decode
    ranks holding them (a :class:`~splitserve_worker.engine.follower.PushSink`)."""

    def __init__(self, rank: int, layout: TPLayout, store_port: int, spec: RankPushSpec,
                 compat: Compat) -> None:  # fmt: skip
        self.rank = rank
        self.layout = layout
        self.source = rank in layout.kv_owners()
        """Whether this rank pushes (one rank of each set of replicated heads does)."""
        self._spec = spec
        self._kv_heads = compat.kv_heads
        self._ctx = BackendContext(compat=compat, token=spec.token, checksums=spec.checksums,
                                   checksum_every=spec.checksum_every, streams=spec.streams,
                                   tls=spec.tls, name_hint=f"splitserve-rank{rank}")  # fmt: skip
        self._backends: dict[str, SenderBackend] = {}
        self._open: dict[str, KVSender | _Failed] = {}
        self._store = _client(store_port)
        self._lock = threading.Lock()

    def _sender(self, order: PushOrder) -> KVSender | _Failed:
        lease = order.target.lease_id
        sender = self._open.get(lease)
        if sender is None:
            try:
                backend = self._backends.get(order.backend)
                if backend is None:
                    backend = create_sender_backend(order.backend, self._ctx)
                    self._backends[order.backend] = backend
                own = self.layout.kv_heads(self.rank)
                sender = open_split(backend, order.target, own, self._kv_heads)
            except (TransferError, ValueError, ImportError) as e:
                sender = _Failed(f"rank {self.rank} cannot push its KV heads: {e}")
            self._open[lease] = sender
        return sender

    def layer(self, push: RankPush, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.source:
            assert isinstance(push.order, PushOrder)
            self._sender(push.order).send_layer(layer, k, v, push.start_token)

    def chunk_done(self, push: RankPush) -> None:
        if not (self.source and push.last):
            return
        assert isinstance(push.order, PushOrder)
        lease = push.order.target.lease_id
        sender = self._sender(push.order)
        del self._open[lease]
        threading.Thread(target=self._finish, args=(lease, sender), daemon=True,
                         name=f"splitserve-rank-push-{lease}").start()  # fmt: skip

    def _finish(self, lease: str, sender: KVSender | _Failed) -> None:
        try:
            sender.finish(self._spec.transfer_timeout_s)
            said = OK
        except TransferError as e:
            said = (str(e) or "the push failed").encode()
        with self._lock:
            self._store.set(sent_key(lease, self.rank), said)

    def close(self) -> None:
        for sender in self._open.values():
            sender.abort("the worker is stopping")
        for backend in self._backends.values():
            backend.close()


class RankPushes:
    """Rank 0's side: whether a prefill's ranks push their own heads, and how the other
    ranks' pushes ended."""

    def __init__(self, layout: TPLayout, store_port: int) -> None:
        self.layout = layout
        self.own = layout.kv_heads(0)
        """Rank 0's heads (what it pushes itself when every rank pushes)."""
        self._store = _client(store_port)
        self._lock = threading.Lock()

    def direct(self, target: TransferTarget, backend: str) -> bool:
        return pushes_directly(self.layout, target, backend)

    def wait_sent(self, lease_id: str, timeout: float) -> str | None:
        """None once every other source rank's push was acknowledged; else why not (a
        rank's error, or none heard within ``timeout``). The ranks' answers are removed."""
        keys = [sent_key(lease_id, r) for r in self.layout.kv_owners() if r != 0]
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._store.check(keys):
                    said = [bytes(self._store.get(k)) for k in keys]
                    for k in keys:
                        self._store.delete_key(k)
                    break
            if time.monotonic() >= deadline:
                return f"a tensor-parallel rank's push did not end within {timeout:g} s"
            time.sleep(SENT_POLL_S)
        errors = [s.decode(errors="replace") for s in said if s != OK]
        return errors[0] if errors else None
