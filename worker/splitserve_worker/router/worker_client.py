"""What the router calls on a worker, and the sampling parameters it sends.

The router depends only on the :class:`WorkerConn` protocol;
:class:`splitserve_worker.server.client.WorkerClient` implements it over gRPC, and tests
put in-memory workers in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.server.convert import top_from_proto


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters as sent to workers (mirrors the engine's SamplingParams; the
    client turns them into the proto with ``server.convert.sampling_to_proto``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    resumed_tokens: int = 0
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None


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
        compat: pb.CompatInfo | None = None,
        lease_seconds: float = 0.0,
        kv_backend: str = "",
        timeout: float | None = None,
    ) -> pb.TransferHandle: ...

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        handle: pb.TransferHandle,
        timeout: float | None = None,
    ) -> pb.PrefillResponse: ...

    def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: Sampling,
        expect_remote_kv: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[pb.TokenChunk]: ...

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool: ...

    async def close(self, grace: float | None = None) -> None:
        """Close the connection; with ``grace``, calls under way have that long to end."""
