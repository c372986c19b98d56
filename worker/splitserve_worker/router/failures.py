"""How an attempt on the workers failed, and what the router does about it: the
gRPC codes that mean a worker is lost (not only this request on it), the
exceptions that carry a failed attempt back to the retry loop, and the one that
ends a request."""

from __future__ import annotations

import grpc

LOST_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
}
"""Codes after which the worker itself is suspect: mark it unhealthy."""


class RequestFailed(Exception):
    """The request could not be served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Stale(Exception):
    """No worker fits the request any more once its prefill slot came (those it was
    planned on went down while it waited): plan again from the top, waiting for workers,
    without counting a failure."""


class AttemptFailed(Exception):
    def __init__(self, worker: str, reason: str, detail: str, lost: bool) -> None:
        super().__init__(f"{worker}: {detail}")
        self.worker = worker
        self.reason = reason
        self.detail = detail
        self.lost = lost
        """The worker itself failed (mark it unhealthy), not just this request on it."""


def rpc_details(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    det = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {det}"


def rpc_code(e: BaseException) -> grpc.StatusCode | None:
    return e.code() if isinstance(e, grpc.RpcError) and hasattr(e, "code") else None
