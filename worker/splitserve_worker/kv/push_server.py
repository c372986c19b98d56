"""The decode worker's KV push port: a gRPC server for ``PushKV`` alone that receives each
message's payload straight into the reserved blocks.

gRPC's own server hands a handler each message as a new ``bytes`` (copied twice on the
way); here the thread that owns a connection parses HTTP/2 frames itself, reads a
message's fields first (they come before the payload), asks the :class:`PushSink` where
the payload goes, and lets the kernel copy it there (``recvmsg_into``). Messages it cannot
place that way (another encoder's field order, a pool on a GPU) are read whole and handed
over as they are. Any gRPC client can call it: the answer is a ``PushKVAck`` with the
usual status trailers, and errors are gRPC statuses.

It advertises a window and frame size large enough that a sender moves a message as one
frame, and gives the windows back as bytes arrive.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
from collections.abc import Callable

import grpc
import hpack

from splitserve_worker.kv import h2
from splitserve_worker.kv.push_messages import Inbound, PushFailure, PushSink

log = logging.getLogger(__name__)

REFILL = 1 << 30
"""Window given back once this many bytes have arrived (on the connection or a stream)."""


class _Stream:
    def __init__(self, sink: PushSink) -> None:
        self.inbound = Inbound(sink)
        self.consumed = 0


class _Connection:
    """One client connection, served by its own thread until it closes."""

    def __init__(self, server: PushServer, sock: socket.socket) -> None:
        self._server = server
        self._sock = sock
        self._reader = h2.Reader(sock)
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._streams: dict[int, _Stream] = {}
        self._last_id = 0
        self._consumed = 0

    def serve(self) -> None:
        try:
            if self._reader.read(len(h2.PREFACE)) != h2.PREFACE:
                return
            settings = {h2.SETTINGS_MAX_FRAME_SIZE: h2.MAX_FRAME_SIZE,
                        h2.SETTINGS_INITIAL_WINDOW_SIZE: h2.MAX_WINDOW}  # fmt: skip
            self._write(h2.settings_frame(settings),
                        h2.window_update(0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW))  # fmt: skip
            while True:
                self._on_frame(*self._reader.frame())
        except (h2.H2Error, OSError):
            pass  # the client went away
        except (hpack.HPACKError, ValueError) as e:
            log.warning("KV push connection closed: %s", e)
            with contextlib.suppress(OSError):
                self._write(h2.goaway(self._last_id, h2.PROTOCOL_ERROR, str(e)[:200]))
        finally:
            for stream in self._streams.values():
                self._fail(stream, None)
            self._streams.clear()
            self._sock.close()

    def _write(self, *frames: bytes) -> None:
        h2.send_all(self._sock, list(frames))

    def abort(self) -> None:
        """Cut the connection (any thread): a receive under way ends at once."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _on_frame(self, kind: int, flags: int, sid: int, length: int) -> None:
        if kind == h2.DATA:
            self._on_data(flags, sid, length)
        elif kind == h2.HEADERS:
            block = self._reader.header_block(flags, sid, self._reader.read(length))
            headers = h2.decode_headers(self._decoder, block)
            self._on_headers(sid, headers, bool(flags & h2.END_STREAM))
        elif kind == h2.RST_STREAM:
            self._reader.skip(length)
            stream = self._streams.pop(sid, None)
            if stream is not None:
                self._fail(stream, None)
        elif kind == h2.SETTINGS:
            self._reader.skip(length)  # nothing the client sets matters to the answers
            if not flags & h2.ACK:
                self._write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.PING:
            payload = self._reader.read(length)
            if not flags & h2.ACK:
                self._write(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.GOAWAY:
            self._reader.skip(length)
            raise h2.H2Error("the client is going away")
        else:  # WINDOW_UPDATE (answers are a few bytes), PRIORITY, unknown
            self._reader.skip(length)

    def _on_headers(self, sid: int, headers: dict[str, str], end: bool) -> None:
        if sid in self._streams:  # trailers from the client: nothing in them matters
            if end:
                self._end(sid)
            return
        if sid <= self._last_id:
            return  # a stream already answered: nothing more to say on it
        if not sid % 2:
            raise ValueError(f"stream {sid} is not a client's stream id")
        self._last_id = sid
        refusal = self._server.refusal(headers)
        if refusal is not None:
            self._answer_error(sid, *refusal, client_done=end)
            return
        self._streams[sid] = _Stream(self._server.sinks(self.abort))
        if end:
            self._end(sid)

    def _on_data(self, flags: int, sid: int, length: int) -> None:
        full = length
        self._consumed += full
        stream = self._streams.get(sid)
        pad = 0
        if flags & h2.PADDED and length:
            pad = self._reader.read(1)[0]
            length -= 1
            if pad > length:
                raise ValueError("a DATA frame's padding is longer than the frame")
        if stream is None:  # ended, refused or unknown: the bytes are dropped
            self._reader.skip(length - pad)
        else:
            stream.consumed += full
            try:
                stream.inbound.feed(self._reader, length - pad)
            except (h2.H2Error, OSError):
                raise
            except Exception as e:  # the sink's or the message's fault: this call fails
                self._reader.skip(stream.inbound.frame_left)
                del self._streams[sid]
                self._answer_error(sid, *self._fail(stream, e),
                                   client_done=bool(flags & h2.END_STREAM))  # fmt: skip
                stream = None
        self._reader.skip(pad)
        refill = [h2.window_update(0, self._consumed)] if self._consumed >= REFILL else []
        if refill:
            self._consumed = 0
        if stream is not None and stream.consumed >= REFILL:
            refill.append(h2.window_update(sid, stream.consumed))
            stream.consumed = 0
        if refill:
            self._write(*refill)
        if stream is not None and flags & h2.END_STREAM:
            self._end(sid)

    def _end(self, sid: int) -> None:
        stream = self._streams.pop(sid)
        try:
            if stream.inbound.mid_message:
                raise PushFailure(grpc.StatusCode.INTERNAL, "the KV stream ended inside a message")
            ack = stream.inbound.sink.end()
        except Exception as e:
            self._answer_error(sid, *self._fail(stream, e), client_done=True)
            return
        head = self._encoder.encode([(":status", "200"), ("content-type", h2.GRPC_CONTENT_TYPE)])
        trailers = self._encoder.encode([("grpc-status", "0")])
        self._write(
            h2.frame(h2.HEADERS, h2.END_HEADERS, sid, head),
            h2.frame(h2.DATA, 0, sid, h2.grpc_prefix(len(ack)) + ack),
            h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, trailers),
        )

    def _fail(self, stream: _Stream, error: BaseException | None) -> tuple[grpc.StatusCode, str]:
        try:
            return stream.inbound.sink.fail(error)
        except Exception:
            log.exception("cleaning up a failed KV push")
            return grpc.StatusCode.INTERNAL, "the push failed"

    def _answer_error(
        self, sid: int, code: grpc.StatusCode, details: str, *, client_done: bool
    ) -> None:
        """A trailers-only answer; the client is told to stop sending if it has not."""
        block = self._encoder.encode([
            (":status", "200"), ("content-type", h2.GRPC_CONTENT_TYPE),
            ("grpc-status", str(code.value[0])),
            ("grpc-message", h2.encode_grpc_message(details)),
        ])  # fmt: skip
        frames = [h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, block)]
        if not client_done:
            frames.append(h2.rst_stream(sid, h2.NO_ERROR))
        self._write(*frames)


