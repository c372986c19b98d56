"""One request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from splitserve.prefix_hash import ROOT_HASH, block_hashes
from splitserve.sampling import SamplingParams

from splitserve_worker.engine.prompt_logprobs import ChunkScores, PromptLogprobs, chunk_targets
from splitserve_worker.engine.sampling import SampleRow, TopLogprobs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """One list per new token when the request asked for top logprobs, else empty."""
    prompt_logprobs: PromptLogprobs | None = None
    """With the first token, when the request asked for prompt logprobs."""


@dataclass
class PrefillResult:
    """What a layer-wise prefill returns: the first token and how much was cached."""

    first_token: int
    first_logprob: float | None
    num_cached_tokens: int
    num_prompt_tokens: int
    first_top_logprobs: TopLogprobs = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class Sequence:
    """Tokens, KV blocks and progress of one request.

    ``tokens`` is prompt plus output. The KV of ``tokens[:num_computed]`` is in the
    blocks of ``block_table``; a step feeds ``tokens[num_computed:...]`` and, once
    ``num_computed`` reaches ``len(tokens)``, samples the next token. A preempted
    sequence drops its blocks and recomputes all of its tokens when it runs again.
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    """Leading blocks of ``block_table`` already offered to the prefix cache."""
    prompt_logprobs: PromptLogprobs | None = None
    """Scores of the prompt's tokens, filled as its chunks run (when asked for)."""
    reuse_prefix: bool = True
    """Whether cached prefix blocks may stand in for computing the prompt's first blocks."""

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next one can be sampled."""
        return len(self.tokens) - self.num_computed

    def scores_for(self, num_tokens: int) -> ChunkScores | None:
        """What to score in the next ``num_tokens`` computed: the prompt rows whose next
        token is a prompt token, until the first token has gone out."""
        top = self.params.prompt_logprobs
        if self.prompt_logprobs is None or top is None or self.num_output:
            return None
        start = self.num_computed
        targets = chunk_targets(self.tokens, self.prompt_len, start, start + num_tokens)
        return ChunkScores(targets, top) if targets else None

    def sample_row(self, suppress: list[int]) -> SampleRow:
        """What the sampler needs to choose the next token, ``suppress`` being the token
        ids it may not choose yet."""
        return SampleRow(self.params, self.generator, suppress, self.tokens, self.prompt_len)

    def record_scores(self, start: int, scores: ChunkScores | None) -> None:
        if scores is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.record(start, scores)

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Hashes of every full block of ``tokens``, extended incrementally."""
        n_full = len(self.tokens) // block_size
        if len(self.hashes) < n_full:
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            start = len(self.hashes) * block_size
            self.hashes.extend(
                block_hashes(
                    self.tokens[: n_full * block_size], block_size, parent=parent, start=start
                )
            )
        return self.hashes


def output_of(
    seq: Sequence,
    tokens: list[int],
    logprobs: list[float | None],
    *,
    finished: bool,
    reason: FinishReason | None = None,
    error: str | None = None,
    stop_reason: int | str | None = None,
) -> RequestOutput:
    """What one step hands back for ``seq``: its new tokens, and why it ended if it did."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason=reason.value if reason is not None else None,
        error=error,
        num_prompt_tokens=seq.prompt_len,
        num_cached_tokens=seq.num_cached_tokens,
        stop_reason=stop_reason,
    )
