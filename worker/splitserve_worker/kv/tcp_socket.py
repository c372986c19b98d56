"""Blocking socket I/O for the ``tcp`` KV wire, on plain and TLS sockets alike: tuning,
vectored writes from the caller's buffers, exact reads into the caller's buffers.

Plain sockets write a frame and its payload with one ``sendmsg`` and fill scattered
block views with ``recvmsg_into``; TLS sockets (which support neither) write and read
each buffer in turn (``sendall`` / ``recv_into``). Either way no byte is copied in this
process: the kernel (or the TLS library) moves it between the socket and the tensors.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Sequence

IOV_MAX = 1024
"""Most buffers one ``sendmsg`` / ``recvmsg_into`` is given (Linux's limit)."""

DEAD_PEER_S = 30
"""A peer that acknowledges nothing for this long (its host gone, the network cut) ends
the connection, idle or not."""


class PeerClosed(ConnectionError):
    """The peer closed the connection before the bytes expected came."""


def tune(sock: socket.socket, buffer_bytes: int = 4 << 20) -> None:
    """A connection for bulk KV: no Nagle delay, big buffers, dead peers noticed within
    :data:`DEAD_PEER_S` (TCP keepalive while idle, the user timeout while sending)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4),
                        ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000)):  # fmt: skip
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (in place): what a partial write or read
    leaves to do."""
    while n:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0] = views[0][n:]
            n = 0


def send_all(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Write every byte of ``buffers``, in order."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        advance(views, sock.sendmsg(views[:IOV_MAX]))


def recv_into(sock: socket.socket, views: Sequence[memoryview], *,
              stop: list[bool] | None = None) -> None:  # fmt: skip
    """Fill every buffer of ``views`` completely, in order. ``stop`` (a one-item flag
    another thread may set) ends the read before its next call: at most the call under
    way still lands. Raises PeerClosed on EOF."""
    todo = [v for v in views if len(v)]
    tls = isinstance(sock, ssl.SSLSocket)
    while todo:
        if stop is not None and stop[0]:
            raise PeerClosed("the connection was cut")
        got = sock.recv_into(todo[0], len(todo[0])) if tls else sock.recvmsg_into(todo[:IOV_MAX])[0]
        if not got:
            raise PeerClosed("the peer closed the connection")
        advance(todo, got)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, [memoryview(buf)])
    return bytes(buf)


def cut(sock: socket.socket) -> None:
    """Shut the connection down from any thread: a read or write under way on it ends.
    (The plain socket's own ``shutdown``: a TLS socket's would drop its TLS state under
    the thread still using it.)"""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
