"""What both ends of a splitserve gRPC call agree on besides the messages: the message
size limits and HTTP/2 settings of channels and servers, and how the shared worker token
travels (``authorization: Bearer <token>`` metadata).

Used by the worker client, the worker's server and its KV push senders alike; pure
(standard library only)."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
"""Both directions: KV spans are ~4 MiB, but a single large layer must never be refused."""

HTTP2_BULK: list[tuple[str, int]] = [
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.http2.lookahead_bytes", 64 << 20),
    ("grpc.http2.write_buffer_size", 64 << 20),
]
"""Large HTTP/2 frames and buffers: KV messages are megabytes, 16 KiB frames waste CPU."""

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *HTTP2_BULK,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

HANDSHAKE_TIMEOUT_MS = 5_000
"""A connection to a worker must complete its HTTP/2 setup (preface and settings) within
this: a peer that connects and sends nothing, or a byte at a time, is let go."""
MAX_CONNECTION_IDLE_MS = 120_000
"""A connection with no call in progress this long is closed (callers reconnect on their
next call; the router's always has its Events stream open)."""
KEEPALIVE_MS = 60_000
"""The server pings a client it has heard nothing from this long, and drops it when no
answer comes within :data:`KEEPALIVE_TIMEOUT_MS` (a peer whose host vanished)."""
KEEPALIVE_TIMEOUT_MS = 20_000

SERVER_OPTIONS: list[tuple[str, int]] = [
    *HTTP2_BULK,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]
"""A worker's gRPC server: as the channels, and bounded against idle, half-open and silent
connections (handshake timeout, idle limit, keepalive pings)."""

AUTH_HEADER = "authorization"


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
