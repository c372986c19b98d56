"""The decode worker's ``tcp`` KV port: connections served one thread each, payloads
received straight into the reserved blocks.

Per connection: the handshake (:mod:`.tcp_wire`: a challenge, the sender's hello proving
the worker token for this compat hash) within :attr:`Limits.handshake_timeout_s`, then
frames until the sender closes. Each SPAN's header is checked whole before its payload is
read; the :class:`SpanSink` says where the payload goes (views of the pool) and the
kernel copies it there. Any refusal is an ERROR answer that ends that connection alone;
bytes the sender still had in flight are read and dropped for a moment
(:attr:`Limits.drain_s`) so that it reads the answer rather than a reset.

Bounds: connections in all and per peer address, handshakes under way per peer (a peer
without the token cannot hold the slots of those with it), pushes (leases) open per
connection, a handshake timeout and an idle timeout, and a frame rate per peer (a flood of
tiny frames waits its turn, its thread asleep, rather than take the interpreter from the
engine); every length is checked before use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.kv.tcp_socket import PeerClosed, cut, recv_exact, recv_into, send_all, tune
from splitserve_worker.kv.tcp_wire import Frame, Refusal, Status, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    """Connections served at once, all peers together; more are turned away."""
    max_per_peer: int = 64
    """Connections served at once from one peer address (a prefill worker uses
    ``--kv-streams`` per push in progress)."""
    max_pushes_per_connection: int = 4
    """Leases one connection may push at once (a sender pushes one at a time)."""
    handshake_timeout_s: float = 10.0
    """From accept to an accepted hello (TLS handshake included)."""
    idle_timeout_s: float = 120.0
    """Longest wait for the next bytes of a frame once the hello is accepted (senders
    let pooled connections go after 30 s idle)."""
    drain_s: float = 1.0
    """After an ERROR answer, how long the sender's bytes in flight are read and dropped
    before the close."""
    max_handshakes_per_peer: int = 8
    """Connections from one peer address that have not yet proved the token (a sender
    proves it in one round trip; more wait for none)."""
    frames_per_s: float = 20_000.0
    """Frames one peer's connections are served per second together, once its burst is
    spent: a sender cuts spans of about 4 MiB, so this is 80 GB/s of real pushes, while a
    flood of tiny frames is paced to it (each frame costs the interpreter the same)."""
    frame_burst: int = 2_000
    """Frames a peer may send at once before the pace applies."""


class FrameBudget:
    """A token bucket: ``rate`` frames per second, ``burst`` at once. Pure: the caller
    says what time it is and sleeps as long as :meth:`take` says."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._level = float(burst)
        self._at = now

    def take(self, now: float) -> float:
        """Spend one frame at ``now``: how many seconds to wait before serving it."""
        self._level = min(float(self.burst), self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= 1.0
        return 0.0 if self._level >= 0 else -self._level / self.rate


class Refused(Exception):
    """A sink's refusal: the connection answers ERROR and ends."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class SpanSink(Protocol):
    """Where one connection's spans go (the decode side). Called on the connection's
    thread; :class:`Refused` ends the connection with that answer."""

    def target(self, frame: Frame) -> list[memoryview]:
        """Buffers that take exactly ``frame.nbytes``, in order (K then V)."""
        ...

    def placed(self, frame: Frame) -> None:
        """The payload of ``frame`` is in the buffers :meth:`target` gave."""
        ...

    def end(self, lease_id: str, heads: range | None) -> tuple[int, int]:
        """The sender ended ``lease_id``'s push of KV heads ``heads`` (None: all) here:
        (layers complete in those heads, bytes received)."""
        ...

    def close(self, error: BaseException | None) -> None:
        """The connection is over (``error``: why, ``None`` for a close by the sender):
        free whatever it still holds."""
        ...


class _Connection:
    def __init__(self, server: TcpServer, sock: socket.socket, peer: str) -> None:
        self._server = server
        self._sock = sock
        self.peer = peer
        self._stop = [False]
        self.shaking = True
        """Still in the handshake (counted against the peer's handshakes)."""
        self._open: set[str] = set()
        self._sink: SpanSink | None = None

    def abort(self) -> None:
        """Cut the connection (any thread): a receive under way ends at once, and no
        further read into the blocks starts."""
        self._stop[0] = True
        cut(self._sock)

    def serve(self) -> None:
        error: BaseException | None = None
        try:
            if self._handshake():
                self._frames()
        except Refused as e:
            error = e
            self._refuse(e.refusal)
        except WireError as e:
            error = e
            self._refuse(Refusal(Status.INVALID_ARGUMENT, f"a malformed KV frame: {e}"))
        except (OSError, ssl.SSLError) as e:  # the peer went away, timed out or was cut
            error = e
        finally:
            if self._sink is not None:
                self._sink.close(error)
            with contextlib.suppress(OSError):
                self._sock.close()

    def _handshake(self) -> bool:
        limits = self._server.limits
        self._sock.settimeout(limits.handshake_timeout_s)
        if self._server.tls is not None:
            self._sock = self._server.tls.wrap_socket(self._sock, server_side=True)
        nonce = os.urandom(wire.NONCE_BYTES)
        send_all(self._sock, [wire.challenge(nonce)])
        raw = recv_exact(self._sock, wire.HELLO.size)
        refusal = wire.check_hello(raw, self._server.token, nonce, self._server.compat_hash)
        if refusal is not None:
            self._refuse(refusal)
            return False
        self._server.shook(self)
        send_all(self._sock, [wire.ready()])
        self._sock.settimeout(limits.idle_timeout_s)
        self._sink = self._server.sinks(self.abort)
        return True

    def _frames(self) -> None:
        assert self._sink is not None
        head = bytearray(wire.FRAME.size)
        view = memoryview(head)
        while True:
            got = self._sock.recv_into(view, len(head))
            if not got:
                if self._open:
                    raise PeerClosed("the sender closed the connection mid-push")
                return  # a close between pushes
            if got < len(head):
                recv_into(self._sock, [view[got:]])
            self._server.pace(self.peer, self._stop)  # each frame waits its turn
            frame = wire.parse_frame(head)
            if frame.kind == wire.SPAN:
                self._span(frame)
            else:
                self._end(frame)

    def _span(self, frame: Frame) -> None:
        assert self._sink is not None
        if frame.lease_id not in self._open:
            most = self._server.limits.max_pushes_per_connection
            if len(self._open) >= most:
                raise Refused(Refusal(
                    Status.RESOURCE_EXHAUSTED,
                    f"more than {most} pushes open on one KV connection: end one before "
                    "starting another"))  # fmt: skip
            self._open.add(frame.lease_id)
        views = self._sink.target(frame)
        if sum(len(v) for v in views) != frame.nbytes:
            raise Refused(Refusal(Status.INTERNAL, "the span's buffers do not fit its length"))
        recv_into(self._sock, views, stop=self._stop)
        self._sink.placed(frame)

    def _end(self, frame: Frame) -> None:
        assert self._sink is not None
        if frame.lease_id not in self._open:
            raise WireError(f"END for lease {frame.lease_id}, which this connection never pushed")
        layers, nbytes = self._sink.end(frame.lease_id, frame.head_range)
        self._open.discard(frame.lease_id)
        send_all(self._sock, [wire.ack(frame.lease_id, layers, nbytes)])

    def _refuse(self, refusal: Refusal) -> None:
        """Answer ERROR, then read and drop what the sender still sends for a moment, so
        it finds the answer before the close."""
        with contextlib.suppress(OSError, ssl.SSLError, ValueError):
            send_all(self._sock, [wire.error(refusal.status, refusal.message)])
            socket.socket.shutdown(self._sock, socket.SHUT_WR)
            self._sock.settimeout(self._server.limits.drain_s)
            sink = bytearray(1 << 16)
            left = 2 * wire.MAX_SPAN_BYTES
            while left > 0 and not self._stop[0]:
                got = self._sock.recv_into(sink)
                if not got:
                    break
                left -= got


class TcpServer:
    """Listens on ``host:port`` (0: a free port, :attr:`port` says which) and serves each
    connection on its own thread; ``sinks(abort)`` makes the sink of each accepted
    connection (``abort`` cuts it)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        compat_hash: str,
        sinks: Callable[[Callable[[], None]], SpanSink],
        tls: ssl.SSLContext | None = None,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not token:
            raise ValueError("the KV port needs the worker token")
        self.token = token
        self.compat_hash = compat_hash
        self.sinks = sinks
        self.tls = tls
        self.limits = limits or Limits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=256)
        except OSError as e:
            raise OSError(
                f"cannot listen for KV pushes on {host}:{port}: {e.strerror}; choose another "
                "--kv-port"
            ) from None
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[int, _Connection] = {}
        self._per_peer: dict[str, int] = {}
        self._shaking: dict[str, int] = {}
        self._budgets: dict[str, FrameBudget] = {}
        self._clock = clock
        self._sleep = sleep
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _admit(self, peer: str) -> Refusal | None:
        """Whether one more connection from ``peer`` may be served (under the lock)."""
        limits = self.limits
        if len(self._conns) >= limits.max_connections:
            return Refusal(
                Status.RESOURCE_EXHAUSTED,
                f"this decode worker serves {limits.max_connections} KV connections already: "
                "try another decode worker or again later",
            )
        if self._per_peer.get(peer, 0) >= limits.max_per_peer:
            return Refusal(
                Status.RESOURCE_EXHAUSTED,
                f"{limits.max_per_peer} KV connections from {peer} are open already: lower "
                "the prefill worker's concurrent pushes or --kv-streams",
            )
        if self._shaking.get(peer, 0) >= limits.max_handshakes_per_peer:
            return Refusal(
                Status.RESOURCE_EXHAUSTED,
                f"{limits.max_handshakes_per_peer} KV connections from {peer} have not sent "
                "their hello yet: send it before opening more",
            )
        return None

    def shook(self, conn: _Connection) -> None:
        """``conn`` proved the token: it no longer counts as a handshake."""
        with self._lock:
            self._end_handshake(conn)

    def _end_handshake(self, conn: _Connection) -> None:
        if conn.shaking:
            conn.shaking = False
            left = self._shaking.get(conn.peer, 1) - 1
            if left:
                self._shaking[conn.peer] = left
            else:
                self._shaking.pop(conn.peer, None)

    def pace(self, peer: str, stop: list[bool]) -> None:
        """Wait (asleep, any thread) until ``peer``'s next frame is within its rate."""
        with self._lock:
            budget = self._budgets.get(peer)
            if budget is None:
                budget = FrameBudget(self.limits.frames_per_s, self.limits.frame_burst,
                                     self._clock())  # fmt: skip
                self._budgets[peer] = budget
            wait = budget.take(self._clock())
        if wait > 0 and not stop[0]:
            self._sleep(wait)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            try:
                tune(sock)
            except OSError:  # already reset by the peer
                sock.close()
                continue
            peer = str(addr[0])
            conn = _Connection(self, sock, peer)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                refusal = self._admit(peer)
                if refusal is None:
                    self._conns[id(conn)] = conn
                    self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
                    self._shaking[peer] = self._shaking.get(peer, 0) + 1
            if refusal is not None:
                self._turn_away(sock, refusal)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn",
                             daemon=True).start()  # fmt: skip

    def _turn_away(self, sock: socket.socket, refusal: Refusal) -> None:
        """Refuse a connection over the limits without a thread for it: a plain peer reads
        the ERROR in place of the challenge (a TLS peer just sees the close)."""
        with contextlib.suppress(OSError):
            if self.tls is None:
                sock.send(wire.error(refusal.status, refusal.message), socket.MSG_DONTWAIT)
        sock.close()

    def _serve(self, conn: _Connection) -> None:
        try:
            conn.serve()
        except Exception:  # a thread's last word: the cause is logged, the port serves on
            log.exception("KV connection from %s failed", conn.peer)
        finally:
            with self._lock:
                self._conns.pop(id(conn), None)
                self._end_handshake(conn)
                left = self._per_peer.get(conn.peer, 1) - 1
                if left:
                    self._per_peer[conn.peer] = left
                else:
                    self._per_peer.pop(conn.peer, None)
                    self._budgets.pop(conn.peer, None)  # a peer's pace lives with its connections

    def close(self) -> None:
        """Stop accepting and cut every connection (their pushes fail; threads exit)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            conn.abort()
        if threading.current_thread() is not self._thread:
            # the shut-down listener wakes accept() at once: wait for the thread to see it,
            # so a stopped worker leaves no thread behind
            self._thread.join(timeout=5.0)
