"""HTTP/1.1 by hand over one socket, for tests that must see the connection itself: whether
it stays open after an answer, what a server does with a client that sends slowly or
stops reading. Blocking, with a timeout on every read (a hang guard, never a measure)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

GUARD_S = 30.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request_bytes(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                  raw_body: bytes | None = None) -> bytes:  # fmt: skip
    data = (
        raw_body if raw_body is not None else (b"" if body is None else json.dumps(body).encode())
    )
    lines = [f"{method} {path} HTTP/1.1", "Host: router"]
    if data or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def connect(port: int, timeout: float = GUARD_S) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_answer(sock: socket.socket) -> Answer:
    """One whole answer with a Content-Length body (raises if the peer closes first)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError(f"the server closed the connection mid-answer: {buf[:200]!r}")
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("the server closed the connection mid-body")
        rest += got
    return Answer(int(status_line.split()[1]), headers, rest[:length])


def closed_by_peer(sock: socket.socket) -> bool:
    """Wait (up to the socket's timeout) for the peer to close: True if it did."""
    try:
        while True:
            got = sock.recv(65536)
            if not got:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
