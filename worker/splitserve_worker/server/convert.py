"""Conversions between the wire messages the worker's server receives or answers and
the contract's, the engine's and the transports' types.

Nothing here imports torch or the engine at module level (engine types are for typing
only). What a caller of a worker builds or reads (sampling parameters on the way out,
top logprobs on the way back) is converted by :mod:`splitserve_worker.client`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve.kv_compat import Compat
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.kv.transport import RankTarget, TransferTarget

if TYPE_CHECKING:
    from splitserve_worker.engine.prompt_logprobs import PromptLogprobs
    from splitserve_worker.engine.sequence import RequestOutput


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The request's sampling parameters, checked: raises
    :class:`~splitserve.sampling.SamplingError` naming a field out of bounds. Fields left
    at zero on the wire take their defaults where zero means nothing (top_p,
    max_tokens, repetition_penalty)."""
    sp = SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.max_tokens != 0 else SamplingParams.max_tokens,
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        logprobs=msg.logprobs,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        resumed_tokens=msg.resumed_tokens,
        top_logprobs=msg.top_logprobs,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )
    sp.validate()
    return sp


def compat_to_proto(c: Compat) -> pb.CompatInfo:
    return pb.CompatInfo(
        hash=c.hash,
        model=c.model,
        dtype=c.dtype,
        block_size=c.block_size,
        num_layers=c.num_layers,
        kv_heads=c.kv_heads,
        head_dim=c.head_dim,
        kv_layout=c.kv_layout,
    )


def compat_from_proto(msg: pb.CompatInfo) -> Compat:
    return Compat(
        model=msg.model,
        dtype=msg.dtype,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        kv_heads=msg.kv_heads,
        head_dim=msg.head_dim,
        kv_layout=msg.kv_layout,
        hash=msg.hash,
    )


def target_from_handle(h: pb.TransferHandle) -> TransferTarget:
    return TransferTarget(
        request_id=h.request_id,
        lease_id=h.lease_id,
        decode_address=h.decode_address,
        block_ids=tuple(h.block_ids),
        num_tokens=h.num_prompt_tokens,
        compat_hash=h.compat.hash,
        backend_metadata=h.backend_metadata,
        deadline_unix=h.lease_expires_unix,
        kv_ranks=tuple(
            RankTarget(r.rank, r.kv_head_start, r.kv_head_stop, r.backend_metadata)
            for r in h.kv_ranks
        ),
    )


def top_to_proto(top: Sequence[tuple[int, float]]) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def prompt_logprobs_to_proto(p: PromptLogprobs) -> pb.PromptLogprobs:
    tops = [top_to_proto(t) for t in p.tops] if any(p.tops) else []
    return pb.PromptLogprobs(logprobs=p.logprobs, top_logprobs=tops, ranks=p.ranks)


def chunk_from_output(out: RequestOutput) -> pb.TokenChunk:
    chunk = pb.TokenChunk(
        request_id=out.request_id,
        token_ids=list(out.new_token_ids),
        logprobs=[float(x) if x is not None else 0.0 for x in out.new_logprobs],
        top_logprobs=[top_to_proto(t) for t in out.new_top_logprobs],
        finish_reason=(out.finish_reason or "") if out.finished else "",
        error=out.error or "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.prompt_logprobs is not None:
        chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
    return chunk
