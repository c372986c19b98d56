"""The decode side's tcp KV port against a sender written by hand: frames cut anywhere,
wrong tokens and compat hashes, unknown leases, misplaced and corrupt spans, truncated
frames, vanished and stalled senders, garbage, and more connections than it serves.

Payloads must land in the reserved blocks whatever the cuts; every refusal is an ERROR
answer with a status and a message, and ends only its own connection; a reservation a
failed push touched is freed, and a dropped lease's blocks see no byte after the drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
import zlib
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_kit import BareDecode, bare_decode, until
from splitserve.kv_compat import Compat
from splitserve_worker.kv import span_receiver
from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.kv.lease import Lease
from splitserve_worker.kv.tcp_server import Limits
from splitserve_worker.kv.tcp_wire import Answer, Status
from tls_kit import make_tls_files

pytestmark = pytest.mark.integration

TOKEN = "tcp-port-token"
L, NB, BS, H, D = 2, 24, 4, 2, 4
TOKEN_BYTES = H * D * 4
COMPAT = Compat("bare", "float32", BS, L, H, D, "LKBTHD-v1")


def decode(limits: Limits | None = None, **pacing: Any) -> AbstractAsyncContextManager[BareDecode]:
    return bare_decode(COMPAT, NB, limits=limits, token=TOKEN, **pacing)


class Raw:
    """The wire by hand: bytes as the test cuts them."""

    def __init__(self, port: int, source: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                             source_address=(source, 0))  # fmt: skip
        if tls is not None:
            self.sock = tls.wrap_socket(self.sock, server_hostname="127.0.0.1")
        self._buf = b""

    def answer(self) -> tuple[Answer, str]:
        while len(self._buf) < wire.ANSWER.size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before an answer")
            self._buf += chunk
        head = wire.parse_answer(self._buf[: wire.ANSWER.size])
        end = wire.ANSWER.size + head.message_len
        while len(self._buf) < end:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed inside an answer")
            self._buf += chunk
        message, self._buf = self._buf[wire.ANSWER.size : end].decode(), self._buf[end:]
        return head, message

    def hello(self, token: str = TOKEN, compat: str = COMPAT.hash) -> tuple[Answer, str]:
        challenge, _ = self.answer()
        assert challenge.kind == wire.CHALLENGE and len(challenge.nonce) == 16
        self.sock.sendall(wire.hello(token, challenge.nonce, compat))
        return self.answer()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed(self) -> bool:
        """Whether the port closed the connection (what is left unread is dropped)."""
        try:
            while chunk := self.sock.recv(65536):
                self._buf += chunk
        except (ConnectionResetError, ssl.SSLEOFError):  # a TLS peer's close without notify
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def ready(port: int, source: str = "127.0.0.1") -> Raw:
    c = Raw(port, source)
    answer, message = c.hello()
    assert answer.kind == wire.READY, message
    return c


def layer_kv(n: int, layer: int) -> torch.Tensor:
    """[2, n, H, D]: K then V, as a span's payload orders them."""
    return torch.randn(2, n, H, D, generator=torch.Generator().manual_seed(layer))


def payload(kv: torch.Tensor, start: int, n: int) -> bytes:
    return kv[:, start : start + n].contiguous().numpy().tobytes()


def span(lease: Lease | str, layer: int, start: int, data: bytes, *, count: int | None = None,
         crc: int | None = None) -> bytes:  # fmt: skip
    lease_id = lease if isinstance(lease, str) else lease.lease_id
    n = len(data) // (2 * TOKEN_BYTES) if count is None else count
    return wire.span(lease_id, layer, start, n, len(data), crc) + data


def read(d: BareDecode, lease: Lease, layer: int) -> torch.Tensor:
    k, v = d.read(lease, layer)
    return torch.stack([k, v])


