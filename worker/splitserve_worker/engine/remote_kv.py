"""Remote KV admission for the decode role: reserve blocks, admit a prompt whose K/V
was written from outside, release what a request holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from splitserve.sampling import SamplingParams

from splitserve_worker.engine.errors import NoCapacity, RequestError
from splitserve_worker.engine.sequence import FinishReason

if TYPE_CHECKING:
    from splitserve_worker.engine.engine import Engine


def reserve(engine: Engine, request_id: str, num_prompt_tokens: int) -> list[int]:
    """:meth:`Engine.reserve` (see there)."""
    if request_id in engine._seqs or request_id in engine._reserved:
        raise RequestError(f"request id {request_id!r} is already in use on this engine")
    if not 0 < num_prompt_tokens < engine.max_model_len:
        raise RequestError(
            f"num_prompt_tokens must be in [1, {engine.max_model_len - 1}], got {num_prompt_tokens}"
        )
    if engine.num_running + engine.num_waiting + engine.num_reserved >= engine.config.max_num_seqs:
        raise NoCapacity(
            f"decode batch full ({engine.config.max_num_seqs} sequences)",
            free=engine.kv.free_blocks,
        )
    ids = engine._reserved.hold(request_id, num_prompt_tokens)
    engine._update_gauges()
    return ids


def admit_prefilled(
    engine: Engine,
    request_id: str,
    prompt_token_ids: Iterable[int],
    first_token: int,
    first_logprob: float | None,
    sampling: SamplingParams | None = None,
) -> None:
    """:meth:`Engine.admit_prefilled` (see there)."""
    r = engine._reserved.get(request_id)
    prompt = [int(t) for t in prompt_token_ids]
    sampling = sampling or SamplingParams()
    if len(prompt) != r.num_tokens:
        raise RequestError(f"prompt has {len(prompt)} tokens but {r.num_tokens} were reserved")
    engine._reserved.take(request_id)
    try:
        engine._check_request(request_id, prompt, sampling)
    except RequestError:
        engine.kv.blocks.free(reversed(r.blocks))
        engine._update_gauges()
        raise
    seq = engine._new_seq(request_id, prompt, sampling)
    seq.prompt_logprobs = None  # the prefill side scored the prompt
    if seq.generator is not None:
        # the prefill side drew the first token from the same seed: skip that draw
        noise = torch.empty(engine.shape.vocab_size, device=engine.device)
        noise.exponential_(1.0, generator=seq.generator)
    seq.block_table = list(r.blocks)
    engine._seqs[request_id] = seq
    engine.scheduler.add_running(seq)
    engine.scheduler.commit(seq, len(prompt), cache=engine.config.enable_prefix_cache)
    seq.tokens.append(int(first_token))
    reason, stop_reason = engine.stopper.check(seq)
    if reason is not None:
        out = engine._finish(seq, reason, stop_reason=stop_reason, emit=False)
        engine._pending.append(out)
    engine._update_gauges()


def release(engine: Engine, request_id: str) -> int:
    """:meth:`Engine.release` (see there)."""
    if request_id in engine._reserved:
        n = engine._reserved.release(request_id)
        engine._update_gauges()
        return n
    seq = engine._seqs.get(request_id)
    if seq is None:
        return 0
    n = len(seq.block_table)
    engine._finish(seq, FinishReason.ABORT)
    engine._update_gauges()
    return n
