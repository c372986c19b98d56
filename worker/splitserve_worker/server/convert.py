"""Conversions between the wire messages and the engine's and transports' types.

Nothing here imports torch or the engine at module level, so the router can use the
sampling conversion without loading a model stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from splitserve.kv_compat import Compat
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.kv.transport import TransferTarget

if TYPE_CHECKING:
    from splitserve_worker.engine.prompt_logprobs import PromptLogprobs
    from splitserve_worker.engine.sampling import SamplingParams
    from splitserve_worker.engine.sequence import RequestOutput


def sampling_to_proto(sp: Any) -> pb.SamplingParams:
    """From any object with the engine's ``SamplingParams`` fields (or a proto, as is)."""
    if isinstance(sp, pb.SamplingParams):
        return sp
    msg = pb.SamplingParams(
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=int(sp.top_k),
        max_tokens=int(sp.max_tokens),
        min_tokens=int(sp.min_tokens),
        ignore_eos=bool(sp.ignore_eos),
        stop_token_ids=[int(t) for t in sp.stop_token_ids],
        stop=list(sp.stop),
        logprobs=bool(sp.logprobs),
        min_p=float(sp.min_p),
        presence_penalty=float(sp.presence_penalty),
        frequency_penalty=float(sp.frequency_penalty),
        repetition_penalty=float(sp.repetition_penalty),
        resumed_tokens=int(sp.resumed_tokens),
        top_logprobs=int(sp.top_logprobs),
        logit_bias={int(t): float(b) for t, b in sp.logit_bias},
    )
    if sp.seed is not None:
        msg.seed = int(sp.seed)
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = int(sp.prompt_logprobs)
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    from splitserve_worker.engine.sampling import SamplingParams

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
    )


def top_to_proto(top: Sequence[tuple[int, float]]) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(msg: pb.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip(msg.token_ids, msg.logprobs, strict=True))


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
