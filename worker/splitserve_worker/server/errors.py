"""A failure with the gRPC status a caller should act on."""

from __future__ import annotations

from collections.abc import Sequence

import grpc


class RpcFailure(Exception):
    def __init__(
        self, code: grpc.StatusCode, message: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = tuple(metadata)
        """Trailing metadata the call ends with (what a caller acts on besides the code)."""