@pytest.mark.parametrize("seed", range(4))
def test_spans_cut_anywhere_land_in_the_blocks(seed: int) -> None:
    rng = random.Random(seed)

    async def scenario() -> None:
        async with decode() as d:
            n, blocks = 22, rng.sample(range(NB), 6)
            lease = d.reserve("r", blocks, n)
            kvs = [layer_kv(n, layer + 10 * seed) for layer in range(L)]
            stream = b""
            for layer in range(L):
                for start in range(0, n, 5):
                    m = min(5, n - start)
                    data = payload(kvs[layer], start, m)
                    crc = zlib.crc32(data) if rng.random() < 0.5 else None
                    stream += span(lease, layer, start, data, crc=crc)
            stream += wire.end(lease.lease_id)

            def send() -> tuple[Answer, str]:
                c = ready(d.tcp_port)
                i = 0
                while i < len(stream):
                    cut = rng.choice([1, 2, 3, 5, 17, 39, 40, 41, 300, 2000])
                    c.send(stream[i : i + cut])
                    i += cut
                try:
                    return c.answer()
                finally:
                    c.close()

            answer, message = await asyncio.to_thread(send)
            assert answer.kind == wire.ACK, message
            assert (answer.lease_id, answer.layers) == (lease.lease_id, L)
            assert answer.nbytes == L * 2 * n * TOKEN_BYTES
            for layer in range(L):
                assert torch.equal(read(d, lease, layer), kvs[layer])
            others = [b for b in range(NB) if b not in blocks]
            assert d.pool[:, :, others].abs().sum() == 0

    asyncio.run(scenario())


def test_two_pushes_share_one_connection() -> None:
    async def scenario() -> None:
        async with decode() as d:
            a, b = d.reserve("a", [1, 2], 8), d.reserve("b", [3, 4], 8)
            kv_a, kv_b = layer_kv(8, 1), layer_kv(8, 2)

            def send() -> list[tuple[Answer, str]]:
                c = ready(d.tcp_port)
                for layer in range(L):
                    c.send(span(a, layer, 0, payload(kv_a, 0, 8)))
                    c.send(span(b, layer, 0, payload(kv_b, 0, 8)))
                c.send(wire.end(a.lease_id) + wire.end(b.lease_id))
                answers = [c.answer(), c.answer()]
                c.close()
                return answers

            answers = await asyncio.to_thread(send)
            assert [(x.kind, x.lease_id, x.layers) for x, _ in answers] == [
                (wire.ACK, a.lease_id, L), (wire.ACK, b.lease_id, L)]  # fmt: skip
            assert torch.equal(read(d, a, 1), kv_a) and torch.equal(read(d, b, 1), kv_b)

    asyncio.run(scenario())


@pytest.mark.parametrize("over", ["plain", "tls"])
def test_a_wrong_token_or_compat_is_refused_before_any_payload_is_read(
    over: str, tmp_path: Path
) -> None:
    server_tls = client_tls = None
    if over == "tls":  # the token is checked inside TLS too, not left to the certificate
        files = make_tls_files(tmp_path)
        server_tls = files.config(mutual=True).server_context()
        client_tls = files.config().client_context()

    async def scenario() -> None:
        async with bare_decode(COMPAT, NB, token=TOKEN, tls=server_tls) as d:
            lease = d.reserve("r", [1, 2], 8)
            data = payload(layer_kv(8, 0), 0, 8)
            other = Compat("bare", "bfloat16", BS, L, H, D, "LKBTHD-v1")
            cases = [
                ({"token": "wrong-token"}, Status.UNAUTHENTICATED, "wrong worker token"),
                ({"compat": other.hash}, Status.FAILED_PRECONDITION,
                 f"compat hash {other.hash[:16]} differs"),
            ]  # fmt: skip

            def attempt(kw: dict[str, str]) -> tuple[Answer, str, bool]:
                c = Raw(d.tcp_port, tls=client_tls)
                challenge, _ = c.answer()
                hello = wire.hello(kw.get("token", TOKEN), challenge.nonce,
                                   kw.get("compat", COMPAT.hash))  # fmt: skip
                c.send(hello + span(lease, 0, 0, data))  # a span right behind the hello
                answer, message = c.answer()
                closed = c.closed()
                c.close()
                return answer, message, closed

            for kw, status, words in cases:
                answer, message, closed = await asyncio.to_thread(attempt, kw)
                assert (answer.kind, answer.status) == (wire.ERROR, status), message
                assert words in message and closed
            assert lease.bytes_received == 0 and d.pool.abs().sum() == 0
            assert d.leases.contains("r")  # nothing touched it: it stays for a good push

    asyncio.run(scenario())


