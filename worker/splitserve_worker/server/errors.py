"""A failure with the gRPC status a caller should act on."""

from __future__ import annotations

import grpc


class RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
