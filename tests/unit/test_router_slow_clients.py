"""Slow and greedy HTTP clients cannot hold the router: a request's head and body must
arrive within their timeouts however the bytes trickle in, and one client address holds
a bounded number of connections. Real uvicorn on 127.0.0.1, sockets by hand."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from mem_workers import MemWorker, mem_router
from raw_http import closed_by_peer, connect, read_answer, request_bytes
from splitserve_worker.router.config import HttpConfig
from splitserve_worker.router.local import RouterThread
from tiny_models import tiny_tokenizer

pytestmark = pytest.mark.unit

GUARD_S = 20.0
"""How long a trickling client keeps at it: far past the timeouts under test."""


@contextmanager
def serving(http: HttpConfig) -> Iterator[int]:
    service = mem_router([MemWorker("b1", "both")], tiny_tokenizer(), http=http)
    with RouterThread(service) as base:
        yield int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving(HttpConfig(header_timeout_s=0.5, body_timeout_s=0.5)) as p:
        yield p


def trickle(port: int, head: bytes, body: bytes = b"") -> tuple[bool, bytes]:
    """Send ``head`` then ``body`` a byte every 50 ms (a slowloris), until the server
    closes the connection or :data:`GUARD_S` passes: (closed by the server, its answer)."""
    sock = connect(port, timeout=0.05)
    got = b""
    deadline = time.monotonic() + GUARD_S
    try:
        for b in (head + body)[:-1]:  # never the last byte: the request is never whole
            try:
                sock.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                return True, got
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                chunk = None  # nothing yet: keep trickling
            except ConnectionResetError:
                return True, got
            if chunk == b"":
                return True, got
            got += chunk or b""
            if time.monotonic() > deadline:
                return False, got
        sock.settimeout(GUARD_S)
        return closed_by_peer(sock), got
    finally:
        sock.close()


def test_a_client_sending_its_head_a_byte_at_a_time_is_let_go(port: int) -> None:
    """Each byte used to keep the connection alive (sixty such held over 120 s)."""
    head = request_bytes("POST", "/v1/completions", {"prompt": "x" * 2000})
    closed, answer = trickle(port, head.split(b"\r\n\r\n")[0] + b"\r\n\r\n")
    assert closed, "a head trickling in for 20 s was still being read"
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_body_that_never_arrives_whole_is_let_go(port: int) -> None:
    request = request_bytes("POST", "/v1/completions", {"prompt": "x" * 2000})
    head, _, body = request.partition(b"\r\n\r\n")
    sock = connect(port)
    sock.sendall(head + b"\r\n\r\n" + body[:10])  # the head whole, then the body stops
    assert closed_by_peer(sock), "a body that stopped was waited for"
    sock.close()
    closed, _ = trickle(port, head + b"\r\n\r\n", body)
    assert closed, "a body trickling in for 20 s was still being read"


def test_requests_that_arrive_in_time_are_served_on_one_connection(port: int) -> None:
    sock = connect(port)
    try:
        for _ in range(3):
            sock.sendall(request_bytes("POST", "/v1/completions",
                                       {"prompt": [1, 2], "max_tokens": 2}))  # fmt: skip
            assert read_answer(sock).status == 200
            time.sleep(0.6)  # longer than the head timeout: it starts with the next request
    finally:
        sock.close()


def test_one_address_holds_a_bounded_number_of_connections() -> None:
    with serving(HttpConfig(max_connections_per_peer=3)) as port:
        held = [connect(port) for _ in range(3)]
        try:
            extra = connect(port)
            answer = read_answer(extra)
            assert answer.status == 503 and b"too many connections" in answer.body
            assert closed_by_peer(extra)
            extra.close()
            # those it holds are served; closing one makes room for another
            held[0].sendall(request_bytes("GET", "/v1/models"))
            assert read_answer(held[0]).status == 200
            held.pop().close()
            assert served_once_room_comes(port), "a closed connection's room never came back"
        finally:
            for sock in held:
                sock.close()


def served_once_room_comes(port: int) -> bool:
    """A new connection is served once the server has seen a held one close (it sees it
    a moment after the client closes it; until then a new one is refused)."""
    for _ in range(100):
        sock = connect(port)
        try:
            sock.sendall(request_bytes("GET", "/v1/models"))
            if read_answer(sock).status == 200:
                return True
        except ConnectionError:
            pass
        finally:
            sock.close()
        time.sleep(0.05)
    return False