def test_refused_spans_answer_a_status_and_free_what_they_touched() -> None:
    async def scenario() -> None:
        async with decode() as d:
            data = payload(layer_kv(8, 0), 0, 8)
            grpc_lease = d.reserve("g", [9], 4, backend="grpc")
            cases: list[tuple[str, bytes, Status, str, bool]] = []
            for i, (what, make, status, words, freed) in enumerate([
                ("unknown lease", lambda le: span("0123456789abcdef", 0, 0, data),
                 Status.NOT_FOUND, "no reservation holds lease", False),
                ("misplaced span", lambda le: span(le, 0, 4, data), Status.DATA_LOSS,
                 "outside its reservation", True),
                ("layer past the model", lambda le: span(le, L, 0, data), Status.DATA_LOSS,
                 "outside its reservation", True),
                ("wrong size", lambda le: span(le, 0, 0, data[:-4], count=8),
                 Status.DATA_LOSS, "bytes for 8 tokens", True),
                ("corrupt payload", lambda le: span(le, 1, 0, data, crc=zlib.crc32(data) ^ 1),
                 Status.DATA_LOSS, "failed its checksum", True),
                ("another backend's lease", lambda le: span(grpc_lease, 0, 0, data[:64]),
                 Status.FAILED_PRECONDITION, "reserved for 'grpc'", False),
            ]):  # fmt: skip
                lease = d.reserve(f"r{i}", [2 * i, 2 * i + 1], 8)
                cases.append((what, make(lease), status, words, freed))

            def attempt(blob: bytes) -> tuple[Answer, str, bool]:
                c = ready(d.tcp_port)
                c.send(blob)
                answer, message = c.answer()
                closed = c.closed()
                c.close()
                return answer, message, closed

            for i, (what, blob, status, words, freed) in enumerate(cases):
                answer, message, closed = await asyncio.to_thread(attempt, blob)
                assert (answer.kind, answer.status) == (wire.ERROR, status), (what, message)
                assert words in message and closed, (what, message)
                if freed:  # the span was the lease's: the push failed, its blocks are freed
                    await until(lambda i=i: f"r{i}" in d.engine.released, what=what)
                    assert not d.leases.contains(f"r{i}"), what
            # the unknown lease and the other backend's touched no reservation
            assert d.leases.contains("r0") and d.leases.contains("g")
            assert d.engine.released == ["r1", "r2", "r3", "r4"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("what", "frame", "words"),
    [
        ("oversized length", wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1,
                                             wire.MAX_SPAN_BYTES + 1, 0), "at most"),
        ("zero tokens", wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 0, 8, 0), "no tokens"),
        ("zero bytes", wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"a" * 16, 0, 0, 1, 0, 0), "no bytes"),
        ("unknown kind", wire.FRAME.pack(9, 0, 0, 0, b"a" * 16, 0, 0, 1, 8, 0), "kind 9"),
        ("unknown flags", wire.FRAME.pack(wire.SPAN, 6, 0, 0, b"a" * 16, 0, 0, 1, 8, 0), "flags"),
        ("a first head of no heads", wire.FRAME.pack(wire.SPAN, 0, 1, 0, b"a" * 16, 0, 0, 1, 8,
                                                     0), "first KV head but no heads"),
        ("binary lease id", wire.FRAME.pack(wire.SPAN, 0, 0, 0, b"\xff" * 16, 0, 0, 1, 8, 0),
         "lease id"),
        ("end of a push never begun", wire.end("abcdef0123456789"), "never pushed"),
        ("end carrying a length", wire.FRAME.pack(wire.END, 0, 0, 0, b"a" * 16, 0, 0, 0, 4, 0),
         "only a lease id"),
    ],
)  # fmt: skip
def test_malformed_frames_end_the_connection(what: str, frame: bytes, words: str) -> None:
    async def scenario() -> None:
        async with decode() as d:
            lease = d.reserve("r", [1, 2], 8)

            def attempt() -> tuple[Answer, str, bool]:
                c = ready(d.tcp_port)
                c.send(frame)
                answer, message = c.answer()
                closed = c.closed()
                c.close()
                return answer, message, closed

            answer, message, closed = await asyncio.to_thread(attempt)
            assert (answer.kind, answer.status) == (wire.ERROR, Status.INVALID_ARGUMENT), message
            assert words in message and closed, message
            assert d.leases.contains("r") and lease.bytes_received == 0
            await until(lambda: d.tcp.open_connections == 0, what="the connection to go")

    asyncio.run(scenario())


