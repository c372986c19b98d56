"""A cap on request bodies: a client cannot make the router hold an unbounded body in
memory. Over the cap, the answer is 413 in the OpenAI error shape, whether the size is
declared (``Content-Length``) or only seen as a chunked body arrives."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from splitserve_worker.router.errors import ErrorJSON, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def too_large(limit: int) -> str:
    return (
        f"the request body is larger than this router accepts ({limit} bytes, "
        "max_request_bytes in the router config): send fewer or shorter prompts"
    )


class BodyLimit:
    """ASGI middleware refusing HTTP request bodies of more than ``limit`` bytes."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = ErrorJSON(error_body(413, too_large(self.limit)), status_code=413)
            await response(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # answered as any HTTP error, in the OpenAI shape
                    raise HTTPException(413, too_large(self.limit))
            return message

        await self.app(scope, counted, send)
