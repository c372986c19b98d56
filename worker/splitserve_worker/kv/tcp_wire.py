"""The ``tcp`` KV wire: fixed-size frames, pure (no sockets), so that every byte a peer
sends is checked here before anything uses it.

One connection, prefill worker (sender) to decode worker:

1. The decode side speaks first: an answer of kind ``CHALLENGE`` carrying a random
   nonce.
2. The sender's hello (:data:`HELLO`, 104 bytes): magic, version, the compat hash of
   the KV it pushes (64 hex characters) and HMAC-SHA256(worker token, nonce + compat
   hash). The token itself never travels, so a listener learns nothing it can replay.
3. The decode side answers ``READY``, or ``ERROR`` (UNAUTHENTICATED, FAILED_PRECONDITION)
   and closes: nothing after a failed hello is read.
4. Frames (:data:`FRAME`, 40 bytes). ``SPAN`` names a lease, a layer, tokens
   ``[start, start + count)``, optionally KV heads ``[head, head + heads)`` of the
   receiving pool (``heads`` 0: every head), the payload's length and optionally its
   crc32; the payload (the tokens' K, then their V, ``[count, heads, head_dim]`` each, as
   the pool stores them) follows and is received straight into the reserved blocks (a
   span of some heads through a staging buffer: its tokens are not contiguous there).
   ``END`` closes one lease's push on the connection, naming the heads it pushed,
   answered by ``ACK`` (layers complete in those heads, bytes received).
5. Any refusal is an ``ERROR`` answer (a :class:`Status` and a message) and ends the
   connection; the sender reports the message.

Every answer (:data:`ANSWER`, 40 bytes, then an ERROR's message) begins with the magic,
so a sender that reached some other port says so. Integers are big-endian.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from enum import IntEnum

MAGIC = b"SSKV"
VERSION = 1

HELLO = struct.Struct("!4sHH64s32s")
"""magic, version, flags (0), compat hash (ASCII hex), HMAC-SHA256 of the token."""
FRAME = struct.Struct("!BBBB16sIIIII")
"""kind, flags, first KV head, KV heads (0: every head), lease id, layer, start token,
token count, payload bytes, crc32."""
ANSWER = struct.Struct("!4sBBH16sIIQ")
"""magic, kind, status, version, lease id (a CHALLENGE's nonce), layers, message bytes,
payload bytes received."""

NONCE_BYTES = 16
LEASE_FIELD = 16
"""Bytes of a lease id on the wire (ASCII, padded with NUL)."""

SPAN, END = 1, 2
"""Frame kinds (sender to decode side)."""
HAS_CRC = 0x1
"""Frame flag: the ``crc32`` field is the payload's."""

CHALLENGE, READY, ACK, ERROR = 1, 2, 3, 4
"""Answer kinds (decode side to sender)."""

MAX_SPAN_BYTES = 64 << 20
"""Largest payload one span may carry (senders cut spans of about 4 MiB)."""
MAX_MESSAGE_BYTES = 1024
"""Longest message an ERROR answer carries."""
MAX_HEAD = 255
"""A frame names KV heads up to this (one byte each)."""


class Status(IntEnum):
    """Why a push or a connection was refused: gRPC's status codes, by number."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class WireError(Exception):
    """The bytes break the wire's rules: the connection ends (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Refusal:
    """A status and what to do about it: sent as an ERROR answer."""

    status: Status
    message: str


@dataclass(frozen=True)
class Frame:
    kind: int
    lease_id: str
    layer: int = 0
    start: int = 0
    count: int = 0
    nbytes: int = 0
    crc32: int | None = None
    head: int = 0
    heads: int = 0
    """The span's KV heads of the receiving pool, ``[head, head + heads)``; 0: all."""

    @property
    def head_range(self) -> range | None:
        """The span's heads, None for every head of the pool."""
        return range(self.head, self.head + self.heads) if self.heads else None


@dataclass(frozen=True)
class Answer:
    kind: int
    status: Status
    lease_id: str
    layers: int
    message_len: int
    nbytes: int
    nonce: bytes = b""


# ---- lease ids ----
def lease_field(lease_id: str) -> bytes:
    """``lease_id`` as the wire's 16-byte field."""
    raw = lease_id.encode("ascii", errors="replace")
    if not raw or len(raw) > LEASE_FIELD:
        raise WireError(
            f"lease id {lease_id!r} is not one a decode worker hands out (1 to "
            f"{LEASE_FIELD} ASCII characters)"
        )
    return raw.ljust(LEASE_FIELD, b"\0")


def lease_text(field: bytes) -> str:
    raw = field.rstrip(b"\0")
    if not raw or not all(0x21 <= b < 0x7F for b in raw):
        raise WireError("a frame's lease id is not printable ASCII")
    return raw.decode("ascii")


# ---- the handshake ----
def challenge(nonce: bytes) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    return ANSWER.pack(MAGIC, CHALLENGE, 0, VERSION, nonce, 0, 0, 0)


def proof(token: str, nonce: bytes, compat_hash: str) -> bytes:
    """HMAC-SHA256 over the nonce and the compat hash, keyed by the worker token."""
    return hmac.new(token.encode(), nonce + compat_hash.encode(), hashlib.sha256).digest()


def hello(token: str, nonce: bytes, compat_hash: str) -> bytes:
    raw = compat_hash.encode("ascii", errors="replace")
    if len(raw) != 64:
        raise WireError(f"a compat hash is 64 hex characters, got {compat_hash!r}")
    return HELLO.pack(MAGIC, VERSION, 0, raw, proof(token, nonce, compat_hash))


def check_hello(raw: bytes, token: str, nonce: bytes, compat_hash: str) -> Refusal | None:
    """None if ``raw`` (a whole :data:`HELLO`) proves the token and pushes KV of
    ``compat_hash``; else why not. The token is checked first: a peer without it learns
    nothing about this worker."""
    magic, version, flags, peer_hash, mac = HELLO.unpack(raw)
    if magic != MAGIC:
        return Refusal(
            Status.INVALID_ARGUMENT,
            "not a splitserve KV hello: this port takes the tcp KV backend's pushes only",
        )
    if version != VERSION or flags:
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"KV wire version {version} (flags {flags}); this worker speaks version {VERSION}: "
            "run the same splitserve release on both workers",
        )
    text = peer_hash.decode("ascii", errors="replace")
    if not hmac.compare_digest(mac, proof(token, nonce, text)):
        return Refusal(
            Status.UNAUTHENTICATED,
            "wrong worker token: give both workers the same --token-file "
            "(or SPLITSERVE_WORKER_TOKEN)",
        )
    if text != compat_hash:
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"KV stream compat hash {text[:16]} differs from this worker's {compat_hash[:16]}: "
            "start both workers with the same model, --dtype and --block-size",
        )
    return None


