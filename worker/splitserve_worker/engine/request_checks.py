"""What a request must satisfy before an engine takes it: a pure check of its prompt and
sampling parameters against the model's vocabulary and length and the KV pool's size."""

from __future__ import annotations

from splitserve.sampling import SamplingError, SamplingParams

from splitserve_worker.engine.errors import RequestError
from splitserve_worker.engine.scheduler import blocks_for


def check_request(
    prompt: list[int],
    sampling: SamplingParams,
    *,
    vocab: int,
    max_model_len: int,
    block_size: int,
    total_blocks: int,
) -> None:
    """Raise :class:`RequestError` saying what is wrong and what to do about it."""
    if not prompt:
        raise RequestError("the prompt is empty: send at least one token")
    try:
        sampling.validate()
    except SamplingError as e:
        raise RequestError(str(e)) from None
    for what, ids in (("prompt", prompt), ("logit_bias", [t for t, _ in sampling.logit_bias])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"{what} token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
    total = len(prompt) + sampling.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) is "
            f"{total} tokens, over this model's limit of {max_model_len}: shorten the "
            f"prompt or lower max_tokens"
        )
    if blocks_for(total, block_size) > total_blocks:
        raise RequestError(
            f"prompt plus max_tokens ({total} tokens) needs {blocks_for(total, block_size)} KV "
            f"blocks, more than this worker's whole cache ({total_blocks} blocks of "
            f"{block_size}): shorten the request or give the worker more KV memory"
        )
