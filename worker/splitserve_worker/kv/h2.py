"""HTTP/2 frames and gRPC's message framing over a blocking socket: the KV push's wire.

What one client-streaming gRPC call needs and no more: the frames of RFC 9113 (headers
coded by the ``hpack`` package), flow-control windows, gRPC's length-prefixed messages
and its status trailers. Both ends of :mod:`.push_client` / :mod:`.push_server` use it;
any gRPC peer can talk to either.

:class:`Reader` reads small things (frame headers, a message's fields) through a staging
buffer and bulk payload straight into the caller's buffers (``recvmsg_into``), which is
the point: the KV bytes go from the socket into the reserved blocks in one copy.
"""

from __future__ import annotations

import socket
import struct
from urllib.parse import quote, unquote

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9

# flags
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# settings
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 1, 2, 3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5

# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
REFUSED_STREAM, CANCEL = 7, 8

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME_SIZE = 16_384
MAX_FRAME_SIZE = 2**24 - 1
IOV_MAX = 1024
"""Most buffers one ``sendmsg`` / ``recvmsg_into`` is given (Linux's limit)."""

GRPC_CONTENT_TYPE = "application/grpc"
MAX_HEADER_BLOCK = 1 << 20
"""Largest header block accepted (the peer's metadata), CONTINUATION frames included."""


class H2Error(Exception):
    """The connection is unusable: the peer broke the protocol or went away."""


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return struct.pack(">I", length)[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frame_header(len(payload), kind, flags, stream_id) + payload


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values.items()))


def parse_settings(payload: bytes) -> dict[int, int]:
    if len(payload) % 6:
        raise H2Error("a SETTINGS frame's length is not a multiple of 6")
    return dict(struct.iter_unpack(">HI", payload))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


def goaway(last_stream_id: int, code: int, debug: str = "") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, code) + debug.encode())


def grpc_prefix(size: int) -> bytes:
    """gRPC's 5-byte message prefix: not compressed, then the length."""
    return b"\0" + struct.pack(">I", size)


_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def encode_grpc_message(text: str) -> str:
    """``grpc-message``'s percent-encoding (of UTF-8 bytes outside printable ASCII)."""
    return quote(text, safe=_MESSAGE_SAFE)


def decode_grpc_message(text: str) -> str:
    return unquote(text)


def decode_headers(decoder: hpack.Decoder, block: bytes) -> dict[str, str]:
    """A header block as text (every block must pass the decoder, in order: its table)."""
    out: dict[str, str] = {}
    for name, value in decoder.decode(block):
        key = name.decode() if isinstance(name, bytes) else str(name)
        out[key] = value.decode() if isinstance(value, bytes) else str(value)
    return out


def strip_padding(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its pad length byte and padding."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise H2Error("a frame's padding is longer than the frame")
    return payload[1 : len(payload) - payload[0]]


DEAD_PEER_S = 30
"""A peer that acknowledges nothing for this long (its host gone, the network cut) ends
the connection, idle or not."""


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


def send_all(sock: socket.socket, buffers: list[memoryview | bytes]) -> None:
    """Write every byte of ``buffers`` with as few ``sendmsg`` calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        advance(views, sock.sendmsg(views[:IOV_MAX]))


class Reader:
    """Reads a blocking socket: small reads through a staging buffer, bulk reads straight
    into the caller's buffers. Raises H2Error when the peer closes the connection."""

    def __init__(self, sock: socket.socket, stage_size: int = 1 << 16) -> None:
        self._sock = sock
        self._stage = bytearray(stage_size)
        self._view = memoryview(self._stage)
        self._lo = self._hi = 0

    def _fill(self, need: int) -> None:
        """Have at least ``need`` (<= the stage's size) unread bytes staged."""
        if self._hi - self._lo >= need:
            return
        if self._lo:
            n = self._hi - self._lo
            self._stage[:n] = self._view[self._lo : self._hi]
            self._lo, self._hi = 0, n
        while self._hi < need:
            got = self._sock.recv_into(self._view[self._hi :])
            if not got:
                raise H2Error("the peer closed the connection")
            self._hi += got

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes (any size)."""
        if n <= len(self._stage):
            self._fill(n)
            out = bytes(self._view[self._lo : self._lo + n])
            self._lo += n
            return out
        buf = bytearray(n)
        self.read_into([memoryview(buf)])
        return bytes(buf)

    def read_into(self, views: list[memoryview]) -> None:
        """Fill every buffer in ``views`` completely, in order."""
        views = [v for v in views if len(v)]
        while views and self._lo < self._hi:  # what was staged already
            n = min(len(views[0]), self._hi - self._lo)
            views[0][:n] = self._view[self._lo : self._lo + n]
            self._lo += n
            views[0] = views[0][n:]
            if not len(views[0]):
                views.pop(0)
        while views:
            got = self._sock.recvmsg_into(views[:IOV_MAX])[0]
            if not got:
                raise H2Error("the peer closed the connection")
            advance(views, got)

    def skip(self, n: int) -> None:
        while n:
            step = min(n, len(self._stage))
            self._fill(step)
            self._lo += step
            n -= step

    def frame(self) -> tuple[int, int, int, int]:
        """The next frame's (type, flags, stream id, payload length)."""
        self._fill(9)
        length = int.from_bytes(self._view[self._lo : self._lo + 3], "big")
        kind, flags = self._stage[self._lo + 3], self._stage[self._lo + 4]
        sid = int.from_bytes(self._view[self._lo + 5 : self._lo + 9], "big") & MAX_WINDOW
        self._lo += 9
        return kind, flags, sid, length

    def header_block(self, flags: int, stream_id: int, payload: bytes) -> bytes:
        """A HEADERS frame's block fragment plus any CONTINUATION frames after it."""
        payload = strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        block = bytearray(payload)
        while not flags & END_HEADERS:
            kind, flags, sid, length = self.frame()
            if kind != CONTINUATION or sid != stream_id:
                raise H2Error("a header block was interrupted by another frame")
            if len(block) + length > MAX_HEADER_BLOCK:
                raise H2Error(f"a header block over {MAX_HEADER_BLOCK} bytes")
            block += self.read(length)
        return bytes(block)


def split(views: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of ``views``, and the rest (views of the same memory)."""
    first: list[memoryview] = []
    rest = list(views)
    while n:
        v = rest[0]
        if len(v) <= n:
            first.append(rest.pop(0))
            n -= len(v)
        else:
            first.append(v[:n])
            rest[0] = v[n:]
            n = 0
    return first, rest


def split_frames(
    stream_id: int, views: list[memoryview], size: int, max_frame: int
) -> tuple[list[memoryview | bytes], list[memoryview]]:
    """DATA frames carrying the first ``size`` bytes of ``views`` (frames of at most
    ``max_frame``): the buffers to write, and what is left of ``views``."""
    out: list[memoryview | bytes] = []
    rest = list(views)
    while size:
        n = min(size, max_frame)
        size -= n
        out.append(frame_header(n, DATA, 0, stream_id))
        payload, rest = split(rest, n)
        out += payload
    return out, rest
