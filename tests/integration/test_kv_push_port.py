"""The decode worker's KV push port against clients it did not write: grpcio's own, and a
hand-made HTTP/2 client that splits and pads frames anywhere and stalls or vanishes
mid-message. Payloads must land in the reserved blocks whatever the framing, failures
must be gRPC statuses, and a dropped lease's blocks must see no byte after the drop."""

from __future__ import annotations

import asyncio
import random
import socket
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import hpack
import pytest
import torch
from splitserve.metric_registry import Metrics
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.kv import grpc_receiver, h2, kvwire
from splitserve_worker.kv.compat import Compat
from splitserve_worker.kv.grpc_backend import PUSH_METHOD
from splitserve_worker.kv.grpc_receiver import GrpcReceiver
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseTable
from splitserve_worker.kv.transport import BackendContext
from splitserve_worker.server.handoff import DecodeHandoff
from splitserve_worker.server.push_sink import start_push_server

pytestmark = pytest.mark.integration

TOKEN = "push-port-token"
L, NB, BS, H, D = 2, 24, 4, 2, 4
TOKEN_BYTES = H * D * 4
COMPAT = Compat("bare", "float32", BS, L, H, D, "LKBTHD-v1")


class NoEngine:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def release(self, request_id: str) -> int:
        self.released.append(request_id)
        return 0


@dataclass
class Decode:
    port: int
    pool: torch.Tensor
    leases: LeaseTable
    handoff: DecodeHandoff
    engine: NoEngine

    def reserve(self, rid: str, blocks: list[int], n: int, ttl: float = 30) -> Lease:
        return self.leases.add(rid, blocks, num_tokens=n, num_layers=L, ttl=ttl, backend="grpc")

    def read(self, lease: Lease, layer: int) -> torch.Tensor:
        k, v = PoolView(self.pool).read(layer, lease.block_ids, 0, lease.num_tokens)
        return torch.stack([k, v])


@asynccontextmanager
async def decode_side() -> AsyncIterator[Decode]:
    pool = torch.zeros(L, 2, NB, BS, H, D)
    leases = LeaseTable()
    ctx = BackendContext(compat=COMPAT, token=TOKEN, pool=PoolView(pool), leases=leases)
    engine = NoEngine()
    handoff = DecodeHandoff(engine, COMPAT, PoolView(pool), leases, {"grpc": GrpcReceiver(ctx)},
                            default_backend="grpc", lease_seconds=30, address="",
                            metrics=Metrics())  # fmt: skip
    push = start_push_server(handoff, "127.0.0.1", 0, TOKEN)
    try:
        yield Decode(push.port, pool, leases, handoff, engine)
    finally:
        push.close()


def layer_kv(n: int, layer: int) -> torch.Tensor:
    """[2, n, H, D]: K then V, as a message's payload orders them."""
    return torch.randn(2, n, H, D, generator=torch.Generator().manual_seed(layer))


def span(lease: Lease, layer: int, start: int, n: int, **kw: object) -> kvwire.KVSpan:
    return kvwire.KVSpan(lease.request_id, lease.lease_id, layer, start, n,
                         compat_hash=COMPAT.hash, **kw)  # type: ignore[arg-type]  # fmt: skip


def payload(kv: torch.Tensor, start: int, n: int) -> bytes:
    return kv[:, start : start + n].contiguous().numpy().tobytes()


