"""How an attempt on the workers failed, and what the router does about it: the
gRPC codes that mean a worker is lost (not only this request on it), the
exceptions that carry a failed attempt back to the retry loop, and the one that
ends a request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from splitserve.roles import SWITCHING_METADATA

if TYPE_CHECKING:
    from splitserve_worker.router.scoring import WorkerView

LOST_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
}
"""Codes after which the worker itself is suspect: mark it unhealthy."""

UNSENDABLE = (UnicodeError, ValueError, TypeError, OverflowError)
"""What building a call's message raises for a value its wire cannot carry (a lone
surrogate in a string, a number out of its field's range): the request's own fault,
found before any byte left the router, never the worker's."""


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
    """One attempt failed on ``worker`` (the view it was planned on: its name and the
    instance, so a restarted worker at that address is not the one that failed)."""

    def __init__(self, worker: WorkerView, reason: str, detail: str, lost: bool) -> None:
        super().__init__(f"{worker.name}: {detail}")
        self.worker = worker.name
        self.identity = worker.identity
        self.instance = worker.instance
        self.reason = reason
        self.detail = detail
        self.lost = lost
        """The worker itself failed (mark it unhealthy), not just this request on it."""


class WorkerSwitching(Exception):
    """``worker`` refused the attempt, or ended its stream, because it is switching its
    role: plan the request elsewhere (a stream resumes with its tokens so far) without
    counting a failure, and send nothing more there until its Health says the switch is
    over."""

    def __init__(self, worker: WorkerView, detail: str) -> None:
        super().__init__(f"{worker.name}: {detail}")
        self.worker = worker.name
        self.instance = worker.instance
        self.detail = detail


def switching(e: BaseException) -> bool:
    """Whether a call failed because its worker is switching its role (it says so in the
    call's trailing metadata)."""
    if not isinstance(e, grpc.RpcError) or not hasattr(e, "trailing_metadata"):
        return False
    return any(key == SWITCHING_METADATA for key, _ in e.trailing_metadata() or ())


def unsendable(e: BaseException) -> RequestFailed:
    """The answer to a request whose call could not be built (:data:`UNSENDABLE`)."""
    return RequestFailed(400, f"the request cannot be sent to a worker: {e}")


def rpc_details(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    det = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {det}"


def rpc_code(e: BaseException) -> grpc.StatusCode | None:
    return e.code() if isinstance(e, grpc.RpcError) and hasattr(e, "code") else None
