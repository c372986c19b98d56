"""The prefill side of the ``tcp`` KV backend: connections to decode workers' KV ports,
pooled, each carrying one push at a time.

A push takes ``streams`` connections (:func:`~.span_sender.default_streams`) from the pool or opens
them (connect, TLS when the handle says so, the hello: :mod:`.tcp_wire`), in its
streams' own threads so that connecting overlaps the prefill. Each span goes out as its
40-byte header and the K and V bytes in one ``sendmsg`` straight from the tensors; between
spans the stream looks, without waiting, for a refusal from the decode side and stops at
once if one came. A connection goes back to the pool only after a clean ACK; any failure
closes it.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator

from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.kv.span_sender import SpanOut, SpanSampler, SpanSender, default_streams
from splitserve_worker.kv.staging import HostStaging
from splitserve_worker.kv.tcp_socket import PeerClosed, cut, recv_exact, send_all, tune
from splitserve_worker.kv.tcp_wire import Answer, WireError
from splitserve_worker.kv.transport import (
    MAX_STREAMS,
    BackendContext,
    TransferError,
    TransferTarget,
)

CONNECT_TIMEOUT_S = 10.0
"""Connect, TLS and hello: longest a decode worker may take to let a push in."""
SEND_TIMEOUT_S = 30.0
"""Longest a write may wait for the decode side to take bytes (a stopped peer)."""
POOL_IDLE_S = 30.0
"""A pooled connection idle this long is closed rather than reused (the decode side
closes idle ones after :attr:`~.tcp_server.Limits.idle_timeout_s`)."""
POOL_PER_PEER = 2 * MAX_STREAMS
"""Idle connections kept per decode worker."""


def _refused(peer: str, answer: Answer, message: str) -> TransferError:
    return TransferError(
        f"the decode worker at {peer} refused the KV push: {answer.status.name}: {message}",
        "refused",
    )


class TcpConnection:
    """One handshaken connection to a decode worker's KV port."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.idle_since = time.monotonic()
        self._rbuf = bytearray()

    @classmethod
    def open(cls, host: str, port: int, *, token: str, compat_hash: str,
             tls: ssl.SSLContext | None, server_name: str | None) -> TcpConnection:  # fmt: skip
        peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            raise TransferError(f"cannot connect to the KV port {peer}: {e}", "stream") from None
        conn = cls(sock, peer)
        try:
            tune(sock)
            if tls is not None:
                conn.sock = tls.wrap_socket(sock, server_hostname=server_name)
            first, message = conn.answer()
            if first.kind == wire.ERROR:
                raise _refused(peer, first, message)
            if first.kind != wire.CHALLENGE:
                raise WireError("the KV port did not start with a challenge")
            send_all(conn.sock, [wire.hello(token, first.nonce, compat_hash)])
            second, message = conn.answer()
            if second.kind == wire.ERROR:
                raise _refused(peer, second, message)
            if second.kind != wire.READY:
                raise WireError("the KV port did not answer the hello")
        except (OSError, ssl.SSLError, WireError) as e:
            conn.close()
            raise TransferError(f"the KV connection to {peer} failed during the handshake: "
                                f"{e}", "stream") from None  # fmt: skip
        except TransferError:
            conn.close()
            raise
        conn.sock.settimeout(SEND_TIMEOUT_S)
        return conn

    def answer(self) -> tuple[Answer, str]:
        """The next answer and its message, waiting for it (the socket's timeout)."""
        while True:
            got = self._parse()
            if got is not None:
                return got
            need = wire.ANSWER.size if len(self._rbuf) < wire.ANSWER.size else 1
            self._rbuf += recv_exact(self.sock, need)

    def poll(self) -> tuple[Answer, str] | None:
        """An answer that has already arrived, if any, without waiting. Raises PeerClosed
        if the decode side closed the connection."""
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)
        closed = False
        try:
            while not closed:
                chunk = self.sock.recv(4096)
                closed = not chunk
                self._rbuf += chunk
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        finally:
            self.sock.settimeout(timeout)
        got = self._parse()  # an answer the close came after is still read
        if got is None and closed:
            raise PeerClosed(f"the decode worker at {self.peer} closed the connection")
        return got

    def _parse(self) -> tuple[Answer, str] | None:
        size = wire.ANSWER.size
        if len(self._rbuf) < size:
            return None
        head = wire.parse_answer(self._rbuf[:size])
        if len(self._rbuf) < size + head.message_len:
            return None
        text = bytes(self._rbuf[size : size + head.message_len]).decode(errors="replace")
        del self._rbuf[: size + head.message_len]
        return head, text

    def close(self) -> None:
        cut(self.sock)
        with contextlib.suppress(OSError):
            self.sock.close()