class RawClient:
    """HTTP/2 by hand: frames as the test cuts them."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = h2.Reader(self.sock)
        self.enc, self.dec = hpack.Encoder(), hpack.Decoder()
        self.sock.sendall(h2.PREFACE + h2.settings_frame({}))

    def open(self, sid: int, token: str = TOKEN, path: str = PUSH_METHOD) -> None:
        block = self.enc.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "kv"),
            ("content-type", "application/grpc"), ("te", "trailers"),
            ("authorization", f"Bearer {token}"),
        ])  # fmt: skip
        self.sock.sendall(h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block))

    def data(self, sid: int, chunk: bytes, *, pad: int = 0, end: bool = False) -> None:
        flags = h2.END_STREAM if end else 0
        if pad:
            chunk = bytes([pad]) + chunk + bytes(pad)
            flags |= h2.PADDED
        self.sock.sendall(h2.frame(h2.DATA, flags, sid, chunk))

    def answer(self, sid: int) -> tuple[int, str, bytes]:
        """(grpc-status, grpc-message, the answer's message bytes) of stream ``sid``."""
        body = b""
        while True:
            kind, flags, got_sid, length = self.reader.frame()
            raw = self.reader.read(length)
            if kind == h2.HEADERS and got_sid == sid:
                headers = h2.decode_headers(self.dec, self.reader.header_block(flags, sid, raw))
                if flags & h2.END_STREAM:
                    message = h2.decode_grpc_message(headers.get("grpc-message", ""))
                    return int(headers["grpc-status"]), message, body[5:]
            elif kind == h2.DATA and got_sid == sid:
                body += raw
            elif kind == h2.SETTINGS and not flags & h2.ACK:
                self.sock.sendall(h2.frame(h2.SETTINGS, h2.ACK, 0))

    def close(self) -> None:
        self.sock.close()


def message(s: kvwire.KVSpan, data: bytes, standard: bool = False) -> bytes:
    """A length-prefixed gRPC message: our field order (payload last) or protobuf's own."""
    if standard:
        raw = pb.KVLayer(request_id=s.request_id, lease_id=s.lease_id, layer=s.layer,
                         start_token=s.start_token, num_tokens=s.num_tokens, data=data,
                         compat_hash=s.compat_hash, crc32=s.crc32).SerializeToString()  # fmt: skip
    else:
        raw = kvwire.encode(s, [data])
    return h2.grpc_prefix(len(raw)) + raw


async def half_sent(d: Decode) -> tuple[Lease, RawClient, bytes]:
    """A message whose payload is half sent and being received into the blocks: its lease,
    the client, and the bytes still to send."""
    n = 16
    lease = d.reserve("r", [4, 5, 6, 7], n)
    data = payload(layer_kv(n, 0), 0, n)
    raw = message(span(lease, 0, 0, n), data)
    c = RawClient(d.port)
    c.open(1)
    half = len(raw) - len(data) // 2
    await asyncio.to_thread(c.data, 1, raw[:half])
    while not d.handoff.grpc_receiver().placing(lease):
        await asyncio.sleep(0.01)
    return lease, c, raw[half:]


@pytest.mark.parametrize("encoder", ["kvwire", "protobuf"])
def test_grpcio_clients_push_into_the_blocks(encoder: str) -> None:
    # kvwire puts the payload last (received in place); protobuf's order puts the compat
    # hash and crc after it (the message is read whole): both land the same bytes
    serialize = (kvwire.encode if encoder == "kvwire" else
                 lambda s: pb.KVLayer(request_id=s.request_id, lease_id=s.lease_id,
                                      layer=s.layer, start_token=s.start_token,
                                      num_tokens=s.num_tokens, data=bytes(s.data),
                                      crc32=s.crc32,
                                      compat_hash=s.compat_hash).SerializeToString())  # fmt: skip

    async def scenario() -> None:
        async with decode_side() as d:
            n, blocks = 30, [20, 3, 11, 7, 0, 15, 9, 1]
            lease = d.reserve("r", blocks, n)
            kvs = [layer_kv(n, layer) for layer in range(L)]
            msgs = []
            for layer in range(L):
                for start in range(0, n, 7):
                    m = min(7, n - start)
                    data = payload(kvs[layer], start, m)
                    msgs.append(span(lease, layer, start, m, data=memoryview(data),
                                     crc32=zlib.crc32(data)))  # fmt: skip
            with grpc.insecure_channel(f"127.0.0.1:{d.port}") as ch:
                push = ch.stream_unary(PUSH_METHOD, request_serializer=serialize,
                                       response_deserializer=pb.PushKVAck.FromString)  # fmt: skip
                ack = await asyncio.to_thread(
                    push, iter(msgs), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=20
                )
            assert ack.layers_received == L and ack.bytes_received == L * 2 * n * TOKEN_BYTES
            for layer in range(L):
                assert torch.equal(d.read(lease, layer), kvs[layer])
            others = [b for b in range(NB) if b not in blocks]
            assert d.pool[:, :, others].abs().sum() == 0

    asyncio.run(scenario())


def test_refusals_are_grpc_statuses() -> None:
    async def scenario() -> None:
        async with decode_side() as d:
            lease, other = d.reserve("r", [1, 2], 8), d.reserve("r2", [3, 4], 8)
            data = memoryview(payload(layer_kv(8, 0), 0, 8))
            good = span(lease, 0, 0, 8, data=data)
            stale = kvwire.KVSpan("r", "no-such-lease", 0, 0, 8, data, None, COMPAT.hash)
            cases = [
                ("wrong-token", PUSH_METHOD, good, grpc.StatusCode.UNAUTHENTICATED, "token"),
                (TOKEN, "/splitserve.v1.Worker/Commit", good, grpc.StatusCode.UNIMPLEMENTED,
                 "PushKV only"),
                (TOKEN, PUSH_METHOD, stale, grpc.StatusCode.NOT_FOUND, "no-such-lease"),
                (TOKEN, PUSH_METHOD, span(lease, 0, 4, 8, data=data),
                 grpc.StatusCode.DATA_LOSS, "outside its reservation"),
                (TOKEN, PUSH_METHOD, span(other, 0, 0, 8, data=data, crc32=7),
                 grpc.StatusCode.DATA_LOSS, "checksum"),
            ]  # fmt: skip
            with grpc.insecure_channel(f"127.0.0.1:{d.port}") as ch:
                for token, path, msg, code, words in cases:
                    call = ch.stream_unary(path, kvwire.encode, pb.PushKVAck.FromString)
                    auth = (("authorization", f"Bearer {token}"),)
                    with pytest.raises(grpc.RpcError) as e:
                        await asyncio.to_thread(call, iter([msg]), timeout=20, metadata=auth)
                    assert e.value.code() == code, e.value.details()
                    assert words in (e.value.details() or "")
            # the misplaced and the corrupt pushes freed their reservations
            assert d.engine.released == ["r", "r2"] and len(d.leases) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(4))
