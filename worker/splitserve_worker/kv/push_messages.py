"""One PushKV call's messages, parsed out of DATA frame payloads as they arrive.

A message's fields come before its payload (:func:`kvwire.encode_head`), so once they are
read the :class:`PushSink` can say where the payload goes and the socket reader fills
those buffers directly. Messages whose fields do not come first (protobuf's own field
order puts some after the payload) or whose payload the sink does not place are read
whole and handed over as they are.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from splitserve_worker.kv import h2, kvwire
from splitserve_worker.kv.kvwire import KVSpan

HEAD_STEP = 512
"""Bytes read at a time while looking for a message's payload field."""
HEAD_MAX = 4096
"""A message whose payload field starts later than this is read whole."""
MAX_MESSAGE = 64 << 20
"""Largest message read whole (messages placed in the blocks have no such bound)."""


class PushFailure(Exception):
    """The call fails with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class PushSink(Protocol):
    """Where one call's messages go (the decode side). Any exception a method raises
    fails the call; :meth:`fail` turns it into the status sent back."""

    def target(self, head: KVSpan, size: int) -> list[memoryview] | None:
        """Buffers that take the ``size`` payload bytes of the message whose other fields
        are ``head``, in order; None to be handed the whole message instead."""
        ...

    def placed(self, head: KVSpan) -> None:
        """The payload is in the buffers :meth:`target` gave (``head`` now also holds the
        fields that came after the payload)."""
        ...

    def message(self, span: KVSpan) -> None:
        """A whole message that was not placed."""
        ...

    def end(self) -> bytes:
        """The client finished sending: the answer's serialized ``PushKVAck``."""
        ...

    def fail(self, error: BaseException | None) -> tuple[grpc.StatusCode, str]:
        """The call broke (``error``; None: the client cancelled or its connection went):
        free what it holds and say what status to answer."""
        ...


class Inbound:
    """One call's message parser: DATA frame payloads in, messages out to the sink."""

    def __init__(self, sink: PushSink) -> None:
        self.sink = sink
        self.frame_left = 0
        self._prefix = bytearray()
        self._left: int | None = None  # bytes of the current message still to come
        self._mode = ""
        self._buf = bytearray()  # the fields read so far, or the whole message
        self._filled = 0  # bytes of a message read whole that have arrived
        self._tail = bytearray()  # fields after a placed payload
        self._span = KVSpan()
        self._views: list[memoryview] = []
        self._data_left = 0

    @property
    def mid_message(self) -> bool:
        return self._left is not None or bool(self._prefix)

    def feed(self, reader: h2.Reader, n: int) -> None:
        """Consume exactly ``n`` payload bytes of a DATA frame (``frame_left`` says how
        many remain if a step raises)."""
        self.frame_left = n
        while self.frame_left:
            if self._left is None:
                self._read_prefix(reader)
            elif self._mode == "head":
                self._read_head(reader)
            elif self._mode == "data":
                self._read_data(reader)
            elif self._mode == "tail":
                self._tail += self._take(reader, self._left)
            else:
                self._read_whole(reader)
            if self._left == 0:
                self._finish()

    def _take(self, reader: h2.Reader, limit: int) -> bytes:
        got = reader.read(min(self.frame_left, limit))
        self.frame_left -= len(got)
        if self._left is not None:
            self._left -= len(got)
        return got

    def _read_prefix(self, reader: h2.Reader) -> None:
        self._prefix += self._take(reader, 5 - len(self._prefix))
        if len(self._prefix) < 5:
            return
        compressed, size = self._prefix[0], int.from_bytes(self._prefix[1:], "big")
        self._prefix.clear()
        if compressed:
            raise PushFailure(
                grpc.StatusCode.UNIMPLEMENTED,
                "compressed KV messages are not accepted: send them uncompressed",
            )
        self._left, self._mode, self._buf = size, "head", bytearray()

    def _to_buffer(self) -> None:
        """Read the rest of the message into one buffer of its size (after the bytes read
        so far), to hand it over whole."""
        assert self._left is not None
        size = len(self._buf) + self._left
        if size > MAX_MESSAGE:
            raise PushFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a KV message of {size} bytes whose payload cannot be placed as it arrives; "
                f"messages read whole are limited to {MAX_MESSAGE} bytes",
            )
        self._filled = len(self._buf)
        self._buf += bytes(self._left)
        self._mode = "buffer"

    def _read_whole(self, reader: h2.Reader) -> None:
        assert self._left is not None
        n = min(self.frame_left, self._left)
        reader.read_into([memoryview(self._buf)[self._filled : self._filled + n]])
        self._filled += n
        self.frame_left -= n
        self._left -= n

    def _read_head(self, reader: h2.Reader) -> None:
        assert self._left is not None
        self._buf += self._take(reader, min(self._left, HEAD_STEP))
        parsed = kvwire.decode_head(self._buf)
        if parsed is None:
            if self._left == 0 or len(self._buf) >= HEAD_MAX:
                self._to_buffer()
            return
        span, off, size = parsed
        if size > len(self._buf) - off + self._left:
            raise kvwire.WireError("the payload runs past the end of the message")
        views = self.sink.target(span, size)
        if views is None:
            self._to_buffer()
            return
        early = memoryview(self._buf)[off:]
        now, self._views = h2.split(views, min(size, len(early)))
        pos = 0
        for v in now:
            v[:] = early[pos : pos + len(v)]
            pos += len(v)
        self._tail = bytearray(early[pos:])
        self._span, self._data_left = span, size - pos
        self._mode = "data" if self._data_left else "tail"

    def _read_data(self, reader: h2.Reader) -> None:
        assert self._left is not None
        n = min(self.frame_left, self._data_left)
        now, self._views = h2.split(self._views, n)
        reader.read_into(now)
        self.frame_left -= n
        self._left -= n
        self._data_left -= n
        if not self._data_left:
            self._mode = "tail"

    def _finish(self) -> None:
        mode, self._left = self._mode, None
        if mode in ("head", "buffer"):
            self.sink.message(kvwire.decode(self._buf))
            return
        if self._tail:
            after = kvwire.decode(bytes(self._tail))
            if after.request_id or after.lease_id or after.layer or after.start_token \
                    or after.num_tokens or len(after.data):  # fmt: skip
                raise kvwire.WireError("a KV message repeats its placement after the payload")
            if after.crc32 is not None:
                self._span.crc32 = after.crc32
            if after.compat_hash:
                self._span.compat_hash = after.compat_hash
        self.sink.placed(self._span)