class _Pool:
    """Idle connections per decode KV port, shared by every push to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[TcpConnection]] = {}

    def take(self, key: tuple[str, int]) -> TcpConnection | None:
        while True:
            with self._lock:
                conns = self._idle.get(key)
                if not conns:
                    return None
                conn = conns.pop()
            usable = time.monotonic() - conn.idle_since < POOL_IDLE_S
            if usable:
                try:
                    usable = conn.poll() is None  # an idle connection has nothing to say
                except (OSError, ssl.SSLError, WireError):
                    usable = False
            if usable:
                return conn
            conn.close()

    def give(self, key: tuple[str, int], conn: TcpConnection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if len(conns) < POOL_PER_PEER:
                conns.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for conn in conns:
            conn.close()


class TcpStream:
    """One connection's part of a push (a :class:`~.span_sender.Stream`)."""

    def __init__(self, backend: TcpSenderBackend, target: TransferTarget, key: tuple[str, int],
                 tls: ssl.SSLContext | None) -> None:  # fmt: skip
        self._b = backend
        self._t = target
        self._key = key
        self._tls = tls
        self._lock = threading.Lock()
        self._conn: TcpConnection | None = None
        self._cancelled = False

    def _connect(self) -> TcpConnection:
        conn = self._b.pool.take(self._key)
        if conn is None:
            ctx = self._b.ctx
            # the name checked: the one every worker's certificate carries, else the host
            server_name = (ctx.tls.server_name if ctx.tls is not None else None) or self._key[0]
            conn = TcpConnection.open(*self._key, token=ctx.token, compat_hash=self._t.compat_hash,
                                      tls=self._tls, server_name=server_name)  # fmt: skip
        with self._lock:
            self._conn = conn
            cancelled = self._cancelled
        if cancelled:
            conn.close()
            raise TransferError("the push was cancelled", "aborted")
        return conn

    def run(self, spans: Iterator[SpanOut]) -> int:
        conn = self._connect()
        lease, heads = self._t.lease_id, self._t.pool_heads
        try:
            for s in spans:
                self._check(conn)
                header = wire.span(lease, s.layer, s.start, s.count, s.nbytes, s.crc32, heads)
                send_all(conn.sock, [header, *s.parts])
            send_all(conn.sock, [wire.end(lease, heads)])
            answer, message = conn.answer()
        except (OSError, ssl.SSLError, WireError) as e:
            refusal = self._refusal(conn)
            conn.close()
            if refusal is not None:
                raise refusal from None
            raise TransferError(f"the KV connection to {conn.peer} broke: {e}", "stream") from None
        except TransferError:
            conn.close()
            raise
        if answer.kind == wire.ERROR:
            conn.close()
            raise _refused(conn.peer, answer, message)
        if answer.kind != wire.ACK or answer.lease_id != lease:
            conn.close()
            raise TransferError(f"the KV port {conn.peer} answered out of turn", "stream")
        with self._lock:
            self._conn = None
        self._b.pool.give(self._key, conn)
        return answer.layers

    def _check(self, conn: TcpConnection) -> None:
        """Stop at the decode side's refusal as soon as it has come."""
        try:
            got = conn.poll()
        except PeerClosed as e:
            raise TransferError(str(e), "stream") from None
        if got is not None:
            answer, message = got
            if answer.kind == wire.ERROR:
                raise _refused(conn.peer, answer, message)
            raise WireError(f"an answer (kind {answer.kind}) in the middle of a push")

    @staticmethod
    def _refusal(conn: TcpConnection) -> TransferError | None:
        """The refusal that explains a broken connection, if it arrived before the break."""
        try:
            got = conn.poll()
        except (OSError, ssl.SSLError, WireError):
            return None
        if got is not None and got[0].kind == wire.ERROR:
            return _refused(conn.peer, *got)
        return None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            conn = self._conn
        if conn is not None:
            cut(conn.sock)


class TcpSenderBackend:
    name = "tcp"

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.pool = _Pool()
        self.streams = ctx.streams or default_streams()
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"KV streams must be 1 to {MAX_STREAMS}, got {self.streams}")
        self._tls = ctx.tls.client_context() if ctx.tls is not None and ctx.tls.verifies else None
        self._staging = HostStaging()
        """Device layers to pinned host memory, one side stream per device for every push."""
        self._sampler = SpanSampler(0 if ctx.checksums else ctx.checksum_every)
        """The spans that carry a crc32 when checksums are sampled, over every push."""

    def _key(self, target: TransferTarget) -> tuple[tuple[str, int], bool]:
        host = target.decode_address.rpartition(":")[0].strip("[]")
        try:
            port, tls = wire.parse_metadata(target.backend_metadata)
        except WireError as e:
            raise TransferError(str(e), "handle") from None
        if not host:
            raise TransferError(f"the handle's decode address {target.decode_address!r} has "
                                "no host", "handle")  # fmt: skip
        return (host, port), tls

    def open(self, target: TransferTarget) -> SpanSender:
        key, tls = self._key(target)
        if tls and self._tls is None:
            raise TransferError(
                f"the decode worker's KV port {key[0]}:{key[1]} speaks TLS: give this worker "
                "--tls-ca (the CA that signed its certificate)",
                "handle",
            )
        if not tls and self._tls is not None:
            raise TransferError(
                f"this worker pushes KV over TLS only (--tls-ca), and the decode worker's "
                f"KV port {key[0]}:{key[1]} is plain: give it --tls-cert and --tls-key",
                "handle",
            )
        streams = [TcpStream(self, target, key, self._tls) for _ in range(self.streams)]
        return SpanSender(target, self.ctx, list(streams), "tcp", self._staging, self._sampler)

    def close(self) -> None:
        self.pool.close()
