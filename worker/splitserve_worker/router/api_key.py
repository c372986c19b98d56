"""The router's API key: when one is configured (``--api-key``, ``--api-key-file``,
``SPLITSERVE_API_KEY``), a request must send ``Authorization: Bearer <key>``.

The app puts every route behind :func:`require_api_key` except those it lists as open
(``router.app.OPEN_PATHS``).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request

from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.errors import APIError


def require_api_key(config: RouterConfig) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency refusing (401) a request without the configured key; with no
    key configured it lets every request through."""

    async def check(request: Request) -> None:
        key = config.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check
