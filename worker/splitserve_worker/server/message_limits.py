"""How large each RPC's request may be: bounded by what it can hold for this worker's
model, and checked before the message is parsed.

grpcio bounds received messages for a whole server (:data:`~splitserve.grpc_options.
MAX_MESSAGE_BYTES`, which KV spans need); here each method's own bound applies on top,
from its size alone, so a prompt of millions of tokens is refused without being decoded
into millions of integers. A method's deserializer (see :func:`bounded`) hands an
oversized request to its handler as an :class:`Oversized`, which the handler refuses
with INVALID_ARGUMENT (the caller's own fault: never a lost worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.grpc_options import MAX_MESSAGE_BYTES

VARINT_BYTES = 5
"""Most bytes one token id (an int32 below 2**31) takes on the wire."""
SAMPLING_SLACK = 1 << 20
"""Everything a request carries besides its prompt: its ids and sampling parameters (16
stop strings of 256 characters, 1,024 logit biases) fit many times over."""
SCORE_BYTES_PER_TOKEN = 512
"""A Commit's prompt logprobs per prompt token: its logprob and rank and 20 alternatives
(an id and a float each, with their tags)."""
SMALL = 64 << 10
"""Requests that carry no prompt (Health, Reserve, Release, Cancel, Events)."""


@dataclass(frozen=True)
class Oversized:
    """A request larger than its method takes, unparsed."""

    method: str
    size: int
    limit: int

    def message(self) -> str:
        return (
            f"a {self.method} request of {self.size} bytes; this worker takes at most "
            f"{self.limit} (prompts of up to its model's length): send a shorter one"
        )


def request_limits(max_model_len: int) -> dict[str, int]:
    """Each RPC's largest request for a model of ``max_model_len`` tokens (PushKV's spans
    are bounded by the server's limit and their own checks)."""
    prompt = max_model_len * VARINT_BYTES + SAMPLING_SLACK
    return {
        "Generate": prompt,
        "Prefill": prompt + max_model_len * VARINT_BYTES,  # and the handle's block ids
        "Commit": min(MAX_MESSAGE_BYTES, max_model_len * SCORE_BYTES_PER_TOKEN + SAMPLING_SLACK),
        "PushKV": MAX_MESSAGE_BYTES,
    }


def limit_of(method: str, limits: dict[str, int]) -> int:
    return limits.get(method, SMALL)


def bounded(deserialize: Callable[[bytes], Any], method: str, limit: int) -> Callable[[bytes], Any]:
    """``deserialize``, for requests of at most ``limit`` bytes; a larger one is an
    :class:`Oversized` (never parsed)."""

    def read(raw: bytes) -> Any:
        if len(raw) > limit:
            return Oversized(method, len(raw), limit)
        return deserialize(raw)

    return read