@pytest.mark.parametrize("cut", ["inside a header", "inside a payload", "between spans",
                                 "after the hello"])  # fmt: skip
def test_a_sender_that_vanishes_frees_the_blocks(cut: str) -> None:
    async def scenario() -> None:
        async with decode() as d:
            n = 16
            lease = d.reserve("r", [4, 5, 6, 7], n)
            data = payload(layer_kv(n, 0), 0, n)
            first = span(lease, 0, 0, data)
            blob = {"inside a header": first + first[:20],
                    "inside a payload": first + first[: wire.FRAME.size + 100],
                    "between spans": first, "after the hello": b""}[cut]  # fmt: skip
            c = await asyncio.to_thread(ready, d.tcp_port)
            await asyncio.to_thread(c.send, blob)
            if blob:
                await until(lambda: lease.bytes_received > 0, what="the first span")
            c.close()
            if blob:
                await until(lambda: d.engine.released == ["r"], what="the blocks to be freed")
                assert not d.leases.contains("r")
                assert not d.handoff.span_receiver("tcp").placing(lease)
            await until(lambda: d.tcp.open_connections == 0, what="the connection to go")
            if not blob:  # a connection that pushed nothing held nothing
                assert d.leases.contains("r") and d.engine.released == []

    asyncio.run(scenario())


def test_a_stalled_span_lands_nothing_after_its_lease_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sender stops halfway through a payload being received into the blocks. A drop
    # (Release, expiry) waits a grace for it, then cuts the connection: once the drop
    # returns the blocks are the engine's, and the rest of the payload lands nowhere.
    monkeypatch.setattr(span_receiver, "PLACING_GRACE_S", 0.05)

    async def scenario() -> None:
        async with decode() as d:
            n = 16
            lease = d.reserve("r", [4, 5, 6, 7], n)
            data = payload(layer_kv(n, 0), 0, n)
            blob = span(lease, 0, 0, data)
            half = len(blob) - len(data) // 2
            c = await asyncio.to_thread(ready, d.tcp_port)
            await asyncio.to_thread(c.send, blob[:half])
            receiver = d.handoff.span_receiver("tcp")
            await until(lambda: receiver.placing(lease), what="the span to be under way")
            await d.handoff.drop("r", "released")
            assert not receiver.placing(lease) and not d.leases.contains("r")
            d.pool.zero_()
            with pytest.raises(OSError):
                for _ in range(50):  # the connection is cut: sending fails soon
                    await asyncio.to_thread(c.send, blob[half:])
                    await asyncio.sleep(0.02)
            await until(lambda: d.tcp.open_connections == 0, what="the connection to go")
            assert d.pool.abs().sum() == 0
            c.close()

    asyncio.run(scenario())


def test_garbage_ends_only_its_own_connection() -> None:
    # random bytes before and after a hello, a hello of another wire: each connection is
    # closed, the port keeps serving
    rng = random.Random(7)
    noise = bytes(rng.randrange(256) for _ in range(300))

    async def scenario() -> None:
        async with decode() as d:

            def poke(blob: bytes, after_hello: bool) -> bool:
                c = ready(d.tcp_port) if after_hello else Raw(d.tcp_port)
                with contextlib.suppress(OSError):
                    c.send(blob)
                    c.sock.shutdown(socket.SHUT_WR)  # a frame may claim more bytes than came
                closed = c.closed()
                c.close()
                return closed

            for blob, after in ((noise, False), (noise, True), (b"PRI * HTTP/2.0\r\n" * 8, False),
                                (b"GET / HTTP/1.1\r\n\r\n" * 8, False)):  # fmt: skip
                assert await asyncio.to_thread(poke, blob, after)
            n = 8
            lease = d.reserve("r", [2, 9], n)
            kv = layer_kv(n, 0)

            def good() -> tuple[Answer, str]:
                c = ready(d.tcp_port)
                for layer in range(L):
                    c.send(span(lease, layer, 0, payload(kv, 0, n)))
                c.send(wire.end(lease.lease_id))
                got = c.answer()
                c.close()
                return got

            answer, message = await asyncio.to_thread(good)
            assert answer.kind == wire.ACK and answer.layers == L, message
            assert torch.equal(read(d, lease, 1), kv)

    asyncio.run(scenario())


