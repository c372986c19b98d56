"""The KV push wire's pure parts: message heads read incrementally, frames cut to size,
and the socket reader's staged and in-place reads."""

from __future__ import annotations

import socket
import threading

import pytest
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.kv import h2, kvwire


def test_a_head_is_known_exactly_when_the_payload_key_and_length_have_arrived() -> None:
    span = kvwire.KVSpan("req", "lease", 3, 16, 8, compat_hash="c0ffee", crc32=99)
    data = bytes(range(200))
    raw = kvwire.encode(span, [data])
    start = len(raw) - len(data)
    for cut in range(len(raw) + 1):
        got = kvwire.decode_head(raw[:cut])
        if cut < start:
            assert got is None, cut
        else:
            head, off, size = got  # type: ignore[misc]
            assert (off, size) == (start, len(data))
            assert (head.request_id, head.lease_id, head.layer, head.start_token,
                    head.num_tokens, head.crc32, head.compat_hash) == (
                "req", "lease", 3, 16, 8, 99, "c0ffee")  # fmt: skip


def test_protobufs_own_order_has_fields_after_the_payload() -> None:
    # what any protobuf encoder writes: the head stops at the payload, the rest is decoded
    # whole (the push port reads such messages whole when the compat hash is missing)
    raw = pb.KVLayer(request_id="r", lease_id="l", layer=1, num_tokens=2, data=b"xyz",
                     crc32=5, compat_hash="h").SerializeToString()  # fmt: skip
    head, off, size = kvwire.decode_head(raw)  # type: ignore[misc]
    assert head.compat_hash == "" and head.crc32 is None and raw[off : off + size] == b"xyz"
    whole = kvwire.decode(raw)
    assert (whole.compat_hash, whole.crc32, bytes(whole.data)) == ("h", 5, b"xyz")
    assert kvwire.decode_head(pb.KVLayer(request_id="r").SerializeToString()) is None
    with pytest.raises(kvwire.WireError):
        kvwire.decode(raw[:-1])


def test_frames_carry_every_byte_in_order_and_the_rest_is_returned() -> None:
    views = [memoryview(b"abc"), memoryview(b"defgh"), memoryview(b"ij")]
    out, rest = h2.split_frames(5, views, 7, max_frame=3)
    frames, payload = [], b""
    for buf in out:
        if len(buf) == 9 and bytes(buf)[3] == h2.DATA:
            frames.append(int.from_bytes(bytes(buf)[:3], "big"))
            assert int.from_bytes(bytes(buf)[5:9], "big") == 5
        else:
            payload += bytes(buf)
    assert frames == [3, 3, 1] and payload == b"abcdefg"
    assert b"".join(bytes(v) for v in rest) == b"hij"


def test_grpc_messages_are_percent_encoded_both_ways() -> None:
    text = "50% of 'ü' failed\nagain"
    encoded = h2.encode_grpc_message(text)
    assert encoded.isascii() and "\n" not in encoded and "%25" in encoded
    assert h2.decode_grpc_message(encoded) == text


def test_the_reader_stages_small_reads_and_fills_buffers_in_place() -> None:
    a, b = socket.socketpair()
    blob = bytes(i % 251 for i in range(300_000))

    def write() -> None:
        a.sendall(blob)
        a.close()

    writer = threading.Thread(target=write)
    writer.start()
    r = h2.Reader(b, stage_size=1024)
    assert r.read(10) == blob[:10]
    r.skip(5)
    first, second = bytearray(100_000), bytearray(50_000)
    r.read_into([memoryview(first), memoryview(second)])
    assert bytes(first) == blob[15:100_015] and bytes(second) == blob[100_015:150_015]
    assert r.read(149_985) == blob[150_015:]
    with pytest.raises(h2.H2Error):
        r.read(1)
    writer.join()
    b.close()
