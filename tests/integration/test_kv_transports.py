"""Every KV backend on a bare pool (no engine): spans into scattered blocks, checksums,
a reservation dropped mid-push, stale leases, and leases that live exactly as long as
their push keeps arriving.

``tcp`` pushes go to the decode side's tcp KV port (plain and TLS), ``grpc`` pushes to
its gRPC server (grpcio's PushKV), ``nixl`` writes into the registered pool. Time is the
lease table's clock, moved by the test: no test waits on a window of wall-clock time.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from typing import Any

import grpc
import pytest
import torch
from kv_kit import BareDecode, bare_decode, until
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.kv import kvwire, span_sender
from splitserve_worker.kv.grpc_sender import PUSH_METHOD
from splitserve_worker.kv.layout import as_bytes, token_chunks
from splitserve_worker.kv.lease import Lease
from splitserve_worker.kv.nixl_common import loopback_env
from splitserve_worker.kv.transport import (
    BackendContext,
    KVSender,
    SenderBackend,
    TransferError,
    create_sender_backend,
    unavailable_reason,
)
from splitserve_worker.server import handoff as handoff_mod
from tls_kit import TlsFiles, make_tls_files

pytestmark = pytest.mark.integration
loopback_env()

TOKEN = "transport-token"
NIXL_SKIP = unavailable_reason("nixl")
L, NB, BS, H, D = 3, 40, 16, 2, 8
COMPAT = Compat("bare", "float32", BS, L, H, D, "LKBTHD-v1")
NIXL_MARKS = [pytest.mark.nixl, pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")]
NIXL = pytest.param("nixl", marks=NIXL_MARKS)
PATHS = ["tcp", "tcp+tls", "grpc", NIXL]
"""Every way KV moves: the backend, and ``+tls`` for the tcp port over TLS."""


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


class Way:
    """One way KV moves, opened on a bare decode side."""

    def __init__(self, name: str, tls_files: TlsFiles) -> None:
        self.backend, _, variant = name.partition("+")
        self.tls: TlsConfig | None = tls_files.config() if variant == "tls" else None

    def decode(self) -> Any:
        server_tls = self.tls.server_context() if self.tls is not None else None
        backends = ("nixl",) if self.backend == "nixl" else ("tcp", "grpc")
        return bare_decode(COMPAT, NB, backends=backends, tls=server_tls, token=TOKEN)

    def sender(self, d: BareDecode, *, checksums: bool = False, streams: int = 1) -> SenderBackend:
        ctx = BackendContext(compat=COMPAT, token=TOKEN, checksums=checksums, streams=streams,
                             tls=self.tls, clock=d.clock)  # fmt: skip
        return create_sender_backend(self.backend, ctx)


def fresh_kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
            for _ in range(L)]  # fmt: skip


def small_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny spans: one layer crosses several spans and several blocks."""
    monkeypatch.setattr(span_sender, "token_chunks", lambda n, b: token_chunks(n, b, 700))