def test_connections_and_pushes_past_the_limits_are_refused() -> None:
    limits = Limits(max_connections=3, max_per_peer=2, max_pushes_per_connection=1)

    async def scenario() -> None:
        async with decode(limits) as d:
            a, b = d.reserve("a", [1], 4), d.reserve("b", [2], 4)
            data = payload(layer_kv(4, 0), 0, 4)

            def run() -> list[tuple[Answer, str]]:
                seen = []
                one, two = ready(d.tcp_port), ready(d.tcp_port)
                third = Raw(d.tcp_port)  # a third from the same peer
                seen.append(third.answer())
                other = ready(d.tcp_port, source="127.0.0.2")  # another peer: room for one
                fourth = Raw(d.tcp_port, source="127.0.0.3")  # but no more in all
                seen.append(fourth.answer())
                one.send(span(a, 0, 0, data) + span(b, 0, 0, data))  # two pushes at once
                seen.append(one.answer())
                for c in (one, two, third, other, fourth):
                    c.close()
                return seen

            seen = await asyncio.to_thread(run)
            for (answer, message), words in zip(seen, [
                    "2 KV connections from 127.0.0.1", "serves 3 KV connections already",
                    "more than 1 pushes open on one KV connection"], strict=True):  # fmt: skip
                assert (answer.kind, answer.status) == (wire.ERROR, Status.RESOURCE_EXHAUSTED)
                assert words in message, message
            await until(lambda: d.tcp.open_connections == 0, what="every connection to go")
            # the connection's push failed: its lease is freed; the other was never opened
            await until(lambda: d.engine.released == ["a"], what="a's blocks to be freed")
            assert d.leases.contains("b")

    asyncio.run(scenario())


@pytest.mark.parametrize("stage", ["before the hello", "after the hello"])
def test_a_silent_peer_is_let_go(stage: str) -> None:
    limits = replace(Limits(), handshake_timeout_s=0.1, idle_timeout_s=0.1)

    async def scenario() -> None:
        async with decode(limits) as d:
            c = await asyncio.to_thread(ready if stage == "after the hello" else Raw, d.tcp_port)
            assert await asyncio.to_thread(c.closed)  # returns once the port closed it
            c.close()
            await until(lambda: d.tcp.open_connections == 0, what="the connection to go")

    asyncio.run(scenario())


def test_a_pool_off_the_host_takes_spans_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    # a pool the socket cannot be read into (a GPU's): each payload is received into a
    # buffer and copied into the blocks; checksums and refusals hold the same
    from splitserve_worker.kv.layout import PoolView

    monkeypatch.setattr(PoolView, "byte_views", lambda self, *a: None)

    async def scenario() -> None:
        async with decode() as d:
            n = 10
            lease, bad = d.reserve("r", [3, 1, 8], n), d.reserve("bad", [5, 6, 7], n)
            kvs = [layer_kv(n, layer + 3) for layer in range(L)]

            def send() -> list[tuple[Answer, str]]:
                c = ready(d.tcp_port)
                for layer in range(L):
                    data = payload(kvs[layer], 0, n)
                    c.send(span(lease, layer, 0, data, crc=zlib.crc32(data)))
                c.send(wire.end(lease.lease_id))
                out = [c.answer()]
                c.close()
                c = ready(d.tcp_port)
                data = payload(kvs[0], 0, n)
                c.send(span(bad, 0, 0, data, crc=zlib.crc32(data) ^ 1))
                out.append(c.answer())
                c.close()
                return out

            (ack, _), (err, message) = await asyncio.to_thread(send)
            assert (ack.kind, ack.layers) == (wire.ACK, L)
            for layer in range(L):
                assert torch.equal(read(d, lease, layer), kvs[layer])
            assert (err.kind, err.status) == (wire.ERROR, Status.DATA_LOSS)
            assert "checksum" in message
            await until(lambda: d.engine.released == ["bad"], what="the corrupt push's blocks")

    asyncio.run(scenario())


