"""The grpc backend's hand-built KVLayer encoding is the protobuf encoding, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.kv import kvwire

pytestmark = pytest.mark.unit

ids = st.text(max_size=40)
ints = st.integers(min_value=0, max_value=2**31 - 1)


@settings(derandomize=True)
@given(rid=ids, lid=ids, layer=ints, start=ints, n=ints, data=st.binary(max_size=3000),
       crc=st.none() | st.integers(0, 2**32 - 1), compat=ids, cut=st.integers(0, 3000),
       hs=ints, hc=ints)  # fmt: skip
def test_encode_decode_match_protobuf(
    rid: str, lid: str, layer: int, start: int, n: int, data: bytes, crc: int | None,
    compat: str, cut: int, hs: int, hc: int,
) -> None:  # fmt: skip
    msg = pb.KVLayer(request_id=rid, lease_id=lid, layer=layer, start_token=start,
                     num_tokens=n, data=data, compat_hash=compat, kv_head_start=hs,
                     kv_head_count=hc)  # fmt: skip
    if crc is not None:
        msg.crc32 = crc
    span = kvwire.decode(msg.SerializeToString())
    assert (span.request_id, span.lease_id, span.layer, span.start_token, span.num_tokens,
            bytes(span.data), span.crc32, span.compat_hash, span.kv_head_start,
            span.kv_head_count) == (
        rid, lid, layer, start, n, data, crc, compat, hs, hc)  # fmt: skip
    assert span.head_range == (range(hs, hs + hc) if hc else None)
    parts = [memoryview(data)[:cut], data[cut:]]
    wire = kvwire.encode(kvwire.KVSpan(rid, lid, layer, start, n, crc32=crc,
                                       compat_hash=compat, kv_head_start=hs,
                                       kv_head_count=hc), parts)  # fmt: skip
    assert pb.KVLayer.FromString(wire) == msg


def test_decode_view_does_not_copy_the_payload() -> None:
    raw = pb.KVLayer(request_id="r", data=b"x" * 1000).SerializeToString()
    span = kvwire.decode(raw)
    assert isinstance(span.data, memoryview) and span.data.obj is raw


def test_decode_refuses_truncated_messages() -> None:
    raw = pb.KVLayer(request_id="r", data=b"x" * 100).SerializeToString()
    with pytest.raises(kvwire.WireError):
        kvwire.decode(raw[:-1])
