"""The shared worker token: loaded once, checked on every call by a server interceptor,
before the call's request is read.

The token is never logged or put in an error message.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from splitserve.grpc_options import AUTH_HEADER

TOKEN_ENV = "SPLITSERVE_WORKER_TOKEN"


class TokenError(ValueError):
    """No usable token was configured; the message says where to put one."""


def load_token(token_file: str | os.PathLike[str] | None, env: dict[str, str] | None = None) -> str:
    env = dict(os.environ) if env is None else env
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise TokenError(f"cannot read the token file {path}: {e.strerror}") from None
        if not token:
            raise TokenError(f"the token file {path} is empty")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    if not token:
        raise TokenError(
            f"workers need a shared token: pass --token-file FILE or set {TOKEN_ENV} "
            "(the router and every worker must use the same one)"
        )
    return token


UNAUTHENTICATED_MESSAGE = "missing or wrong worker token (send 'authorization: Bearer <token>')"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``.

    It decides on the call's metadata alone, before grpcio reads any message: a refused
    call is answered by a handler that never reads its request, so a caller without the
    token cannot make the worker receive (or parse) a message of tens of megabytes."""

    def __init__(self, token: str) -> None:
        if not token:
            raise TokenError("the worker token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def allowed(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.allowed(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that refuses the call unread: served as a request stream it never reads
    (a unary request would be received whole and parsed before any handler runs), with no
    deserializer; what the caller still sends is dropped with the call."""

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    ser = handler.response_serializer
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, None, ser)
    return grpc.stream_unary_rpc_method_handler(refuse, None, ser)
