"""The decode side of one call on the KV push port (:mod:`splitserve_worker.kv.push_server`).

It runs on the port's connection thread and keeps :meth:`DecodeHandoff.push`'s rules:
the first message opens the lease (on the event loop, which owns the handoff's state),
later ones must belong to it and arrive while it holds; a corrupt or misplaced message
fails the call with DATA_LOSS and frees the blocks; a sender that goes away frees them too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.kv.grpc_backend import PUSH_METHOD
from splitserve_worker.kv.kvwire import KVSpan, WireError
from splitserve_worker.kv.lease import Lease
from splitserve_worker.kv.push_messages import PushFailure
from splitserve_worker.kv.push_server import PushServer
from splitserve_worker.kv.transport import TransferError
from splitserve_worker.server.auth import UNAUTHENTICATED_MESSAGE
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.handoff import DecodeHandoff

log = logging.getLogger(__name__)

LOOP_TIMEOUT_S = 30.0
"""Longest a connection thread waits for the event loop to open or free a lease."""

T = TypeVar("T")


def status_of(error: BaseException | None) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed push answers with."""
    if error is None:
        return grpc.StatusCode.CANCELLED, "the sender cancelled the push"
    if isinstance(error, RpcFailure):
        return error.code, error.message
    if isinstance(error, PushFailure):
        return error.code, error.details
    if isinstance(error, TransferError):
        return grpc.StatusCode.DATA_LOSS, str(error)
    if isinstance(error, WireError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"a malformed KVLayer message: {error}"
    return grpc.StatusCode.INTERNAL, f"the push failed: {error!r}"


class HandoffSink:
    """One PushKV call's messages into the reserved blocks of :class:`DecodeHandoff`."""

    def __init__(
        self, handoff: DecodeHandoff, loop: asyncio.AbstractEventLoop, abort: Callable[[], None]
    ) -> None:
        self._h = handoff
        self._loop = loop
        self._abort = abort
        self._lease: Lease | None = None
        self._views: list[memoryview] = []
        self._placing = False

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(LOOP_TIMEOUT_S)

    def _admit(self, msg: KVSpan) -> Lease:
        if self._lease is None:
            self._lease = self._on_loop(self._h.open_push(msg))
        else:
            self._h.check_next(self._lease, msg)
        return self._lease

    def _received(self, nbytes: int) -> None:
        self._h.count_received(nbytes)
        if self._h.holds.directory:
            self._h.holds.wait("receive")

    def _begin(self, lease: Lease) -> None:
        """From here until :meth:`_end` a drop of the lease waits before freeing its blocks."""
        if not self._h.grpc_receiver().begin_placing(lease, self._abort):
            raise RpcFailure(
                grpc.StatusCode.ABORTED,
                f"the reservation of request {lease.request_id!r} was dropped mid-push",
            )
        self._placing = True

    def _end(self) -> None:
        if self._placing and self._lease is not None:
            self._placing = False
            self._h.grpc_receiver().end_placing(self._lease, self._abort)

    def target(self, head: KVSpan, size: int) -> list[memoryview] | None:
        if self._lease is None and not head.compat_hash:
            return None  # the compatibility check comes first: read the message whole
        lease = self._admit(head)
        views = self._h.grpc_receiver().views(lease, head, size)
        if views is not None:
            self._begin(lease)
        self._views = views or []
        return views

    def placed(self, head: KVSpan) -> None:
        assert self._lease is not None
        try:
            self._h.grpc_receiver().placed(self._lease, head, self._views)
        finally:
            self._end()
        self._received(sum(len(v) for v in self._views))
        self._views = []

    def message(self, span: KVSpan) -> None:
        lease = self._admit(span)
        self._begin(lease)
        try:
            self._h.grpc_receiver().write(lease, span)
        finally:
            self._end()
        self._received(len(span.data))

    def end(self) -> bytes:
        if self._lease is None:
            return pb.PushKVAck().SerializeToString()
        ack: pb.PushKVAck = self._on_loop(self._h.end_push(self._lease))
        return ack.SerializeToString()

    def fail(self, error: BaseException | None) -> tuple[grpc.StatusCode, str]:
        status = status_of(error)
        self._end()
        if self._lease is not None:
            try:
                self._on_loop(self._h.fail_push(self._lease, error))
            except Exception as e:  # the loop is gone (the worker stops): the reaper's job
                log.warning("could not free the blocks of %s now: %r", self._lease.request_id, e)
        return status


def start_push_server(handoff: DecodeHandoff, host: str, port: int, token: str) -> PushServer:
    """The decode side's KV push port (call on the event loop); Reserve answers name it
    from now on."""
    loop = asyncio.get_running_loop()
    push = PushServer(
        host,
        port,
        token=token,
        sinks=lambda abort: HandoffSink(handoff, loop, abort),
        path=PUSH_METHOD,
        unauthenticated=UNAUTHENTICATED_MESSAGE,
    )
    handoff.grpc_receiver().push_port = push.port
    return push