def test_frames_cut_and_padded_anywhere(seed: int) -> None:
    rng = random.Random(seed)

    async def scenario() -> None:
        async with decode_side() as d:
            n, blocks = 22, rng.sample(range(NB), 6)
            lease = d.reserve("r", blocks, n)
            kvs = [layer_kv(n, layer + 10 * seed) for layer in range(L)]
            stream = b""
            for layer in range(L):
                for start in range(0, n, 5):
                    m = min(5, n - start)
                    data = payload(kvs[layer], start, m)
                    s = span(lease, layer, start, m, crc32=zlib.crc32(data))
                    stream += message(s, data, standard=rng.random() < 0.3)

            def send() -> tuple[int, str, bytes]:
                c = RawClient(d.port)
                c.open(1)
                i = 0
                while i < len(stream):
                    cut = rng.choice([1, 2, 3, 5, 17, 64, 300, 2000])
                    c.data(1, stream[i : i + cut], pad=rng.choice([0, 0, 1, 9]))
                    i += cut
                c.data(1, b"", end=True)
                try:
                    return c.answer(1)
                finally:
                    c.close()

            status, details, body = await asyncio.to_thread(send)
            assert status == 0, details
            assert pb.PushKVAck.FromString(body).layers_received == L
            for layer in range(L):
                assert torch.equal(d.read(lease, layer), kvs[layer])

    asyncio.run(scenario())


def test_a_stalled_message_lands_nothing_after_its_lease_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sender stops halfway through a payload being received into the blocks. A drop
    # (Release, expiry) waits a grace for it, then cuts the connection: once the drop
    # returns the blocks are the engine's, and the rest of the payload lands nowhere.
    monkeypatch.setattr(grpc_receiver, "PLACING_GRACE_S", 0.3)

    async def scenario() -> None:
        async with decode_side() as d:
            lease, c, rest = await half_sent(d)
            t0 = time.monotonic()
            await d.handoff.drop("r", "released")
            assert time.monotonic() - t0 >= 0.25  # it waited for the write under way
            assert not d.handoff.grpc_receiver().placing(lease)
            d.pool.zero_()
            with pytest.raises(OSError):
                for _ in range(50):  # the connection is gone: sending fails soon
                    await asyncio.to_thread(c.data, 1, rest)
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            assert d.pool.abs().sum() == 0
            c.close()

    asyncio.run(scenario())