def assert_landed(d: BareDecode, lease: Lease, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer in range(L):
        got_k, got_v = d.read(lease, layer)
        assert torch.equal(got_k, kv[layer][0]) and torch.equal(got_v, kv[layer][1])
    others = [b for b in range(NB) if b not in lease.block_ids]
    assert d.pool[:, :, others].abs().sum() == 0


@pytest.mark.parametrize(("path", "streams"), [
    ("tcp", 1), ("tcp", 3), ("tcp+tls", 2), ("grpc", 1), ("grpc", 3),
    pytest.param("nixl", 1, marks=NIXL_MARKS)])  # fmt: skip
def test_spans_land_in_scattered_blocks_with_checksums(
    path: str, streams: int, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the spans are dealt to ``streams`` connections: a layer's spans arrive out of order
    small_spans(monkeypatch)
    way = Way(path, tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n, blocks = 100, [33, 2, 17, 5, 39, 0, 21]
            lease = d.reserve("r", blocks, n, backend=way.backend)
            backend = way.sender(d, checksums=True, streams=streams)
            kv = fresh_kv(n, 1)
            sender = backend.open(d.target(lease))
            for start, end in ((0, 37), (37, 100)):  # two chunks, as a long prompt gives
                for layer in range(L):
                    k, v = kv[layer]
                    sender.send_layer(layer, k[start:end], v[start:end], start)
            stats = await asyncio.to_thread(sender.finish, 30)
            assert await asyncio.to_thread(d.receivers[way.backend].wait_layers, lease, 10)
            assert stats.layers_sent == L and stats.bytes_sent == L * 2 * n * H * D * 4
            assert_landed(d, lease, kv)
            for layer in range(L):
                assert stats.layer_crc32[2 * layer] == zlib.crc32(as_bytes(kv[layer][0]))
                assert stats.layer_crc32[2 * layer + 1] == zlib.crc32(as_bytes(kv[layer][1]))
            # a second push reuses the pooled connections
            lease2 = d.reserve("r2", [1, 3], 20, backend=way.backend)
            kv2 = fresh_kv(20, 2)
            sender = backend.open(d.target(lease2))
            for layer in range(L):
                sender.send_layer(layer, *kv2[layer], 0)
            await asyncio.to_thread(sender.finish, 30)
            got_k, _ = d.read(lease2, L - 1)
            assert torch.equal(got_k, kv2[L - 1][0])
            backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["tcp", "grpc"])
def test_a_push_writes_nothing_once_its_reservation_is_dropped(
    path: str, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Released mid-push (or dropped by a failing sibling stream): the blocks may be
    # someone else's from then on, so the spans still arriving must not land in them.
    small_spans(monkeypatch)
    way = Way(path, tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n, blocks = 100, [3, 4, 5, 6, 7, 8, 9]
            lease = d.reserve("r", blocks, n, backend=way.backend)
            backend = way.sender(d, streams=2)
            sender = backend.open(d.target(lease))
            kv = fresh_kv(n, 3)
            await asyncio.to_thread(sender.send_layer, 0, kv[0][0], kv[0][1], 0)
            await until(lambda: lease.bytes_received > 0, what="the first span")
            await d.handoff.drop("r", "released")
            assert not d.leases.contains("r")
            d.pool.zero_()
            for layer in range(1, L):
                k, v = kv[layer]
                await asyncio.to_thread(sender.send_layer, layer, k, v, 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            assert "dropped mid-push" in str(e.value) or "no reservation" in str(e.value)
            assert d.pool.abs().sum() == 0
            backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", PATHS)
def test_a_stale_lease_is_refused(path: str, tls_files: TlsFiles) -> None:
    way = Way(path, tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            lease = d.reserve("r", [1, 2], 20, backend=way.backend)
            if way.backend == "nixl":  # NIXL writes cannot be refused: the sender stops
                d.clock.advance(d.ttl + 1)
                target = d.target(lease)
            else:
                target = d.target(lease, lease_id="not-the-lease")
            backend = way.sender(d)
            sender = backend.open(target)
            for layer, (k, v) in enumerate(fresh_kv(20, 2)):
                sender.send_layer(layer, k, v, 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            words = "expired" if way.backend == "nixl" else "not-the-lease"
            assert words in str(e.value), e.value
            assert d.pool.abs().sum() == 0
            backend.close()

    asyncio.run(scenario())


def _landed(sender: KVSender, lease: Lease, layer: int, tokens: int) -> Any:
    """Tokens up to ``tokens`` of ``layer`` landed, and the sender knows (NIXL's renews
    its own deadline when it sees a write complete)."""
    return lambda: lease.layer_tokens[layer] >= tokens and not getattr(sender, "in_flight", 0)


@pytest.mark.parametrize("path", PATHS)
def test_a_push_lasting_several_leases_lives_while_it_keeps_arriving(
    path: str, tls_files: TlsFiles
) -> None:
    # Each span that lands renews the lease for a full TTL: a push that goes on for four
    # TTLs, with never a whole TTL between two spans, keeps its blocks to the end, and
    # the reaper, run between every two spans, takes nothing.
    way = Way(path, tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n, blocks = 40, [7, 1, 30]
            lease = d.reserve("r", blocks, n, backend=way.backend, ttl=10)
            backend = way.sender(d)
            sender = backend.open(d.target(lease))
            kv = fresh_kv(n, 5)
            waited = 0.0
            for layer in range(L):
                for start, end in ((0, 20), (20, 40)):
                    k, v = kv[layer]
                    await asyncio.to_thread(sender.send_layer, layer, k[start:end],
                                            v[start:end], start)  # fmt: skip
                    await until(_landed(sender, lease, layer, end), what=f"layer {layer} to {end}")
                    d.clock.advance(7)  # most of a TTL passes before the next span
                    waited += 7
                    assert await d.handoff.reap_once() == 0
                    assert d.leases.contains("r")
            assert waited > 4 * 10
            await asyncio.to_thread(sender.finish, 30)
            assert lease.complete and d.engine.released == []
            assert_landed(d, lease, kv)
            backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", PATHS)
def test_a_push_whose_sender_goes_quiet_expires_mid_push(path: str, tls_files: TlsFiles) -> None:
    # The sender pushes a layer, then says nothing for longer than a TTL: the next span
    # is refused ("expired mid-push") and the reaper frees the blocks; nothing of the
    # late span lands.
    way = Way(path, tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n = 20
            lease = d.reserve("r", [4, 9], n, backend=way.backend, ttl=10)
            backend = way.sender(d)
            sender = backend.open(d.target(lease))
            kv = fresh_kv(n, 6)
            await asyncio.to_thread(sender.send_layer, 0, kv[0][0], kv[0][1], 0)
            await until(_landed(sender, lease, 0, n), what="layer 0")
            d.clock.advance(11)  # past the lease: the push is expired, not yet stalled
            await asyncio.to_thread(sender.send_layer, 1, kv[1][0], kv[1][1], 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            assert "expired mid-push" in str(e.value), e.value
            d.clock.advance(handoff_mod.STALLED_PUSH_S + handoff_mod.NIXL_GRACE_S)
            await d.handoff.reap_once()
            assert not d.leases.contains("r") and d.engine.released == ["r"]
            _, got_v = d.read(lease, 1)
            assert got_v.abs().sum() == 0
            backend.close()

    asyncio.run(scenario())


def test_a_push_that_stops_sending_loses_its_lease_to_the_reaper(
    tls_files: TlsFiles,
) -> None:
    # The connection stays open but nothing comes: one well past its expiry is stalled.
    # The reaper leaves it alone while it may still just be slow, then frees its blocks;
    # the sender's next span is refused.
    way = Way("tcp", tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n = 8
            lease = d.reserve("r", [3, 8], n, ttl=10)
            backend = way.sender(d)
            sender = backend.open(d.target(lease))
            kv = fresh_kv(n, 7)
            await asyncio.to_thread(sender.send_layer, 0, kv[0][0], kv[0][1], 0)
            await until(_landed(sender, lease, 0, n), what="layer 0")
            d.clock.advance(11)  # expired, but not yet stalled for long
            assert await d.handoff.reap_once() == 0 and d.leases.contains("r")
            d.clock.advance(handoff_mod.STALLED_PUSH_S)
            assert await d.handoff.reap_once() == 1
            assert d.engine.released == ["r"] and not d.leases.contains("r")
            await asyncio.to_thread(sender.send_layer, 1, kv[1][0], kv[1][1], 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            assert "expired mid-push" in str(e.value) or "dropped" in str(e.value), e.value
            backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("sender_tls", "server_tls", "words"),
    [
        ("none", "tls", "give this worker --tls-ca"),
        ("ca", "none", "pushes KV over TLS only"),
        ("other-ca", "tls", "certificate verify failed"),
        ("wrong-name", "tls", "certificate verify failed"),
    ],
)
def test_tls_mismatches_fail_the_push_saying_what_to_set(
    sender_tls: str, server_tls: str, words: str, tls_files: TlsFiles
) -> None:
    configs = {
        "none": None,
        "ca": TlsConfig(ca_file=str(tls_files.ca)),
        "other-ca": TlsConfig(ca_file=str(tls_files.other_ca)),
        "wrong-name": TlsConfig(ca_file=str(tls_files.ca), server_name="someone-else.test"),
    }

    async def scenario() -> None:
        context: ssl.SSLContext | None = None
        if server_tls == "tls":
            context = tls_files.config().server_context()
        async with bare_decode(COMPAT, NB, tls=context, token=TOKEN) as d:
            lease = d.reserve("r", [1], 10)
            ctx = BackendContext(compat=COMPAT, token=TOKEN, tls=configs[sender_tls])
            backend = create_sender_backend("tcp", ctx)
            with pytest.raises(TransferError) as e:
                sender: KVSender = backend.open(d.target(lease))
                for layer, (k, v) in enumerate(fresh_kv(10, 1)):
                    sender.send_layer(layer, k, v, 0)
                await asyncio.to_thread(sender.finish, 30)
            assert words in str(e.value), e.value
            assert lease.bytes_received == 0
            backend.close()

    asyncio.run(scenario())


def test_tls_with_the_server_name_checked_lands_the_push(tls_files: TlsFiles) -> None:
    from tls_kit import SERVER_NAME

    async def scenario() -> None:
        context = tls_files.config().server_context()
        async with bare_decode(COMPAT, NB, tls=context, token=TOKEN) as d:
            lease = d.reserve("r", [5, 6], 20)
            cfg = tls_files.config(server_name=SERVER_NAME)
            backend = create_sender_backend("tcp", BackendContext(COMPAT, TOKEN, tls=cfg))
            sender = backend.open(d.target(lease))
            kv = fresh_kv(20, 4)
            for layer in range(L):
                sender.send_layer(layer, *kv[layer], 0)
            await asyncio.to_thread(sender.finish, 30)
            got_k, got_v = d.read(lease, 2)
            assert torch.equal(got_k, kv[2][0]) and torch.equal(got_v, kv[2][1])
            backend.close()

    asyncio.run(scenario())


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_nixl_layers_spread_over_posting_lanes(lanes: int, tls_files: TlsFiles) -> None:
    from splitserve_worker.kv.nixl_backend import NixlSenderBackend

    way = Way("nixl", tls_files)

    async def scenario() -> None:
        async with way.decode() as d:
            n, blocks = 40, [9, 3, 30]
            lease = d.reserve("r", blocks, n, backend="nixl")
            sender_backend = NixlSenderBackend(BackendContext(compat=COMPAT, token=TOKEN), lanes)
            posted: list[tuple[int, int]] = []
            for i, lane in enumerate(sender_backend.lanes):

                def put(job: Any, i: int = i, put: Any = lane.jobs.put) -> None:
                    posted.append((i, job.layer))
                    put(job)

                lane.jobs.put = put  # type: ignore[method-assign]
            kv = fresh_kv(n, 3)
            sender = sender_backend.open(d.target(lease))
            for layer in range(L):
                sender.send_layer(layer, *kv[layer], 0)
            await asyncio.to_thread(sender.finish, 30)
            assert await asyncio.to_thread(d.receivers["nixl"].wait_layers, lease, 10)
            assert sorted(posted) == sorted((layer % lanes, layer) for layer in range(L))
            assert_landed(d, lease, kv)
            sender_backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("encoder", ["kvwire", "protobuf"])
def test_any_grpc_client_pushes_to_the_grpc_port(encoder: str) -> None:
    # grpcio's own client with protobuf's encoding (any gRPC peer) and with the grpc
    # backend's (payload built in one pass): both land the same bytes
    def protobuf(item: Any) -> bytes:
        s, parts = item
        return pb.KVLayer(request_id=s.request_id, lease_id=s.lease_id, layer=s.layer,
                          start_token=s.start_token, num_tokens=s.num_tokens,
                          data=b"".join(bytes(p) for p in parts), crc32=s.crc32,
                          compat_hash=s.compat_hash).SerializeToString()  # fmt: skip

    serialize = (lambda item: kvwire.encode(*item)) if encoder == "kvwire" else protobuf

    async def scenario() -> None:
        async with bare_decode(COMPAT, NB, backends=("grpc",), token=TOKEN) as d:
            n, blocks = 30, [20, 3, 11]
            lease = d.reserve("r", blocks, n, backend="grpc")
            kv = fresh_kv(n, 8)
            msgs = []
            for layer in range(L):
                for start in range(0, n, 7):
                    m = min(7, n - start)
                    k, v = (as_bytes(t[start : start + m].contiguous()) for t in kv[layer])
                    head = kvwire.KVSpan("r", lease.lease_id, layer, start, m,
                                         crc32=zlib.crc32(v, zlib.crc32(k)),
                                         compat_hash=COMPAT.hash)  # fmt: skip
                    msgs.append((head, (k, v)))
            with grpc.insecure_channel(d.address) as ch:
                push = ch.stream_unary(PUSH_METHOD, request_serializer=serialize,
                                       response_deserializer=pb.PushKVAck.FromString)  # fmt: skip
                ack = await asyncio.to_thread(
                    push, iter(msgs), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=20
                )
            assert ack.layers_received == L and ack.bytes_received == L * 2 * n * H * D * 4
            assert_landed(d, lease, kv)

    asyncio.run(scenario())


def test_grpc_refusals_are_statuses() -> None:
    async def scenario() -> None:
        async with bare_decode(COMPAT, NB, backends=("grpc",), token=TOKEN) as d:
            lease = d.reserve("r", [1], 8, backend="grpc")
            other = d.reserve("r2", [3], 8, backend="grpc")
            data = b"\0" * (2 * 8 * H * D * 4)
            cases = [
                ("wrong-token", kvwire.KVSpan("r", lease.lease_id, 0, 0, 8, memoryview(data),
                 compat_hash=COMPAT.hash), grpc.StatusCode.UNAUTHENTICATED, "token"),
                (TOKEN, kvwire.KVSpan("r", "no-such-lease", 0, 0, 8, memoryview(data),
                 compat_hash=COMPAT.hash), grpc.StatusCode.NOT_FOUND, "no-such-lease"),
                (TOKEN, kvwire.KVSpan("r", lease.lease_id, 0, 4, 8, memoryview(data),
                 compat_hash=COMPAT.hash), grpc.StatusCode.DATA_LOSS, "outside its reservation"),
                (TOKEN, kvwire.KVSpan("r2", other.lease_id, 0, 0, 8, memoryview(data), crc32=7,
                 compat_hash=COMPAT.hash), grpc.StatusCode.DATA_LOSS, "checksum"),
            ]  # fmt: skip
            with grpc.insecure_channel(d.address) as ch:
                for token, msg, code, words in cases:
                    call = ch.stream_unary(PUSH_METHOD, kvwire.encode, pb.PushKVAck.FromString)
                    auth = (("authorization", f"Bearer {token}"),)
                    with pytest.raises(grpc.RpcError) as e:
                        await asyncio.to_thread(call, iter([msg]), timeout=20, metadata=auth)
                    assert e.value.code() == code, e.value.details()
                    assert words in (e.value.details() or "")
            # the misplaced and the corrupt pushes freed their reservations
            assert d.engine.released == ["r", "r2"] and len(d.leases) == 0

    asyncio.run(scenario())
