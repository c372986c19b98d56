"""The settings an ``InferenceService`` passes to its engines and its router: each
becomes a ``splitserve worker`` or ``splitserve router`` flag, and each left out keeps
that command's default."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from splitserve_operator.api.base import Quantity, SpecModel
from splitserve_operator.api.durations import Duration
from splitserve_operator.api.values import (
    ENGINE_MAX_BATCH_TOKENS,
    ENGINE_MAX_NUM_SEQS,
    Disaggregation,
    quantity_bytes,
)

MIN_KV_CACHE_BYTES = 1 << 20


class EngineSettings(SpecModel):
    """How a worker pool's engines batch and size their KV pool (``splitserve worker``
    flags); each one left out keeps the worker's default."""

    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Most sequences in a running batch."""
    max_batch_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    """Most tokens (prefill and decode together) computed in one step."""
    prefill_chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    """Prompt tokens per step while other sequences decode."""
    gpu_memory_percent: Annotated[int, Field(ge=1, le=100)] | None = None
    """Percent of the GPU memory left after the weights that the KV pool takes."""
    kv_cache_memory: Quantity | None = None
    """The KV pool's size as a quantity (``8Gi``); overrides ``gpuMemoryPercent``."""
    threads: Annotated[int, Field(ge=1, le=512)] | None = None
    """torch CPU threads per worker."""

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value: Quantity | None) -> Quantity | None:
        if value is not None and quantity_bytes(value) < MIN_KV_CACHE_BYTES:
            raise ValueError(f"must be at least 1Mi (got {value!r})")
        return value

    @model_validator(mode="after")
    def _batch_holds_the_sequences(self) -> EngineSettings:
        seqs = self.max_num_seqs or ENGINE_MAX_NUM_SEQS
        tokens = self.max_batch_tokens or ENGINE_MAX_BATCH_TOKENS
        if tokens < seqs:
            raise ValueError(
                f"maxBatchTokens ({tokens}) must be at least maxNumSeqs ({seqs}): every "
                "running sequence decodes one token per step"
            )
        return self


Timeout = Annotated[float, Duration(at_most=86_400)]


class RouterQueues(SpecModel):
    """The router's two bounded queues (its ``queues`` config section)."""

    prefill_max_waiting: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Requests waiting for a prefill slot; more get 429."""
    decode_max_waiting: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Requests waiting for a decode slot; more get 429."""
    prefill_slots_per_worker: Annotated[int, Field(ge=1, le=1024)] | None = None
    decode_slots_per_worker: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_wait: Annotated[float, Duration(at_most=3600)] | None = None
    """Longest wait in one queue before a 503."""
    retry_after: Annotated[float, Duration(at_least=1, at_most=3600)] | None = None
    """Retry-After of the 429 and 503 answers, whole seconds (the header's unit)."""

    @field_validator("retry_after")
    @classmethod
    def _whole_seconds(cls, value: float | None) -> float | None:
        if value is not None and not value.is_integer():
            raise ValueError(
                f"must be whole seconds such as 5s or 1m, the Retry-After header's unit "
                f"(got {value:g}s)"
            )
        return value


class RouterTimeouts(SpecModel):
    """The router's bounds on each wait (its ``timeouts`` config section)."""

    connect: Timeout | None = None
    """Control calls to workers: Health, Reserve, Release, Cancel."""
    prefill: Timeout | None = None
    """One remote prefill, its KV push included."""
    first_token: Timeout | None = None
    """From dispatch to a request's first token."""
    inter_token: Timeout | None = None
    """Longest gap between two tokens before the worker counts as lost."""
    request: Timeout | None = None
    """A whole request, end to end."""
    health_interval: Annotated[float, Duration(at_most=600)] | None = None
    """Between two health checks of each worker."""


class RouterSettings(SpecModel):
    """What the router does with requests; each one left out keeps the router's default
    (``splitserve router --help``)."""

    disaggregation: Disaggregation | None = None
    """auto: a cost model decides per request; always / never: remote prefill or not."""
    max_model_len: Annotated[int, Field(ge=2, le=10_000_000)] | None = None
    """Lowers the longest prompt plus completion accepted (default: the model's own)."""
    default_max_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] | None = None
    max_retries: Annotated[int, Field(ge=0, le=10)] | None = None
    queues: RouterQueues | None = None
    timeouts: RouterTimeouts | None = None