def test_a_sender_that_vanishes_mid_message_frees_the_blocks() -> None:
    async def scenario() -> None:
        async with decode_side() as d:
            lease, c, _ = await half_sent(d)
            c.close()
            for _ in range(200):
                if d.engine.released:
                    break
                await asyncio.sleep(0.02)
            assert d.engine.released == ["r"] and not d.leases.contains("r")
            assert not d.handoff.grpc_receiver().placing(lease)

    asyncio.run(scenario())


def test_garbage_ends_only_its_own_connection() -> None:
    # random bytes (with and without the preface), a frame on an even stream id, a header
    # block HPACK cannot read: each connection is dropped, the port keeps serving
    rng = random.Random(7)
    bad = [
        bytes(rng.randrange(256) for _ in range(300)),
        h2.PREFACE + bytes(rng.randrange(256) for _ in range(300)),
        h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 2, b"\x82"),
        h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xff\xff\xff\xff\xff"),
    ]

    async def scenario() -> None:
        async with decode_side() as d:

            def poke(blob: bytes) -> bytes:
                with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
                    s.sendall(blob)
                    s.shutdown(socket.SHUT_WR)  # a frame may claim more bytes than came
                    got = b""
                    while chunk := s.recv(65536):
                        got += chunk
                    return got

            for i, blob in enumerate(bad):
                reply = await asyncio.to_thread(poke, blob)  # returns: the server closed it
                kinds, at = [], 0
                while at + 9 <= len(reply):
                    kinds.append((reply[at + 3], reply[at + 9 : at + 17]))
                    at += 9 + int.from_bytes(reply[at : at + 3], "big")
                goaways = [p for k, p in kinds if k == h2.GOAWAY]
                if i >= 2:  # broken protocol: told so before the close
                    assert goaways and goaways[0][4:8] == h2.PROTOCOL_ERROR.to_bytes(4, "big")
            n = 8
            lease = d.reserve("r", [2, 9], n)
            kv = layer_kv(n, 0)
            msgs = [span(lease, layer, 0, n, data=memoryview(payload(kv, 0, n)))
                    for layer in range(L)]  # fmt: skip
            with grpc.insecure_channel(f"127.0.0.1:{d.port}") as ch:
                push = ch.stream_unary(PUSH_METHOD, kvwire.encode, pb.PushKVAck.FromString)
                auth = (("authorization", f"Bearer {TOKEN}"),)
                ack = await asyncio.to_thread(push, iter(msgs), timeout=20, metadata=auth)
            assert ack.layers_received == L
            assert torch.equal(d.read(lease, 1), kv)

    asyncio.run(scenario())


def test_a_push_that_stops_sending_loses_its_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    # The call stays open but nothing comes: each span renews the lease, so one well past
    # its expiry is stalled. The reaper frees its blocks; the next message is refused.
    from splitserve_worker.server import handoff as handoff_mod

    monkeypatch.setattr(handoff_mod, "STALLED_PUSH_S", 0.2)

    async def scenario() -> None:
        async with decode_side() as d:
            n = 8
            lease = d.reserve("r", [3, 8], n, ttl=0.3)
            kv = layer_kv(n, 0)
            c = RawClient(d.port)
            c.open(1)
            first = message(span(lease, 0, 0, n), payload(kv, 0, n))
            await asyncio.to_thread(c.data, 1, first)
            while lease.bytes_received == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.35)  # expired, but not yet stalled for long
            assert await d.handoff.reap_once() == 0 and d.leases.contains("r")
            await asyncio.sleep(0.3)
            assert await d.handoff.reap_once() == 1
            assert d.engine.released == ["r"] and not d.leases.contains("r")
            second = message(span(lease, 1, 0, n), payload(kv, 0, n))
            await asyncio.to_thread(c.data, 1, second, end=True)
            status, details, _ = await asyncio.to_thread(c.answer, 1)
            assert status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "expired" in details
            c.close()

    asyncio.run(scenario())
