"""``KVLayer`` (the ``grpc`` backend's message) without protobuf's extra copies of the
payload.

The bytes are exactly the protobuf encoding of ``splitserve.v1.KVLayer`` (any protobuf
peer can read or write them), but :func:`encode` assembles the message in one pass from
the K and V buffers (one copy: the one that makes the wire bytes), and :func:`decode`
returns the payload as a ``memoryview`` into the received message (no copy), so the
worker's gRPC server copies each byte once more, into the reserved blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field

# field numbers of splitserve.v1.KVLayer
(_REQUEST_ID, _LEASE_ID, _LAYER, _START, _NUM_TOKENS, _DATA, _CRC32, _COMPAT, _HEAD_START,
 _HEAD_COUNT) = range(1, 11)  # fmt: skip
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a well-formed KVLayer message."""


@dataclass
class KVSpan:
    """One decoded ``KVLayer``: the same field names, ``data`` a view, ``crc32`` or None."""

    request_id: str = ""
    lease_id: str = ""
    layer: int = 0
    start_token: int = 0
    num_tokens: int = 0
    data: memoryview = dc_field(default_factory=lambda: memoryview(b""))
    crc32: int | None = None
    compat_hash: str = ""
    kv_head_start: int = 0
    kv_head_count: int = 0

    @property
    def head_range(self) -> range | None:
        """The span's KV heads of the receiving pool; None for every head."""
        if not self.kv_head_count:
            return None
        return range(self.kv_head_start, self.kv_head_start + self.kv_head_count)


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wire: int) -> bytes:
    return _varint((num << 3) | wire)


def _head(span: KVSpan, data_size: int) -> bytes:
    """Every field of ``span`` but the payload, then the payload's key and length."""
    head = bytearray()
    for num, text in ((_REQUEST_ID, span.request_id), (_LEASE_ID, span.lease_id),
                        (_COMPAT, span.compat_hash)):  # fmt: skip
        if text:
            raw = text.encode()
            head += _key(num, _LEN) + _varint(len(raw)) + raw
    for num, n in ((_LAYER, span.layer), (_START, span.start_token),
                     (_NUM_TOKENS, span.num_tokens), (_HEAD_START, span.kv_head_start),
                     (_HEAD_COUNT, span.kv_head_count)):  # fmt: skip
        if n:
            head += _key(num, _VARINT) + _varint(n)
    if span.crc32 is not None:
        head += _key(_CRC32, _VARINT) + _varint(span.crc32)
    if data_size:
        head += _key(_DATA, _LEN) + _varint(data_size)
    return bytes(head)


def encode(span: KVSpan, parts: Sequence[memoryview | bytes] = ()) -> bytes:
    """The KVLayer bytes of ``span`` with ``data`` = the concatenation of ``parts``
    (``span.data`` when no parts are given)."""
    payload = list(parts) if parts else [span.data]
    return b"".join([_head(span, sum(len(p) for p in payload)), *payload])


class _Short(WireError):
    """The bytes end inside a varint."""


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        if i >= len(buf):
            raise _Short("truncated varint")
        if shift > 63:
            raise WireError("overlong varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def _signed32(n: int) -> int:
    n &= (1 << 64) - 1
    return n - (1 << 64) if n >= 1 << 63 else n


def _field(span: KVSpan, buf: memoryview, i: int) -> tuple[int, int, int] | None:
    """Parse the field at ``i`` into ``span``: (next index, field number, payload size for
    a length-delimited field); None if ``buf`` ends inside the field's key or size, or
    inside a length-delimited field other than the payload."""
    try:
        key, j = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            n, j = _read_varint(buf, j)
            if field == _LAYER:
                span.layer = _signed32(n)
            elif field == _START:
                span.start_token = _signed32(n)
            elif field == _NUM_TOKENS:
                span.num_tokens = _signed32(n)
            elif field == _HEAD_START:
                span.kv_head_start = _signed32(n)
            elif field == _HEAD_COUNT:
                span.kv_head_count = _signed32(n)
            elif field == _CRC32:
                span.crc32 = n & 0xFFFFFFFF
            return j, field, 0
        if wire == _LEN:
            size, j = _read_varint(buf, j)
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            return (j + size, field, 0) if j + size <= len(buf) else None
        else:
            raise WireError(f"unsupported wire type {wire} for field {field}")
    except _Short:
        return None
    if field == _DATA:
        return j, field, size
    if j + size > len(buf):
        return None
    text = bytes(buf[j : j + size]).decode()
    if field == _REQUEST_ID:
        span.request_id = text
    elif field == _LEASE_ID:
        span.lease_id = text
    elif field == _COMPAT:
        span.compat_hash = text
    return j + size, field, 0


def decode(raw: bytes | bytearray | memoryview) -> KVSpan:
    """Parse KVLayer bytes; unknown fields are skipped, as protobuf does."""
    buf = memoryview(raw)
    span = KVSpan()
    i = 0
    while i < len(buf):
        got = _field(span, buf, i)
        if got is None:
            raise WireError("truncated message")
        i, field, size = got
        if field == _DATA:
            if i + size > len(buf):
                raise WireError(f"field {field} runs past the end of the message")
            span.data = buf[i : i + size]
            i += size
    if i != len(buf):
        raise WireError("truncated message")
    return span
