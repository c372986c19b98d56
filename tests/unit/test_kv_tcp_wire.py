"""The tcp KV wire's frames, pure: what a sender writes reads back the same, and any bytes
at all either read as a frame a sender could have written or are refused as WireError."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.kv.tcp_wire import Status, WireError

pytestmark = pytest.mark.unit

LEASE = "0123456789abcdef"
HASH = "ab" * 32
NONCE = bytes(range(16))
FIXED = settings(derandomize=True, max_examples=300, deadline=None)
"""CI runs the same examples every time; a longer search runs with another profile."""


u32 = st.integers(0, 2**32 - 1)


@FIXED
@given(layer=u32, start=u32, count=st.integers(1, 2**32 - 1),
       nbytes=st.integers(1, wire.MAX_SPAN_BYTES), crc=st.none() | u32,
       lease=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                     max_size=16),
       heads=st.none() | st.tuples(st.integers(0, 254), st.integers(1, 255)).map(
           lambda a: range(a[0], min(256, a[0] + a[1]))))  # fmt: skip
def test_a_span_reads_back_as_written(
    layer: int, start: int, count: int, nbytes: int, crc: int | None, lease: str,
    heads: range | None,
) -> None:  # fmt: skip
    raw = wire.span(lease, layer, start, count, nbytes, crc, heads)
    assert len(raw) == wire.FRAME.size
    frame = wire.parse_frame(raw)
    head, n = (heads.start, len(heads)) if heads else (0, 0)
    assert frame == wire.Frame(wire.SPAN, lease, layer, start, count, nbytes, crc, head, n)
    assert frame.head_range == heads
    end = wire.parse_frame(wire.end(lease, heads))
    assert end.kind == wire.END and end.head_range == heads


@pytest.mark.parametrize("heads", [range(0, 0), range(3, 3), range(255, 257), range(0, 256)])
def test_a_frame_names_at_least_one_head_and_no_more_than_it_can_hold(heads: range) -> None:
    with pytest.raises(WireError, match=r"a frame names heads 0\.\.255"):
        wire.span("a" * 16, 0, 0, 1, 8, None, heads)


@FIXED
@given(raw=st.binary(min_size=wire.FRAME.size, max_size=wire.FRAME.size))
@example(raw=wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1, 2**32 - 1, 0))
@example(raw=wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 0, 0, 0))
@example(raw=wire.FRAME.pack(wire.END, 1, 0, 0, b"a" * 16, 0, 0, 0, 0, 0))
@example(raw=bytes(wire.FRAME.size))
def test_any_bytes_are_a_writable_frame_or_refused(raw: bytes) -> None:
    try:
        frame = wire.parse_frame(raw)
    except WireError as e:
        assert str(e)
        return
    # accepted: exactly the bytes a sender writes for it, within every bound
    if frame.kind == wire.SPAN:
        again = wire.span(frame.lease_id, frame.layer, frame.start, frame.count, frame.nbytes,
                          frame.crc32, frame.head_range)  # fmt: skip
        assert 0 < frame.nbytes <= wire.MAX_SPAN_BYTES and frame.count > 0
    else:
        again = wire.end(frame.lease_id, frame.head_range)
    assert again == raw


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1, wire.MAX_SPAN_BYTES + 1, 0),
         "at most"),
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 0, 8, 0), "no tokens"),
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1, 0, 0), "no bytes"),
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1, 8, 5), "carries a checksum"),
        (wire.FRAME.pack(wire.SPAN, 2, 0, 0, b"a" * 16, 0, 0, 1, 8, 0), "flags"),
        (wire.FRAME.pack(wire.SPAN, 0, 7, 0, b"a" * 16, 0, 0, 1, 8, 0), "first KV head but no"),
        (wire.FRAME.pack(wire.END, 0, 7, 0, b"a" * 16, 0, 0, 0, 0, 0), "first KV head but no"),
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, bytes(16), 0, 0, 1, 8, 0), "lease id"),
        (wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"ab\ncd" + bytes(11), 0, 0, 1, 8, 0), "lease id"),
        (wire.FRAME.pack(wire.END, 0, 0, 0, b"a" * 16, 1, 0, 0, 0, 0), "only a lease id and heads"),
        (wire.FRAME.pack(0, 0, 0, 0, b"a" * 16, 0, 0, 1, 8, 0), "kind 0"),
    ],
)  # fmt: skip
def test_each_rule_of_a_frame_is_checked(raw: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        wire.parse_frame(raw)


def test_lease_ids_fit_the_field_or_are_refused() -> None:
    assert wire.lease_text(wire.lease_field(LEASE)) == LEASE
    assert wire.lease_text(wire.lease_field("short")) == "short"
    for bad in ("", "x" * 17):
        with pytest.raises(WireError, match="not one a decode worker hands out"):
            wire.lease_field(bad)


def test_a_hello_proves_the_token_for_this_nonce_and_compat() -> None:
    raw = wire.hello("s3cret", NONCE, HASH)
    assert len(raw) == wire.HELLO.size
    assert wire.check_hello(raw, "s3cret", NONCE, HASH) is None
    refusals = {
        "wrong token": wire.check_hello(raw, "other", NONCE, HASH),
        "replayed to another nonce": wire.check_hello(raw, "s3cret", bytes(16), HASH),
        "other compat": wire.check_hello(
            wire.hello("s3cret", NONCE, "cd" * 32), "s3cret", NONCE, HASH
        ),
        "other wire": wire.check_hello(b"HTTP" + raw[4:], "s3cret", NONCE, HASH),
        "other version": wire.check_hello(raw[:4] + b"\0\x09" + raw[6:], "s3cret", NONCE, HASH),
    }
    want = {
        "wrong token": (Status.UNAUTHENTICATED, "wrong worker token"),
        "replayed to another nonce": (Status.UNAUTHENTICATED, "wrong worker token"),
        "other compat": (Status.FAILED_PRECONDITION, "compat hash cdcdcdcdcdcdcdcd differs"),
        "other wire": (Status.INVALID_ARGUMENT, "not a splitserve KV hello"),
        "other version": (Status.FAILED_PRECONDITION, "KV wire version 9"),
    }
    for case, refusal in refusals.items():
        assert refusal is not None, case
        status, words = want[case]
        assert refusal.status is status and words in refusal.message, (case, refusal)
    assert b"s3cret" not in raw  # the token itself never travels
    with pytest.raises(WireError, match="64 hex"):
        wire.hello("s3cret", NONCE, "deadbeef")


def test_answers_read_back_and_bound_their_messages() -> None:
    head = wire.parse_answer(wire.challenge(NONCE))
    assert (head.kind, head.nonce) == (wire.CHALLENGE, NONCE)
    assert wire.parse_answer(wire.ready()).kind == wire.READY
    ack = wire.parse_answer(wire.ack(LEASE, 28, 1 << 40))
    assert (ack.kind, ack.lease_id, ack.layers, ack.nbytes) == (wire.ACK, LEASE, 28, 1 << 40)
    long = wire.error(Status.DATA_LOSS, "é" * 5000, LEASE)
    err = wire.parse_answer(long[: wire.ANSWER.size])
    assert (err.kind, err.status, err.lease_id) == (wire.ERROR, Status.DATA_LOSS, LEASE)
    assert err.message_len == wire.MAX_MESSAGE_BYTES == len(long) - wire.ANSWER.size
    for bad, words in [
        (b"HTTP" + wire.ready()[4:], "not a splitserve KV port"),
        (wire.ANSWER.pack(wire.MAGIC, 9, 0, wire.VERSION, bytes(16), 0, 0, 0), "kind 9"),
        (wire.ANSWER.pack(wire.MAGIC, wire.ERROR, 0, wire.VERSION, bytes(16), 0, 5000, 0),
         "5000-byte message"),
        (wire.ANSWER.pack(wire.MAGIC, wire.ERROR, 2, wire.VERSION, bytes(16), 0, 0, 0),
         "status 2"),
        (wire.ANSWER.pack(wire.MAGIC, wire.READY, 0, 7, bytes(16), 0, 0, 0), "version 7"),
    ]:  # fmt: skip
        with pytest.raises(WireError, match=words):
            wire.parse_answer(bad)


@FIXED
@given(raw=st.binary(min_size=wire.ANSWER.size, max_size=wire.ANSWER.size))
def test_any_answer_bytes_read_or_are_refused(raw: bytes) -> None:
    try:
        head = wire.parse_answer(raw)
    except WireError:
        return
    assert head.message_len <= wire.MAX_MESSAGE_BYTES


def test_a_handle_names_the_port_and_whether_it_speaks_tls() -> None:
    assert wire.parse_metadata(wire.handle_metadata(50052, False)) == (50052, False)
    assert wire.parse_metadata(wire.handle_metadata(7, True)) == (7, True)
    for bad in (b"", b"push-port=1", b"tcp-port=x", b"tcp-port=0;tls=0", b"tcp-port=5;tls=2",
                b"\xff\xfe"):  # fmt: skip
        with pytest.raises(WireError, match="tcp KV"):
            wire.parse_metadata(bad)
