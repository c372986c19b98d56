"""The router's port to a worker: what it calls on one (:class:`WorkerConn`), and the
prompt scores it reads back.

The router depends only on the :class:`WorkerConn` protocol;
:class:`splitserve_worker.client.WorkerClient` implements it over gRPC, and tests put
in-memory workers in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.client import top_from_proto


@dataclass(frozen=True)
class PromptScores:
    """Prompt logprobs as a worker returns them with the first token: for each prompt
    token after the first, its logprob given the ones before it and, when asked for, the
    most likely tokens at its position (best first)."""

    logprobs: tuple[float, ...]
    top_logprobs: tuple[list[tuple[int, float]], ...] = ()
    ranks: tuple[int, ...] = ()

    @classmethod
    def from_chunk(cls, chunk: pb.TokenChunk) -> PromptScores | None:
        if not chunk.HasField("prompt_logprobs"):
            return None
        p = chunk.prompt_logprobs
        tops = tuple(top_from_proto(t) for t in p.top_logprobs)
        return cls(tuple(p.logprobs), tops, tuple(p.ranks))


class WorkerConn(Protocol):
    """What the router calls on one worker."""

    address: str

    async def health(self, timeout: float | None = None) -> pb.HealthResponse: ...

    def events(self) -> AsyncIterator[pb.KVEvent]: ...

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        compat: pb.CompatInfo,
        lease_seconds: float = 0.0,
        kv_backend: str = "",
        timeout: float | None = None,
    ) -> pb.TransferHandle: ...

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        handle: pb.TransferHandle,
        timeout: float | None = None,
    ) -> pb.PrefillResponse: ...

    def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        expect_remote_kv: bool = False,
        timeout: float | None = None,
        recompute_prompt: bool = False,
    ) -> AsyncIterator[pb.TokenChunk]: ...

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool: ...

    async def close(self, grace: float | None = None) -> None:
        """Close the connection; with ``grace``, calls under way have that long to end."""