# ---- frames ----
def _head_fields(heads: range | None) -> tuple[int, int]:
    if heads is None:
        return 0, 0
    if not 0 <= heads.start < heads.stop <= MAX_HEAD + 1 or len(heads) > MAX_HEAD:
        raise WireError(f"KV heads {heads.start}..{heads.stop}: a frame names heads "
                        f"0..{MAX_HEAD}")  # fmt: skip
    return heads.start, len(heads)


def span(lease_id: str, layer: int, start: int, count: int, nbytes: int,
         crc32: int | None = None, heads: range | None = None) -> bytes:  # fmt: skip
    """A SPAN frame (of KV heads ``heads`` of the receiving pool, None: all); ``nbytes``
    of payload must follow it."""
    flags = HAS_CRC if crc32 is not None else 0
    head, n = _head_fields(heads)
    return FRAME.pack(SPAN, flags, head, n, lease_field(lease_id), layer, start, count,
                      nbytes, crc32 or 0)  # fmt: skip


def end(lease_id: str, heads: range | None = None) -> bytes:
    """An END frame of a push of KV heads ``heads`` (None: all)."""
    head, n = _head_fields(heads)
    return FRAME.pack(END, 0, head, n, lease_field(lease_id), 0, 0, 0, 0, 0)


def parse_frame(raw: bytes | bytearray | memoryview) -> Frame:
    """A whole :data:`FRAME`, checked: raises WireError for anything a sender never
    writes (unknown kinds or flags, empty or oversized spans, an END that carries more
    than a lease id and heads)."""
    kind, flags, head, heads, lease, layer, start, count, nbytes, crc = FRAME.unpack(raw)
    if head and not heads:
        raise WireError("a frame names a first KV head but no heads")
    if kind == SPAN:
        if flags & ~HAS_CRC:
            raise WireError(f"unknown span flags {flags:#x}")
        if not flags & HAS_CRC and crc:
            raise WireError("a span without the checksum flag carries a checksum")
        if count == 0 or nbytes == 0:
            raise WireError("a span of no tokens or no bytes")
        if nbytes > MAX_SPAN_BYTES:
            raise WireError(f"a span of {nbytes} bytes; spans are at most {MAX_SPAN_BYTES}")
        return Frame(SPAN, lease_text(lease), layer, start, count, nbytes,
                     crc if flags & HAS_CRC else None, head, heads)  # fmt: skip
    if kind == END:
        if flags or layer or start or count or nbytes or crc:
            raise WireError("an END frame carries only a lease id and heads")
        return Frame(END, lease_text(lease), head=head, heads=heads)
    raise WireError(f"unknown frame kind {kind}")


