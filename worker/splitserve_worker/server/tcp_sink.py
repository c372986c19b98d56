"""The decode side of one connection on the ``tcp`` KV port (:mod:`~.kv.tcp_server`).

It runs on the port's connection thread and keeps :meth:`DecodeHandoff.push`'s rules:
the first span of a lease opens its push (on the event loop, which owns the handoff's
state), later ones must arrive while the lease holds; a corrupt or misplaced span ends
the connection and frees the blocks; a sender that goes away frees them too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from splitserve_worker.kv.lease import Lease
from splitserve_worker.kv.tcp_server import Limits, Refused, TcpServer
from splitserve_worker.kv.tcp_wire import Frame, Refusal, Status, handle_metadata
from splitserve_worker.kv.transport import TransferError
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.handoff import DecodeHandoff

log = logging.getLogger(__name__)

LOOP_TIMEOUT_S = 30.0
"""Longest a connection thread waits for the event loop to open or free a lease."""

T = TypeVar("T")


def refusal_of(error: RpcFailure | TransferError) -> Refusal:
    """The answer a failed span gets."""
    if isinstance(error, RpcFailure):
        return Refusal(Status(error.code.value[0]), error.message)
    return Refusal(Status.DATA_LOSS, str(error))


def check_budget(lease: Lease, frame: Frame) -> None:
    """A push sends each token of each layer once: no more bytes than its reservation
    holds (``frame`` checked already to carry ``count`` whole tokens), so one lease
    cannot carry an endless stream of frames, each renewing it."""
    per_token = frame.nbytes // frame.count // (frame.heads or lease.kv_heads) * lease.kv_heads
    reserved = lease.num_layers * lease.num_tokens * per_token
    if lease.bytes_received + frame.nbytes > reserved:
        raise RpcFailure(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request {lease.request_id!r}: a span past the {reserved} bytes its reservation "
            f"holds ({lease.num_layers} layers of {lease.num_tokens} tokens); a push sends "
            "each token of each layer once",
        )


class HandoffSink:
    """One tcp connection's spans into the reserved blocks of :class:`DecodeHandoff`."""

    def __init__(
        self, handoff: DecodeHandoff, loop: asyncio.AbstractEventLoop, abort: Callable[[], None]
    ) -> None:
        self._h = handoff
        self._loop = loop
        self._abort = abort
        self._receiver = handoff.span_receiver("tcp")
        self._open: dict[str, Lease] = {}
        self._placing: Lease | None = None
        self._views: list[memoryview] = []
        self._staged: bytearray | None = None
        self._failure: TransferError | None = None

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(LOOP_TIMEOUT_S)

    def _refuse(self, error: RpcFailure | TransferError) -> Refused:
        if isinstance(error, TransferError):
            self._failure = error  # the blocks it may have touched are freed at close
        return Refused(refusal_of(error))

    def target(self, frame: Frame) -> list[memoryview]:
        try:
            lease = self._open.get(frame.lease_id)
            if lease is None:
                lease = self._on_loop(self._h.open_tcp_push(frame.lease_id))
                self._open[frame.lease_id] = lease
            else:
                self._h.check_next(lease)
            views = self._receiver.views(lease, frame.layer, frame.start, frame.count,
                                         frame.nbytes, frame.head_range)  # fmt: skip
            check_budget(lease, frame)
            if views is None:  # a pool off the host, or some heads: staged, then copied in
                self._staged = bytearray(frame.nbytes)
                views = [memoryview(self._staged)]
            if not self._receiver.begin_placing(lease, self._abort):
                raise RpcFailure(
                    grpc.StatusCode.ABORTED,
                    f"the reservation of request {lease.request_id!r} was dropped mid-push",
                )
        except (RpcFailure, TransferError) as e:
            raise self._refuse(e) from None
        self._placing, self._views = lease, views
        return views

    def _end_placing(self) -> None:
        if self._placing is not None:
            self._receiver.end_placing(self._placing, self._abort)
            self._placing = None

    def placed(self, frame: Frame) -> None:
        lease = self._placing
        assert lease is not None
        try:
            if self._staged is not None:
                data, self._staged = memoryview(self._staged), None
                self._receiver.write(lease, frame.layer, frame.start, frame.count, data,
                                     frame.crc32, frame.head_range)  # fmt: skip
            else:
                self._receiver.placed(lease, frame.layer, frame.start, frame.count,
                                      self._views, frame.crc32)  # fmt: skip
        except TransferError as e:
            raise self._refuse(e) from None
        finally:
            self._end_placing()
            self._views = []
        self._h.count_received("tcp", frame.nbytes)
        if self._h.holds.directory:  # as PushKV does: at each span while armed
            self._h.holds.wait("receive")

    def end(self, lease_id: str, heads: range | None) -> tuple[int, int]:
        lease = self._open.pop(lease_id)
        ack = self._on_loop(self._h.end_push(lease, heads))
        return ack.layers_received, ack.bytes_received

    def close(self, error: BaseException | None) -> None:
        """Free what the connection still holds: its open pushes failed (a corrupt or
        misplaced span's blocks are freed; the others' unless already reserved anew)."""
        self._end_placing()
        cause = self._failure
        for lease in self._open.values():
            try:
                self._on_loop(self._h.fail_push(lease, cause))
            except (RuntimeError, TimeoutError, concurrent.futures.CancelledError) as e:
                # the loop is gone or stuck (the worker stops): the reaper frees them
                log.warning("could not free the blocks of %s now: %r", lease.request_id, e)
        self._open.clear()


def start_tcp_server(
    handoff: DecodeHandoff,
    host: str,
    port: int,
    token: str,
    tls: ssl.SSLContext | None = None,
    limits: Limits | None = None,
    **pacing: Any,
) -> TcpServer:
    """The decode side's ``tcp`` KV port (call on the event loop; ``tls``: served over
    TLS; ``pacing``: the port's ``clock`` and ``sleep``, for tests); Reserve answers name
    it from then on."""
    loop = asyncio.get_running_loop()
    server = TcpServer(
        host,
        port,
        token=token,
        compat_hash=handoff.compat.hash,
        sinks=lambda abort: HandoffSink(handoff, loop, abort),
        tls=tls,
        limits=limits,
        **pacing,
    )
    handoff.span_receiver("tcp").metadata = handle_metadata(server.port, tls is not None)
    return server
