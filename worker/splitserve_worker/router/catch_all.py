"""The router's last answer: an exception no handler turned into an answer (a bug, not a
bad request) becomes a 500 in the OpenAI shape, logged with the request's id, and the
connection stays open for the client's next request.

Every answer carries its request id (``x-request-id``: the client's own when it sent a
plain one, else a new one), so a client can quote the id the log names.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from splitserve_worker.router.errors import ErrorJSON, error_body

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HEADER = b"x-request-id"
_PLAIN_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


def request_id(scope: Scope) -> str:
    """The client's ``x-request-id`` when it is a plain token, else a new id."""
    for key, value in scope.get("headers") or ():
        if key == HEADER and _PLAIN_ID.fullmatch(value):
            return bytes(value).decode("ascii")
    return "req-" + uuid.uuid4().hex[:16]


class CatchAll:
    """ASGI middleware: the outermost of the app's own."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (HEADER, rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:  # logged whole, with its cause; the client gets the id
            log.exception("request %s (%s %s) failed in the router", rid, scope.get("method"),
                          scope.get("path"))  # fmt: skip
            if started:  # half an answer went out: the server ends the connection
                raise
            body = error_body(
                500,
                f"the router failed to serve this request; its error is logged under "
                f"request id {rid}",
                code="internal_error",
            )
            await ErrorJSON(body, status_code=500, headers={"x-request-id": rid})(
                scope, receive, send
            )