# ---- answers ----
def ready() -> bytes:
    return ANSWER.pack(MAGIC, READY, 0, VERSION, bytes(LEASE_FIELD), 0, 0, 0)


def ack(lease_id: str, layers: int, nbytes: int) -> bytes:
    return ANSWER.pack(MAGIC, ACK, 0, VERSION, lease_field(lease_id), layers, 0, nbytes)


def error(status: Status, message: str, lease_id: str = "") -> bytes:
    """An ERROR answer: the header and the message (cut to :data:`MAX_MESSAGE_BYTES`)."""
    text = message.encode("utf-8", errors="replace")[:MAX_MESSAGE_BYTES]
    lease = lease_field(lease_id) if lease_id else bytes(LEASE_FIELD)
    return ANSWER.pack(MAGIC, ERROR, int(status), VERSION, lease, 0, len(text), 0) + text


def parse_answer(raw: bytes | bytearray | memoryview) -> Answer:
    """A whole :data:`ANSWER` header (an ERROR's message follows it: ``message_len``)."""
    magic, kind, status, version, lease, layers, message_len, nbytes = ANSWER.unpack(raw)
    if magic != MAGIC:
        raise WireError("the peer is not a splitserve KV port (no magic in its answer)")
    if version != VERSION:
        raise WireError(
            f"the decode worker speaks KV wire version {version}, this one {VERSION}: run the "
            "same splitserve release on both"
        )
    if kind not in (CHALLENGE, READY, ACK, ERROR):
        raise WireError(f"unknown answer kind {kind}")
    if message_len > MAX_MESSAGE_BYTES or (message_len and kind != ERROR):
        raise WireError(f"an answer with a {message_len}-byte message")
    try:
        code = Status(status)
    except ValueError:
        raise WireError(f"unknown status {status} in an answer") from None
    if kind == CHALLENGE:
        return Answer(kind, code, "", 0, 0, 0, nonce=bytes(lease))
    lease_id = lease_text(lease) if any(lease) else ""
    return Answer(kind, code, lease_id, layers, message_len, nbytes)


# ---- what a Reserve handle carries ----
PORT_KEY = "tcp-port"
TLS_KEY = "tls"


def handle_metadata(port: int, tls: bool) -> bytes:
    """The decode worker's KV port (and whether it speaks TLS), for Reserve answers."""
    return f"{PORT_KEY}={port};{TLS_KEY}={int(tls)}".encode()


def parse_metadata(raw: bytes) -> tuple[int, bool]:
    """``(port, tls)`` from a Reserve handle's ``backend_metadata``."""
    try:
        fields = dict(part.split("=", 1) for part in raw.decode("ascii").split(";"))
        port, tls = int(fields[PORT_KEY]), fields.get(TLS_KEY, "0")
    except (UnicodeDecodeError, ValueError, KeyError):
        raise WireError(
            f"the handle names no tcp KV port ({raw[:40]!r}): Reserve with kv_backend=tcp on "
            "a decode worker"
        ) from None
    if not 0 < port < 65536 or tls not in ("0", "1"):
        raise WireError(f"the handle's tcp KV metadata is malformed: {raw[:40]!r}")
    return port, tls == "1"
