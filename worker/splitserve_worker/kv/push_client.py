"""A gRPC client for client-streaming calls whose messages are written from the caller's
buffers: each message goes to the socket as DATA frames pointing at the K and V tensors
(``sendmsg``), with no copy in this process.

:class:`Connection` is one HTTP/2 connection (a thread reads the peer's frames: settings,
window updates, pings, the answers); :meth:`Connection.call` opens a stream on it, a
:class:`Call`. Sending respects the peer's flow-control windows and frame size, so the
peer can be any gRPC server; the decode worker's push port advertises windows and frames
large enough that a message is one frame.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import grpc
import hpack

from splitserve_worker.kv import h2

CONNECT_TIMEOUT_S = 5.0
CANCEL_WAIT_S = 1.0
"""How long a cancel waits for the socket before cutting the connection."""
FRAMES_PER_WRITE = 64
"""DATA frames handed to one ``sendmsg`` at most (each is a header and 1 to 3 buffers)."""


class CallError(Exception):
    """The call ended with a gRPC status other than OK, or its connection failed."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_RESET_STATUS = {
    h2.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
    h2.CANCEL: grpc.StatusCode.CANCELLED,
}


class Call:
    """One client-streaming call: :meth:`send` messages, :meth:`close_send`, then
    :meth:`result` for the single answer."""

    def __init__(self, conn: Connection, stream_id: int, window: int) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.window = window
        self.response = bytearray()
        self.error: CallError | None = None
        self.ok = False
        self.sent_end = False

    def done(self) -> bool:
        return self.ok or self.error is not None

    def send(self, parts: list[memoryview | bytes], timeout: float | None = None) -> None:
        """One gRPC message, the concatenation of ``parts``; blocks while the peer's
        windows are closed. Raises CallError once the call has ended."""
        self._conn.send_message(self, parts, timeout)

    def close_send(self) -> None:
        """No more messages: an empty DATA frame ending the stream."""
        self._conn.end_stream(self)

    def result(self, timeout: float | None = None) -> bytes:
        """The answer's bytes (the one message the server sent) once the call ends OK."""
        self._conn.wait(self, timeout)
        if self.error is not None:
            raise self.error
        if len(self.response) < 5:
            raise CallError(grpc.StatusCode.INTERNAL, "the server sent no answer")
        return bytes(self.response[5:])

    def cancel(self) -> None:
        self._conn.cancel(self)