class PushServer:
    """Listens on ``host:port`` (0: a free port, :attr:`port` says which) and serves each
    connection on its own thread; ``sinks(abort)`` makes the sink of each call (``abort``
    cuts that call's connection)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        sinks: Callable[[Callable[[], None]], PushSink],
        path: str,
        unauthenticated: str,
    ) -> None:
        self.sinks = sinks
        self._path = path
        self._expected = f"Bearer {token}".encode()
        self._unauthenticated = unauthenticated
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise OSError(
                f"cannot listen for KV pushes on {host}:{port}: {e.strerror}; choose another "
                "--kv-port"
            ) from None
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-push-accept", daemon=True)
        self._thread.start()

    def refusal(self, headers: dict[str, str]) -> tuple[grpc.StatusCode, str] | None:
        """Why a call with these headers is not served, or None."""
        got = headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, self._expected):
            return grpc.StatusCode.UNAUTHENTICATED, self._unauthenticated
        if headers.get(":path") != self._path:
            return (grpc.StatusCode.UNIMPLEMENTED,
                    f"this port serves {self._path} only, not {headers.get(':path')}")  # fmt: skip
        if not headers.get("content-type", "").startswith(h2.GRPC_CONTENT_TYPE):
            return grpc.StatusCode.INVALID_ARGUMENT, "content-type must be application/grpc"
        return None

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                h2.tune(sock)
            except OSError:  # already reset by the peer
                sock.close()
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._open.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="kv-push-conn",
                             daemon=True).start()  # fmt: skip

    def _serve(self, sock: socket.socket) -> None:
        try:
            _Connection(self, sock).serve()
        finally:
            with self._lock:
                self._open.discard(sock)

    def close(self) -> None:
        """Stop accepting and cut every connection (their calls fail; threads exit)."""
        with self._lock:
            self._closed = True
            conns = list(self._open)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
