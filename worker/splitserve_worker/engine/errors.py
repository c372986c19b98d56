"""Errors the engine raises, each saying what the caller can do about it."""

from __future__ import annotations


class RequestError(ValueError):
    """One request cannot be served as given (empty prompt, too long, bad sampling).

    The engine keeps serving every other request; fix the request and send it again.
    """


class NoCapacity(RuntimeError):
    """Not enough free KV blocks right now; retry later or on another worker."""

    def __init__(self, message: str, *, needed: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


class UnknownRequest(KeyError):
    """No request with that id is known to this engine (finished, released or never added)."""