def test_a_push_sends_no_more_than_its_reservation_holds() -> None:
    """Each token of each layer once: the same one-token span sent over and over (each
    renewing the lease, each a frame for the port's thread) is refused once the lease
    has had its reservation's bytes, and the lease is freed."""

    async def scenario() -> None:
        async with decode() as d:
            lease = d.reserve("r", [1, 2], 8)  # 2 layers of 8 tokens: 16 one-token spans
            one = payload(layer_kv(8, 0), 0, 1)

            def flood() -> tuple[Answer, str, bool]:
                c = ready(d.tcp_port)
                c.send(b"".join(span(lease, 0, 0, one) for _ in range(16)))
                c.send(span(lease, 0, 0, one))
                answer, message = c.answer()
                closed = c.closed()
                c.close()
                return answer, message, closed

            answer, message, closed = await asyncio.to_thread(flood)
            assert (answer.kind, answer.status) == (wire.ERROR, Status.RESOURCE_EXHAUSTED)
            assert "a span past the 1024 bytes its reservation holds" in message and closed
            assert lease.bytes_received == 16 * len(one)
            await until(lambda: "r" in d.engine.released, what="the flooded lease to be freed")

    asyncio.run(scenario())


def test_handshakes_past_the_limit_per_peer_are_turned_away() -> None:
    """Connections that never send their hello hold no more than their peer's share:
    the next is refused, another peer is served, and a hello frees a slot."""
    limits = Limits(max_handshakes_per_peer=2)

    async def scenario() -> None:
        async with decode(limits) as d:

            def run() -> list[tuple[Answer, str]]:
                silent = [Raw(d.tcp_port), Raw(d.tcp_port)]
                seen = [c.answer() for c in silent]  # their challenges, never answered
                third = Raw(d.tcp_port)
                seen.append(third.answer())
                other = Raw(d.tcp_port, source="127.0.0.2")
                seen.append(other.hello())
                silent[0].sock.sendall(wire.hello(TOKEN, seen[0][0].nonce, COMPAT.hash))
                seen.append(silent[0].answer())
                fourth = Raw(d.tcp_port)
                seen.append(fourth.answer())
                for c in (*silent, third, other, fourth):
                    c.close()
                return seen

            seen = await asyncio.to_thread(run)
            kinds = [a.kind for a, _ in seen]
            assert kinds == [wire.CHALLENGE, wire.CHALLENGE, wire.ERROR, wire.READY, wire.READY,
                             wire.CHALLENGE], seen  # fmt: skip
            answer, message = seen[2]
            assert answer.status == Status.RESOURCE_EXHAUSTED
            assert "2 KV connections from 127.0.0.1 have not sent their hello" in message
            await until(lambda: d.tcp.open_connections == 0, what="every connection to go")

    asyncio.run(scenario())


def test_a_flood_of_frames_is_paced_not_served_at_once() -> None:
    """Past its burst, a peer's frames wait their turn (the port's thread asleep): on a
    clock that stands still, each later frame is told to wait longer."""
    from clock_kit import FakeClock

    clock, slept = FakeClock(), list[float]()
    limits = Limits(frames_per_s=100.0, frame_burst=4)

    async def scenario() -> None:
        async with decode(limits, clock=clock, sleep=slept.append) as d:
            lease = d.reserve("r", [1, 2], 8)
            kv = layer_kv(8, 0)

            def send() -> tuple[Answer, str]:
                c = ready(d.tcp_port)
                c.send(b"".join(span(lease, 0, i, payload(kv, i, 1)) for i in range(8)))
                c.send(wire.end(lease.lease_id))
                got = c.answer()
                c.close()
                return got

            answer, _ = await asyncio.to_thread(send)
            assert answer.kind == wire.ACK and answer.layers == 1  # paced, then served whole
            # the 8 spans and the END: the first 4 within the burst, then 1/100 s more each
            assert slept == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05]), slept
            assert torch.equal(read(d, lease, 0), kv)

    asyncio.run(scenario())