class Connection:
    """One HTTP/2 connection to a gRPC server, shared by the calls opened on it."""

    def __init__(self, host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.target = f"{host}:{port}"
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise CallError(
                grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.target}: {e}"
            ) from None
        self._sock.settimeout(None)
        h2.tune(self._sock)
        self._authority = self.target
        self._reader = h2.Reader(self._sock, 1 << 14)
        self._wlock = threading.Lock()  # socket writes and the header encoder's state
        self._cv = threading.Condition()  # windows, settings and call states
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._calls: dict[int, Call] = {}
        self._next_id = 1
        self._window = h2.DEFAULT_WINDOW
        self._peer_window = h2.DEFAULT_WINDOW
        self._peer_frame = h2.DEFAULT_FRAME_SIZE
        self._received = 0
        self.broken: str | None = None
        settings = {h2.SETTINGS_ENABLE_PUSH: 0, h2.SETTINGS_INITIAL_WINDOW_SIZE: h2.MAX_WINDOW}
        opening: list[memoryview | bytes] = [
            h2.PREFACE,
            h2.settings_frame(settings),
            h2.window_update(0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW),
        ]
        try:
            self._write(opening)
        except CallError:
            self._sock.close()
            raise
        self._thread = threading.Thread(
            target=self._read_loop, name=f"kv-push-{self.target}", daemon=True
        )
        self._thread.start()

    # ---- calls ----
    def call(self, path: str, metadata: tuple[tuple[str, str], ...], timeout: float | None) -> Call:
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self._authority),
            ("content-type", h2.GRPC_CONTENT_TYPE),
            ("te", "trailers"),
            ("user-agent", "splitserve-kv-push"),
        ]
        if timeout is not None:
            # at most 8 digits
            headers.append(("grpc-timeout", f"{min(max(1, int(timeout * 1000)), 10**8 - 1)}m"))
        headers += [(k.lower(), v) for k, v in metadata]
        with self._wlock:
            with self._cv:
                if self.broken is not None:
                    raise CallError(grpc.StatusCode.UNAVAILABLE, self.broken)
                sid = self._next_id
                self._next_id += 2
                call = Call(self, sid, self._peer_window)
                self._calls[sid] = call
            block = self._encoder.encode(headers)
            self._send_locked([h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block)])
        return call

    @property
    def usable(self) -> bool:
        return self.broken is None and self._next_id < 2**30

    def send_message(
        self, call: Call, parts: list[memoryview | bytes], timeout: float | None
    ) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        views.insert(0, memoryview(h2.grpc_prefix(size)))
        left = size + 5
        deadline = None if timeout is None else time.monotonic() + timeout
        while left:
            with self._cv:
                while True:
                    self._raise_if_ended(call)
                    if self._window > 0 and call.window > 0:
                        break
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        raise CallError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{self.target} opened no flow-control window for {timeout} s",
                        )
                    self._cv.wait(wait)
                n = min(left, self._window, call.window, self._peer_frame * FRAMES_PER_WRITE)
                self._window -= n
                call.window -= n
                frame_size = self._peer_frame
            left -= n
            buffers, views = h2.split_frames(call.stream_id, views, n, frame_size)
            self._write(buffers)

    def end_stream(self, call: Call) -> None:
        with self._cv:
            if call.sent_end or call.done():
                return
            call.sent_end = True
        self._write([h2.frame(h2.DATA, h2.END_STREAM, call.stream_id)])

    def cancel(self, call: Call) -> None:
        """End the call now (any thread). If a write holds the socket (a peer that stopped
        reading), the connection is cut instead: every call on it fails."""
        with self._cv:
            if call.done():
                return
            call.error = CallError(grpc.StatusCode.CANCELLED, "cancelled by the sender")
            self._calls.pop(call.stream_id, None)
            self._cv.notify_all()
        if not self._wlock.acquire(timeout=CANCEL_WAIT_S):
            self._fail_all(f"the connection to {self.target} was cut: a write was stuck")
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            return
        try:
            with contextlib.suppress(CallError):
                self._send_locked([h2.rst_stream(call.stream_id, h2.CANCEL)])
        finally:
            self._wlock.release()

    def wait(self, call: Call, timeout: float | None) -> None:
        with self._cv:
            if not self._cv.wait_for(call.done, timeout):
                raise CallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.target} did not answer within {timeout} s",
                )

    def close(self) -> None:
        self._fail_all("the connection was closed by this worker")
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    # ---- internals ----
    def _raise_if_ended(self, call: Call) -> None:
        if call.error is not None:
            raise call.error
        if call.ok:
            raise CallError(grpc.StatusCode.INTERNAL, "the server answered before the end")

    def _write(self, buffers: list[memoryview | bytes]) -> None:
        with self._wlock:
            self._send_locked(buffers)

    def _send_locked(self, buffers: list[memoryview | bytes]) -> None:
        try:
            h2.send_all(self._sock, buffers)
        except OSError as e:
            msg = f"the connection to {self.target} failed: {e}"
            self._fail_all(msg)
            raise CallError(grpc.StatusCode.UNAVAILABLE, msg) from None

    def _fail_all(self, why: str, after: int = 0) -> None:
        with self._cv:
            if after == 0 and self.broken is None:
                self.broken = why
            for sid in [s for s in self._calls if s > after]:
                call = self._calls.pop(sid)
                if not call.done():
                    call.error = CallError(grpc.StatusCode.UNAVAILABLE, why)
            self._cv.notify_all()

    def _read_loop(self) -> None:
        try:
            while True:
                self._on_frame(*self._reader.frame())
        except (h2.H2Error, OSError, hpack.HPACKError, ValueError) as e:
            self._fail_all(f"the connection to {self.target} ended: {e}")

    def _on_frame(self, kind: int, flags: int, sid: int, length: int) -> None:
        if kind == h2.DATA:
            payload = h2.strip_padding(flags, self._reader.read(length))
            self._consumed(length)
            with self._cv:
                call = self._calls.get(sid)
                if call is not None:
                    call.response += payload
        elif kind == h2.HEADERS:
            block = self._reader.header_block(flags, sid, self._reader.read(length))
            headers = h2.decode_headers(self._decoder, block)
            self._on_headers(sid, headers, bool(flags & h2.END_STREAM))
        elif kind == h2.RST_STREAM:
            (code,) = struct.unpack(">I", self._reader.read(length)[:4])
            status = _RESET_STATUS.get(code, grpc.StatusCode.INTERNAL)
            self._end_call(sid, CallError(status, f"the server reset the stream (code {code})"))
        elif kind == h2.SETTINGS:
            payload = self._reader.read(length)
            if not flags & h2.ACK:
                self._on_settings(h2.parse_settings(payload))
                self._write([h2.frame(h2.SETTINGS, h2.ACK, 0)])
        elif kind == h2.PING:
            payload = self._reader.read(length)
            if not flags & h2.ACK:
                self._write([h2.frame(h2.PING, h2.ACK, 0, payload)])
        elif kind == h2.WINDOW_UPDATE:
            (inc,) = struct.unpack(">I", self._reader.read(length)[:4])
            with self._cv:
                if sid == 0:
                    self._window += inc & h2.MAX_WINDOW
                elif sid in self._calls:
                    self._calls[sid].window += inc & h2.MAX_WINDOW
                self._cv.notify_all()
        elif kind == h2.GOAWAY:
            payload = self._reader.read(length)
            last, code = struct.unpack(">II", payload[:8])
            why = f"the server is going away (code {code}: {payload[8:].decode(errors='replace')})"
            with self._cv:
                self.broken = why
            self._fail_all(why, after=last & h2.MAX_WINDOW)
        else:  # PRIORITY, PUSH_PROMISE (refused by our settings), unknown: ignored
            self._reader.skip(length)

    def _on_settings(self, values: dict[int, int]) -> None:
        with self._cv:
            if h2.SETTINGS_INITIAL_WINDOW_SIZE in values:
                new = values[h2.SETTINGS_INITIAL_WINDOW_SIZE]
                delta, self._peer_window = new - self._peer_window, new
                for call in self._calls.values():
                    call.window += delta
            if h2.SETTINGS_MAX_FRAME_SIZE in values:
                self._peer_frame = values[h2.SETTINGS_MAX_FRAME_SIZE]
            self._cv.notify_all()

    def _consumed(self, n: int) -> None:
        """Give the server back the window its DATA used (answers are small: rarely)."""
        self._received += n
        if self._received >= h2.MAX_WINDOW // 2:
            inc, self._received = self._received, 0
            self._write([h2.window_update(0, inc)])

    def _on_headers(self, sid: int, headers: dict[str, str], end: bool) -> None:
        with self._cv:
            call = self._calls.get(sid)
            if call is None:
                return
            status = headers.get(":status")
            if status is not None and status != "200":
                self._end_call_locked(call, CallError(
                    grpc.StatusCode.UNAVAILABLE, f"the server answered HTTP {status}"))  # fmt: skip
                return
            if not end:
                return
            code = _CODES.get(int(headers.get("grpc-status", "2")), grpc.StatusCode.UNKNOWN)
            if code is grpc.StatusCode.OK:
                call.ok = True
                self._calls.pop(sid, None)
                self._cv.notify_all()
            else:
                details = h2.decode_grpc_message(headers.get("grpc-message", ""))
                self._end_call_locked(call, CallError(code, details))

    def _end_call(self, sid: int, error: CallError) -> None:
        with self._cv:
            call = self._calls.get(sid)
            if call is not None:
                self._end_call_locked(call, error)

    def _end_call_locked(self, call: Call, error: CallError) -> None:
        if not call.done():
            call.error = error
        self._calls.pop(call.stream_id, None)
        self._cv.notify_all()
