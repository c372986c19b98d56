"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve_worker.router.failures import RequestFailed
from splitserve_worker.router.queues import Saturated

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class ErrorJSON(JSONResponse):
    """An error body as JSON, ASCII only: a message quoting what the client sent (a lone
    surrogate included) is always sendable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An answer to a request that could not be served, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def from_saturated(e: Saturated) -> APIError:
    return APIError(
        e.status,
        e.detail,
        code="queue_full" if e.status == 429 else "queue_timeout",
        headers={"Retry-After": str(e.retry_after_s)},
    )


def from_failure(e: Saturated | RequestFailed) -> APIError:
    """The answer to a request a queue refused or the workers could not serve."""
    if isinstance(e, Saturated):
        return from_saturated(e)
    return APIError(e.status, e.message, code="worker_error" if e.status >= 500 else None)


_TYPE_TAG = re.compile(r"(str|int|float|bool|(list|dict)\[.*\]|function-.*|[A-Z]\w*)")
"""What pydantic puts in an error's location for the member of a union it tried (``str``,
``list[int]``, ``function-after[...]``, a model's name), as opposed to field names."""


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    parts = [p for p in parts if not _TYPE_TAG.fullmatch(p)]
    return ".".join(parts) or None


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}  # fmt: skip


_OTHER_ENDPOINT = {"messages": "/v1/chat/completions", "prompt": "/v1/completions"}
_NOT_SERVED = {
    **dict.fromkeys(("functions", "function_call"), "function calling is not served here"),
    **dict.fromkeys(
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
        "constrained decoding is not served here",
    ),
    **dict.fromkeys(("audio", "modalities"), "only text is served here"),
    "prediction": "predicted outputs are not served here",
    "web_search_options": "web search is not served here",
    "reasoning_effort": "reasoning effort is not served here",
}
"""Fields other servers take, and why they are refused here."""


def _body_problem(err: dict[str, Any]) -> str | None:
    """What is wrong with a body that is not a JSON object at all (else ``None``)."""
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        reason = (err.get("ctx") or {}).get("error", "malformed")
        return f"the request body is not valid JSON: {reason}{where}"
    if loc != ("body",):
        return None
    got = err.get("input")
    if err.get("type") == "missing":
        return "the request body is empty: send a JSON object (Content-Type: application/json)"
    if isinstance(got, bytes | bytearray):
        return "the request body was not read as JSON: send it with Content-Type: application/json"
    kind = _JSON_TYPES.get(type(got))
    return f"the request body must be a JSON object, not {kind}" if kind else None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    body = _body_problem(errors[0])
    if body is not None:
        return body, None
    msgs = []
    param = None
    for err in errors[:5]:
        where = _loc(tuple(err.get("loc", ())))
        param = param or where
        text = str(err.get("msg", "invalid value"))
        text = text.removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden" and where in _OTHER_ENDPOINT:
            text += f" here (it belongs to {_OTHER_ENDPOINT[where]})"
        elif err.get("type") == "extra_forbidden" and where in _NOT_SERVED:
            text += f" ({_NOT_SERVED[where]})"
        msgs.append(f"{where}: {text}" if where else text)
    return "; ".join(msgs), param


def install(app: FastAPI) -> None:
    """Answer every error (ours, validation, routing) in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return ErrorJSON(error_body(400, message, param, "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ErrorJSON(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
